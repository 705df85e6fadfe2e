"""Load estimates shared by scorers, the load guard and the saturation detector.

Scrapes arrive every 50 ms; a burst routed in between is invisible to them. The EPP's own in-flight count covers
the gap: requests it routed that the endpoint does not yet report as running are counted as queued. The other way
round, a request the scrape saw waiting may have finished since; the EPP knows when more of its requests finished
than it routed since the scrape (`Endpoint.in_flight_at_scrape`), and each of those took a waiting request's place
(or was the waiting request). Without that, a client's previous request, caught waiting in the last scrape, made
its server look queued for the next one until the next scrape (a LoRA request then left its adapter's server).
"""

from __future__ import annotations

from epp.datalayer.endpoint import Endpoint
from epp.scheduling.types import CycleState, StateKey

# The endpoint attributes the estimates below read, for the `consumes` of the plugins that use them.
QUEUE_DEPTH_READS = ("waiting", "running", "in_flight_requests", "in_flight_at_scrape")
RUNNING_REQUESTS_READS = ("running", "waiting", "in_flight_requests")
# The candidates' queue depths, computed by the first plugin of a cycle that needs them (the queue scorer and the
# prefix scorer's load guard both do), with the list they were computed for.
QUEUE_DEPTHS: StateKey[tuple[list[Endpoint], list[int]]] = StateKey("queue-depths")


def queue_depth(endpoint: Endpoint) -> int:
    m = endpoint.metrics
    in_flight = endpoint.in_flight_requests
    if m is None:
        return in_flight
    finished = endpoint.in_flight_at_scrape - in_flight  # at least this many finished since the scrape
    return max(m.waiting - finished if finished > 0 else m.waiting, in_flight - m.running, 0)


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
            in_flight = e.in_flight_requests
            finished = e.in_flight_at_scrape - in_flight
            waiting = m.waiting - finished if finished > 0 else m.waiting
            unseen = in_flight - m.running
            depth = unseen if unseen > waiting else waiting
            append(depth if depth > 0 else 0)
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
