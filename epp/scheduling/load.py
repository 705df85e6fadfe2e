"""What the load-aware scheduling plugins share: the candidates' queue depths once per cycle, min-max scores and
the prefix scorers' load guard. The estimates themselves are the data layer's (`epp.datalayer.load`).
"""

from __future__ import annotations

from epp.datalayer import load
from epp.datalayer.endpoint import Endpoint
from epp.scheduling.types import CycleState, StateKey

# The candidates' queue depths, computed by the first plugin of a cycle that needs them (the queue scorer and the
# prefix scorer's load guard both do), with the list they were computed for.
QUEUE_DEPTHS: StateKey[tuple[list[Endpoint], list[int]]] = StateKey("queue-depths")


def queue_depths(cycle_state: CycleState, endpoints: list[Endpoint]) -> list[int]:
    """`epp.datalayer.load.queue_depths` of the endpoints, once per cycle."""
    known = cycle_state.read(QUEUE_DEPTHS)
    if known is not None and known[0] is endpoints:
        return known[1]
    depths = load.queue_depths(endpoints)
    cycle_state.write(QUEUE_DEPTHS, (endpoints, depths))
    return depths


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
