"""weighted-random-picker: random, with probability proportional to score (all equal when every score is 0).

Parameters: maxNumOfEndpoints (default 1), drawn without replacement; the scheduler adds fallbacks up to
`RESULT_ENDPOINTS` by total score.
Trade-offs: spreads load more than max-score (no herding on the single best) at the cost of sometimes choosing a
worse endpoint; useful when several EPP replicas decide on the same stale scrape.
"""

from __future__ import annotations

import random

from epp.datalayer.endpoint import Endpoint
from epp.scheduling.framework import Parameters, Picker, Stability, register
from epp.scheduling.types import CycleState, SchedulingRequest


@register("weighted-random-picker", Stability.BETA)
class WeightedRandomPicker(Picker):
    def __init__(self, parameters: dict | None):
        p = Parameters("weighted-random-picker", parameters)
        self.count = p.get("maxNumOfEndpoints", 1, int, minimum=1)
        p.done()

    def pick(
        self, cycle_state: CycleState, request: SchedulingRequest, endpoints: list[Endpoint], scores: list[float]
    ) -> list[Endpoint]:
        candidates, weights, chosen = list(endpoints), [max(0.0, s) for s in scores], []
        while candidates and len(chosen) < self.count:
            if sum(weights) <= 0:
                weights = [1.0] * len(candidates)
            i = random.choices(range(len(candidates)), weights)[0]
            chosen.append(candidates.pop(i))
            weights.pop(i)
        return chosen
