"""Every built-in scorer, filter and picker, table-driven against hand-made endpoints."""

from collections import Counter

import pytest

from epp.config import ConfigError
from epp.datalayer.endpoint import MAX_KNOWN_ADAPTERS, Endpoint, EndpointSpec
from epp.datalayer.load import queue_depth, running_requests
from epp.scheduling.load import queue_depths
from epp.scheduling.plugins import PLUGIN_TYPES, build_plugin
from epp.scheduling.types import CycleState, SchedulingRequest, SchedulingResult
from protocol.metrics import EndpointMetrics
from tests.epp.helpers import endpoint


def req(model="m", prompt="", **kw):
    return SchedulingRequest(request_id="r", model=model, prompt=prompt, **kw)


def never_scraped(i, in_flight=0):
    e = endpoint(i, in_flight=in_flight)
    e.metrics = None
    return e


def scraped_with(in_flight_at_scrape, **kw):
    """An endpoint whose last scrape was taken while the EPP had `in_flight_at_scrape` requests in flight there."""
    e = endpoint(0, **kw)
    e.in_flight_at_scrape = in_flight_at_scrape
    return e


@pytest.mark.parametrize(
    ("e", "queue", "running"),
    [
        (endpoint(0, waiting=3, running=2), 3, 2),
        # a burst routed since the last scrape: what the scrape does not show yet counts as queued
        (endpoint(0, waiting=0, running=0, in_flight=4), 4, 4),
        (endpoint(0, waiting=1, running=2, in_flight=7), 5, 6),
        # everything in flight is visible already: the scrape is the truth
        (endpoint(0, waiting=1, running=2, in_flight=3), 1, 2),
        (never_scraped(0, in_flight=2), 2, 2),
        # the request the scrape saw waiting has finished since: the queue is empty, not one deep
        (scraped_with(1, waiting=1, running=1, in_flight=0), 0, 1),
        # three finished and one was routed since: at least two slots freed for the three waiting
        (scraped_with(4, waiting=3, running=4, in_flight=2), 1, 4),
        # as many routed as finished since: nothing is known to have left the queue
        (scraped_with(2, waiting=2, running=2, in_flight=2), 2, 2),
    ],
)
def test_load_estimates_include_requests_routed_and_finished_since_the_scrape(e, queue, running):
    assert (queue_depth(e), queue_depths(CycleState(), [e]), running_requests(e)) == (queue, [queue], running)


def test_queue_depths_are_computed_once_per_cycle_for_the_candidates_they_were_computed_for():
    state, pool = CycleState(), [endpoint(0, waiting=3), endpoint(1, in_flight=2)]
    depths = queue_depths(state, pool)
    assert depths == [3, 2]
    assert queue_depths(state, pool) is depths  # the prefix scorer's load guard reuses the queue scorer's
    assert queue_depths(state, pool[:1]) == [3]  # other candidates: computed again


@pytest.mark.parametrize(
    ("plugin", "endpoints", "expected"),
    [
        ("queue-scorer", [endpoint(0, waiting=0), endpoint(1, waiting=5), endpoint(2, waiting=10)], [1.0, 0.5, 0.0]),
        ("queue-scorer", [endpoint(0, waiting=3), endpoint(1, waiting=3)], [1.0, 1.0]),
        ("queue-scorer", [endpoint(0, waiting=7)], [1.0]),
        ("queue-scorer", [endpoint(0, waiting=0, in_flight=4), endpoint(1, waiting=2)], [0.0, 1.0]),
        ("kv-cache-utilization-scorer", [endpoint(0, kv=0.25), endpoint(1, kv=1.0), never_scraped(2)], [0.75, 0, 1]),
        ("running-requests-size-scorer", [endpoint(0, running=2), endpoint(1, running=6)], [1.0, 0.0]),
        ("running-requests-size-scorer", [endpoint(0, running=2), endpoint(1, running=0, in_flight=4)], [1.0, 0.0]),
        # one long prompt in flight outweighs two short ones (request counts would say the opposite)
        (
            "in-flight-tokens-scorer",
            [
                endpoint(0, in_flight=2, in_flight_tokens=400),
                endpoint(1, in_flight=1, in_flight_tokens=6000),
                endpoint(2),
            ],
            [1 - 400 / 6000, 0.0, 1.0],
        ),
    ],
)
def test_load_scorers(plugin, endpoints, expected):
    scores = build_plugin(plugin).score(CycleState(), req(), endpoints)
    assert scores == pytest.approx(expected)
    assert all(0.0 <= s <= 1.0 for s in scores)


