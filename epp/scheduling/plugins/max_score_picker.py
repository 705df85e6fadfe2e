"""max-score-picker: the highest total score wins; ties are broken at random so that equal endpoints share load.

Reads: the weighted total score of each candidate.
Parameters: maxNumOfEndpoints (default 1): how many endpoints to return, best first; the rest are fallbacks the
proxy may try when the first fails (ties among them are ordered at random too).
Trade-offs: deterministic apart from ties, so between two scrapes every request sees the same scores; the scorers'
in-flight correction (requests routed since the last scrape count as queued) is what keeps a burst from herding
onto the single best endpoint.
"""

from __future__ import annotations

import random

from epp.datalayer.endpoint import Endpoint
from epp.scheduling.framework import Parameters, Picker, register
from epp.scheduling.types import CycleState, SchedulingRequest


@register("max-score-picker")
class MaxScorePicker(Picker):
    def __init__(self, parameters: dict | None):
        p = Parameters("max-score-picker", parameters)
        self.count = p.get("maxNumOfEndpoints", 1, int, minimum=1)
        p.done()

    def pick(
        self, cycle_state: CycleState, request: SchedulingRequest, endpoints: list[Endpoint], scores: list[float]
    ) -> list[Endpoint]:
        if self.count == 1:
            best = max(scores)
            if scores.count(best) == 1:  # the common case, without a loop in Python
                return [endpoints[scores.index(best)]]
            return [random.choice([e for e, s in zip(endpoints, scores, strict=True) if s == best])]
        tie_breaks = [random.random() for _ in endpoints]
        keyed = sorted(zip(scores, tie_breaks, range(len(endpoints)), strict=True), reverse=True)
        return [endpoints[i] for _, _, i in keyed[: self.count]]
