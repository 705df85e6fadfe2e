"""max-score-picker: the highest total score wins; ties are broken at random so that equal endpoints share load.

Reads: the weighted total score of each candidate.
Parameters: maxNumOfEndpoints (default 1): how many endpoints to return, best first; the rest are fallbacks the
proxy may try when the first fails (ties among them are ordered at random too). With fewer than the pick and the two
fallbacks our Envoy bootstrap retries on, the scheduler completes the list from the best-scored other candidates
(`epp.scheduling.scheduler.RESULT_ENDPOINTS`), the same way.
Trade-offs: deterministic apart from ties, so between two scrapes every request sees the same scores; the scorers'
in-flight correction (requests routed since the last scrape count as queued) is what keeps a burst from herding
onto the single best endpoint.
"""

from __future__ import annotations

import random

from epp.datalayer.endpoint import Endpoint
from epp.scheduling.framework import Parameters, Picker, Stability, register
from epp.scheduling.types import CycleState, SchedulingRequest, add_best_scored


@register("max-score-picker", Stability.BETA)
class MaxScorePicker(Picker):
    def __init__(self, parameters: dict | None):
        p = Parameters("max-score-picker", parameters)
        self.count = p.get("maxNumOfEndpoints", 1, int, minimum=1)
        p.done()

    def pick(
        self, cycle_state: CycleState, request: SchedulingRequest, endpoints: list[Endpoint], scores: list[float]
    ) -> list[Endpoint]:
        best = max(scores)
        if scores.count(best) == 1:  # the common case, without a loop in Python
            first = scores.index(best)
        else:
            ties = [i for i, s in enumerate(scores) if s == best]
            first = ties[int(random.random() * len(ties))]  # (random.choice runs as Python: twice the frames)
        picked = [endpoints[first]]
        if self.count > 1:  # the fallbacks, best first
            add_best_scored(picked, endpoints, scores, self.count)
        return picked
