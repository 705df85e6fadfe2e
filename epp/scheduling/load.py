"""Load estimates shared by scorers, the load guard and the saturation detector.

Scrapes arrive every 50 ms; a burst routed in between is invisible to them. The EPP's own in-flight count covers
the gap: requests it routed that the endpoint does not yet report as running are counted as queued.
"""

from __future__ import annotations

from epp.datalayer.endpoint import Endpoint
from epp.scheduling.types import CycleState, StateKey

# The endpoint attributes the estimates below read, for the `consumes` of the plugins that use them.
QUEUE_DEPTH_READS = ("waiting", "running", "in_flight_requests")
RUNNING_REQUESTS_READS = ("running", "waiting", "in_flight_requests")
# The candidates' queue depths, computed by the first plugin of a cycle that needs them (the queue scorer and the
# prefix scorer's load guard both do), with the list they were computed for.
QUEUE_DEPTHS: StateKey[tuple[list[Endpoint], list[int]]] = StateKey("queue-depths")


def queue_depth(endpoint: Endpoint) -> int:
    m = endpoint.metrics
    if m is None:
        return endpoint.in_flight_requests
    return max(m.waiting, endpoint.in_flight_requests - m.running)


def queue_depths(cycle_state: CycleState, endpoints: list[Endpoint]) -> list[int]:
    """`queue_depth` of each endpoint, once per cycle; one loop without a call per endpoint (it runs on every
    request)."""
    known = cycle_state.read(QUEUE_DEPTHS)
    if known is not None and known[0] is endpoints:
        return known[1]
    depths = []
    append = depths.append
    for e in endpoints:
        m = e.metrics
        if m is None:
            append(e.in_flight_requests)
        else:
            unseen = e.in_flight_requests - m.running
            append(unseen if unseen > m.waiting else m.waiting)
    cycle_state.write(QUEUE_DEPTHS, (endpoints, depths))
    return depths


def running_requests(endpoint: Endpoint) -> int:
    m = endpoint.metrics
    return endpoint.in_flight_requests if m is None else max(m.running, endpoint.in_flight_requests - m.waiting)


def inverted_min_max(values: list[float]) -> list[float]:
    """1 for the smallest value, 0 for the largest, linear between; all 1 when they are equal."""
    low, high = min(values), max(values)
    if high == low:
        return [1.0] * len(values)
    span = high - low
    return [(high - v) / span for v in values]


def guard_load(scores: list[float], cycle_state: CycleState, endpoints: list[Endpoint], gap: float) -> list[float]:
    """The prefix scorers' load guard: an endpoint's prefix score scaled by max(0, 1 - excess / gap), where excess
    is how many requests its queue holds beyond the shallowest candidate's (gap 0: off). At `gap` requests more
    than the least loaded candidate a cached prefix counts for nothing and the load scorers alone decide."""
    if not gap:
        return scores
    queues = queue_depths(cycle_state, endpoints)
    shallowest = min(queues)
    # s * max(0, 1 - excess / gap), without a call per candidate
    return [
        s * (1.0 - (q - shallowest) / gap) if s and q - shallowest < gap else 0.0
        for s, q in zip(scores, queues, strict=True)
    ]
