"""Histograms in Prometheus's text exposition, written one way by both sides: the EPP's own series
(`epp.metrics`) and the model server's (`modelserver.metrics`). A bucket's bound and a sample's value are written as
prometheus_client writes them (its `floatToGoString`: Go's format, `1e+06` rather than `1000000.0`), so a page reads
the same whether prometheus_client or our own precomputed lines wrote it.

A histogram here is a count per bucket (the last one above every bound, +Inf) and a sum, as both sides keep them on
their hot paths; Prometheus wants the counts cumulative."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client.utils import floatToGoString

# Go's format writes an integral float in plain digits below this (prometheus_client's floatToGoString switches to
# an exponent from seven digits before the point on).
_PLAIN_BELOW = 1_000_000


def bucket_bounds(bounds: Sequence[float]) -> tuple[str, ...]:
    """The `le` label of each bucket: each bound, then +Inf."""
    return (*(floatToGoString(b) for b in bounds), "+Inf")


def cumulative_buckets(les: Sequence[str], counts: Sequence[int]) -> list[tuple[str, int]]:
    """(le, cumulative count) of each bucket from a count per bucket (`les` from `bucket_bounds`), as
    prometheus_client's HistogramMetricFamily.add_metric takes them."""
    cumulative, buckets = 0, []
    for le, count in zip(les, counts, strict=True):
        cumulative += count
        buckets.append((le, cumulative))
    return buckets


def count_value(count: int) -> str:
    """A count (a bucket's, a histogram's `_count`) as a sample value, as prometheus_client writes it; written once
    per bucket line of a page, so the common case skips the general float formatting."""
    return f"{count}.0" if count < _PLAIN_BELOW else floatToGoString(count)


def sample_value(value: float) -> str:
    """Any sample value (a histogram's `_sum`) as prometheus_client writes it."""
    return floatToGoString(value)