@pytest.mark.parametrize(
    ("model", "endpoints", "expected"),
    [
        (
            "sql",
            [
                endpoint(0, running_adapters={"sql"}, max_lora=2),
                endpoint(1, running_adapters={"x"}, max_lora=2),  # one slot free
                endpoint(2, waiting_adapters={"sql"}, running_adapters={"x"}, max_lora=2),  # waiting, no slot
                endpoint(3, running_adapters={"x", "y"}, max_lora=2),  # full
                endpoint(4, running_adapters={"x"}),  # no max_lora published: no known room
            ],
            [1.0, 0.8, 0.6, 0.0, 0.0],
        ),
        # a free slot ranks above waiting (GIE's order): loading beats queueing behind a pending load
        (
            "sql",
            [endpoint(0, waiting_adapters={"sql"}, max_lora=4), endpoint(1, waiting_adapters={"sql"}, max_lora=1)],
            [0.8, 0.6],
        ),
        # room counts running + waiting entries: {"x"} running and {"x"} waiting fill two slots
        (
            "sql",
            [
                endpoint(0, running_adapters={"sql"}),
                endpoint(1, running_adapters={"x"}, waiting_adapters={"x"}, max_lora=2),
            ],
            [1.0, 0.0],
        ),
        ("sql", [endpoint(0, running_adapters={"sql"}), never_scraped(1)], [1.0, 0.0]),
        # a model no candidate lists (the base model, or an adapter not loaded anywhere yet): the scorer abstains
        ("base", [endpoint(0, running_adapters={"x"}, max_lora=1), endpoint(1, max_lora=1)], None),
        ("base", [endpoint(0)], None),
    ],
)
def test_lora_affinity(model, endpoints, expected):
    assert build_plugin("lora-affinity-scorer").score(CycleState(), req(model), endpoints) == expected


def test_lora_affinity_remembers_adapters_used_lately_while_they_idle_in_their_slots():
    scorer = build_plugin("lora-affinity-scorer")
    busy = [endpoint(0, running_adapters={"sql"}, max_lora=2), endpoint(1, max_lora=2), endpoint(2, max_lora=2)]
    assert scorer.score(CycleState(), req("sql"), busy) == [1.0, 0.8, 0.8]  # learns that "sql" is an adapter
    scorer.pre_request(req("sql"), SchedulingResult([busy[1]]))
    # the send is remembered on the endpoint, where the latency predictor reads it too
    assert busy[1].adapter_loaded("sql") and not busy[2].adapter_loaded("sql")
    # the scrape no longer lists "sql" anywhere (its requests finished), but endpoint 1 still holds it in a slot
    for e in busy:
        e.metrics = endpoint(0, max_lora=2).metrics
    assert scorer.score(CycleState(), req("sql"), busy) == [0.8, 0.9, 0.8]
    # two other adapters sent there since: with two slots, "sql" was evicted (LRU)
    for name in ("x", "y"):
        scorer.score(CycleState(), req(name), [endpoint(0, running_adapters={name}, max_lora=2)])
        scorer.pre_request(req(name), SchedulingResult([busy[1]]))
    assert scorer.score(CycleState(), req("sql"), busy) == [0.8, 0.8, 0.8]
    assert list(busy[1].recent_adapters) == ["x", "y"]
    # the base model is never recorded
    scorer.pre_request(req("base"), SchedulingResult([busy[2]]))
    assert not busy[2].recent_adapters and scorer.score(CycleState(), req("base"), busy) is None
    # what the endpoint's own scrapes saw running lately counts the same (sent by another EPP, or before this one)
    busy[2].adapters_used(frozenset({"sql"}), 2)
    assert scorer.score(CycleState(), req("sql"), busy) == [0.8, 0.8, 0.9]
    # a pool that loads adapters at runtime for good: the names remembered stay bounded, a listed one still scores
    scorer.adapters.update(f"old-{i}" for i in range(MAX_KNOWN_ADAPTERS))
    fresh = [endpoint(0, running_adapters={"new"}, max_lora=2), endpoint(1, max_lora=2)]
    remembered = len(scorer.adapters)
    assert scorer.score(CycleState(), req("new"), fresh) == [1.0, 0.8]
    assert len(scorer.adapters) == remembered and "new" not in scorer.adapters


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (None, ["e0", "e1", "e2"]),
        ("127.0.0.1:8002", ["e2"]),
        ("127.0.0.1:8002, 127.0.0.1:8000", ["e2", "e0"]),  # the order given
        ("10.0.0.1:80", []),  # not in the pool
        ("127.0.0.1", ["e0", "e1", "e2"]),  # a bare pod IP: every rank (port) of that pod
        ("10.0.0.2", ["r0", "r1"]),
        ("10.0.0.2:8001,10.0.0.2", ["r1", "r0"]),  # each once, in the order first named
        ("[fd00::1]:8000, fd00::1", ["v6"]),
    ],
)
def test_header_based_testing_filter(header, expected):
    headers = {} if header is None else {"test-epp-endpoint-selection": header}
    ranks = [Endpoint(EndpointSpec(f"r{i}", "10.0.0.2", 8000 + i), EndpointMetrics()) for i in range(2)]
    v6 = Endpoint(EndpointSpec("v6", "fd00::1", 8000), EndpointMetrics())
    kept = build_plugin("header-based-testing-filter").filter(
        CycleState(), req(headers=headers), [endpoint(i) for i in range(3)] + ([] if header is None else [*ranks, v6])
    )
    assert [e.name for e in kept] == expected


