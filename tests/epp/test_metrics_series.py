"""The EPP's own metric children (epp.metrics._Series): their samples are the ones prometheus_client's own
Histogram, Counter and Gauge give for the same updates, compiled (metrics.pxd types them) or not."""

import math

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from epp.metrics import DURATION_BUCKETS, TOKEN_BUCKETS, _Series

values = st.floats(allow_nan=False, allow_infinity=True) | st.sampled_from(DURATION_BUCKETS + TOKEN_BUCKETS)


def samples(families) -> dict:
    """(name, labels) to value ("nan" for a NaN: a sum of +inf and -inf is one)."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): "nan" if math.isnan(s.value) else s.value
        for family in families
        for s in family.samples
        if not s.name.endswith("_created")
    }


@given(st.lists(values, max_size=60), st.sampled_from([DURATION_BUCKETS, TOKEN_BUCKETS, (0.5,)]))
def test_a_histogram_counts_as_prometheus_client_does(observed, buckets):
    ours = _Series("histogram", "h", "A histogram.", ("model",), buckets)
    registry = CollectorRegistry()
    theirs = Histogram("h", "A histogram.", ("model",), buckets=buckets, registry=registry)
    for value in observed:
        ours.labels("m").observe(value)
        theirs.labels("m").observe(value)
    assert samples(ours.collect()) == samples(registry.collect())


@given(st.lists(st.tuples(st.booleans(), st.floats(-1e6, 1e6)), max_size=40))
def test_counters_and_gauges_add_as_prometheus_client_does(updates):
    counter, gauge = _Series("counter", "c", "A counter.", ("k",)), _Series("gauge", "g", "A gauge.", ("k",))
    registry = CollectorRegistry()
    their_counter = Counter("c", "A counter.", ("k",), registry=registry)
    their_gauge = Gauge("g", "A gauge.", ("k",), registry=registry)
    for up, amount in updates:
        counter.labels("x").inc(abs(amount))
        their_counter.labels("x").inc(abs(amount))
        (gauge.labels("x").inc if up else gauge.labels("x").dec)(amount)
        (their_gauge.labels("x").inc if up else their_gauge.labels("x").dec)(amount)
    counter.labels("y").inc()  # the default amount
    their_counter.labels("y").inc()
    assert samples([*counter.collect(), *gauge.collect()]) == samples(registry.collect())


def test_nan_counts_in_the_last_bucket_as_in_the_go_client():
    """prometheus_client counts a NaN in no bucket (its _count then misses it); Prometheus's Go client, as here, in
    +Inf."""
    series = _Series("histogram", "h", "A histogram.", (), (1.0, 2.0))
    series.labels().observe(math.nan)
    series.labels().observe(1.5)
    got = samples(series.collect())
    assert got[("h_bucket", (("le", "1.0"),))] == 0 and got[("h_bucket", (("le", "2.0"),))] == 1
    assert got[("h_bucket", (("le", "+Inf"),))] == 2 and got[("h_count", ())] == 2 and got[("h_sum", ())] == "nan"
