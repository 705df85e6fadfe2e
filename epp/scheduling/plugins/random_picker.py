"""random-picker: a uniformly random endpoint, ignoring scores (a baseline, and what a plain Service gives).

Parameters: maxNumOfEndpoints (default 1; the scheduler adds fallbacks up to `RESULT_ENDPOINTS` by total score).
"""

from __future__ import annotations

import random

from epp.datalayer.endpoint import Endpoint
from epp.scheduling.framework import Parameters, Picker, Stability, register
from epp.scheduling.types import CycleState, SchedulingRequest


@register("random-picker", Stability.BETA)
class RandomPicker(Picker):
    def __init__(self, parameters: dict | None):
        p = Parameters("random-picker", parameters)
        self.count = p.get("maxNumOfEndpoints", 1, int, minimum=1)
        p.done()

    def pick(
        self, cycle_state: CycleState, request: SchedulingRequest, endpoints: list[Endpoint], scores: list[float]
    ) -> list[Endpoint]:
        return random.sample(endpoints, min(self.count, len(endpoints)))
