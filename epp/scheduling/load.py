"""Load estimates shared by scorers, the load guard and the saturation detector.

Scrapes arrive every 50 ms; a burst routed in between is invisible to them. The EPP's own in-flight count covers
the gap: requests it routed that the endpoint does not yet report as running are counted as queued.
"""

from __future__ import annotations

from epp.datalayer.endpoint import Endpoint


def queue_depth(endpoint: Endpoint) -> int:
    m = endpoint.metrics
    if m is None:
        return endpoint.in_flight_requests
    return max(m.waiting, endpoint.in_flight_requests - m.running)


def queue_depths(endpoints: list[Endpoint]) -> list[int]:
    """`queue_depth` of each endpoint; one loop without a call per endpoint (it runs on every request)."""
    depths = []
    append = depths.append
    for e in endpoints:
        m = e.metrics
        if m is None:
            append(e.in_flight_requests)
        else:
            unseen = e.in_flight_requests - m.running
            append(unseen if unseen > m.waiting else m.waiting)
    return depths


def running_requests(endpoint: Endpoint) -> int:
    m = endpoint.metrics
    return endpoint.in_flight_requests if m is None else max(m.running, endpoint.in_flight_requests - m.waiting)


def kv_usage(endpoint: Endpoint) -> float:
    m = endpoint.metrics
    return 0.0 if m is None else m.kv_usage


def inverted_min_max(values: list[float]) -> list[float]:
    """1 for the smallest value, 0 for the largest, linear between; all 1 when they are equal."""
    low, high = min(values), max(values)
    if high == low:
        return [1.0] * len(values)
    span = high - low
    return [(high - v) / span for v in values]