def picks(picker, scores, n=2000):
    endpoints = [endpoint(i) for i in range(len(scores))]
    return Counter(picker.pick(CycleState(), req(), endpoints, scores)[0].name for _ in range(n))


def test_max_score_picker_takes_the_best_and_breaks_ties_at_random():
    picker = build_plugin("max-score-picker")
    assert picks(picker, [0.2, 3.5, 1.0], n=50) == {"e1": 50}
    tied = picks(picker, [2.0, 5.0, 5.0, 5.0, 1.0], n=3000)
    assert set(tied) == {"e1", "e2", "e3"}
    assert all(800 < tied[name] < 1200 for name in tied), tied  # ~1000 each


def test_max_score_picker_returns_fallbacks_best_first():
    picker = build_plugin("max-score-picker", {"maxNumOfEndpoints": 3})
    endpoints = [endpoint(i) for i in range(4)]
    assert [e.name for e in picker.pick(CycleState(), req(), endpoints, [0.1, 0.9, 0.5, 0.7])] == ["e1", "e3", "e2"]
    firsts = Counter(picker.pick(CycleState(), req(), endpoints, [1.0, 1.0, 0.0, 0.0])[0].name for _ in range(400))
    assert set(firsts) == {"e0", "e1"}
    assert len(picker.pick(CycleState(), req(), endpoints[:2], [1.0, 1.0])) == 2  # never more than there are


def test_random_picker_ignores_scores():
    counts = picks(build_plugin("random-picker"), [100.0, 0.0, 0.0, 0.0], n=2000)
    assert set(counts) == {"e0", "e1", "e2", "e3"}
    assert all(350 < c < 650 for c in counts.values()), counts
    two = build_plugin("random-picker", {"maxNumOfEndpoints": 2}).pick(
        CycleState(), req(), [endpoint(0), endpoint(1)], [0, 0]
    )
    assert {e.name for e in two} == {"e0", "e1"}


def test_weighted_random_picker_follows_scores():
    counts = picks(build_plugin("weighted-random-picker"), [3.0, 1.0, 0.0], n=4000)
    assert "e2" not in counts  # weight 0 is never drawn while another weight is positive
    assert 2700 < counts["e0"] < 3300, counts  # ~3000
    everyone = picks(build_plugin("weighted-random-picker"), [0.0, 0.0], n=400)
    assert set(everyone) == {"e0", "e1"}  # all zero: uniform
    picker = build_plugin("weighted-random-picker", {"maxNumOfEndpoints": 3})
    chosen = picker.pick(CycleState(), req(), [endpoint(i) for i in range(3)], [1.0, 0.0, 1.0])
    assert sorted(e.name for e in chosen) == ["e0", "e1", "e2"]  # without replacement


def test_every_plugin_type_is_kebab_case_and_documented():
    build_plugin("queue-scorer")  # imports the built-ins
    assert len(PLUGIN_TYPES) >= 9
    for type_name, cls in PLUGIN_TYPES.items():
        assert type_name == type_name.lower() and " " not in type_name and "_" not in type_name
        doc = __import__(cls.__module__, fromlist=["_"]).__doc__
        assert doc and doc.startswith(f"{type_name}:"), type_name
        assert "Parameters" in doc or "parameters" in doc, type_name


@pytest.mark.parametrize(
    ("plugin", "parameters", "message"),
    [
        ("queue-scorer", {"x": 1}, "unknown parameter"),
        ("max-score-picker", {"maxNumOfEndpoints": 0}, ">= 1"),
        ("max-score-picker", {"maxNumOfEndpoints": "2"}, "must be int"),
        ("max-score-picker", {"maxNumOfEndpoints": True}, "must be int"),
        ("prefix-cache-scorer", {"blockSize": 0}, ">= 1"),
        ("prefix-cache-scorer", {"autoTune": "yes"}, "must be bool"),
        ("prefix-cache-scorer", {"loadGuardQueueGap": -1}, ">= 0"),
        ("header-based-testing-filter", {"headerName": 3}, "must be str"),
        ("kv-cache-utilization-scorer", [1, 2], "must be a mapping"),
        ("no-such-scorer", {}, "unknown plugin type 'no-such-scorer'; known: "),
    ],
)
def test_bad_parameters_are_config_errors(plugin, parameters, message):
    with pytest.raises(ConfigError, match=message):
        build_plugin(plugin, parameters)
