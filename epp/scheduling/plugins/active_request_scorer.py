"""active-request-scorer: prefer endpoints with fewer requests in flight from this EPP (llm-d router's scorer of
the same type and parameters).

Reads: the requests this EPP routed to each candidate that have not finished (`in_flight_requests`; no scrape, so
exact within a burst).
Score: 1 for an idle candidate (at most `idleThreshold` requests); a busy one gets (most - its count) / most x
`maxBusyScore`, where `most` is the busiest candidate's count (the busiest scores 0).
Parameters: idleThreshold (0, >= 0), maxBusyScore (1.0, in [0, 1]: below 1 it opens a gap between idle and busy
endpoints), requestTimeout (llm-d deprecated and ignores it: accepted, ignored here too).
Trade-offs: counts requests, not their size: a long prompt weighs as much as a short one (token-load-scorer sees
the difference); other routers' requests and the servers' own queues are invisible to it.
"""

from __future__ import annotations

from epp.datalayer.endpoint import Endpoint
from epp.scheduling.framework import Parameters, Scorer, Stability, register
from epp.scheduling.types import CycleState, SchedulingRequest


@register("active-request-scorer", Stability.BETA)
class ActiveRequestScorer(Scorer):
    consumes = ("in_flight_requests",)

    def __init__(self, parameters: dict | None):
        p = Parameters("active-request-scorer", parameters)
        self.idle = p.get("idleThreshold", 0, int, minimum=0)
        self.max_busy = float(p.get("maxBusyScore", 1.0, (int, float), minimum=0.0, maximum=1.0))
        p.get("requestTimeout", "", str)  # deprecated by llm-d, which ignores it
        p.done()

    def score(self, cycle_state: CycleState, request: SchedulingRequest, endpoints: list[Endpoint]) -> list[float]:
        counts = [e.in_flight_requests for e in endpoints]
        most, idle, max_busy = max(counts), self.idle, self.max_busy
        return [1.0 if c <= idle else (most - c) / most * max_busy for c in counts]
