"""max-score-picker: the highest total score wins; ties are broken at random so equal endpoints share load.

Parameters: maxNumOfEndpoints (default 1): how many endpoints to return, best first; the rest are fallbacks the
proxy tries when the first fails.
Trade-offs: deterministic apart from ties; with stale scores between scrapes it can herd a burst onto one endpoint,
which the scorers' in-flight correction counters.
"""

from __future__ import annotations

import random

from epp.datalayer.endpoint import Endpoint
from epp.scheduling.framework import Parameters, register
from epp.scheduling.types import SchedulingRequest


@register("max-score-picker")
class MaxScorePicker:
    def __init__(self, parameters: dict):
        p = Parameters("max-score-picker", parameters)
        self.count = p.get("maxNumOfEndpoints", 1, int, minimum=1)
        p.done()
        self._random = random.random

    def pick(self, request: SchedulingRequest, endpoints: list[Endpoint], scores: list[float]) -> list[Endpoint]:
        if self.count == 1:
            best, best_key = None, None
            rand = self._random
            for endpoint, score in zip(endpoints, scores, strict=True):
                key = (score, rand())
                if best_key is None or key > best_key:
                    best, best_key = endpoint, key
            return [best] if best is not None else []
        order = sorted(range(len(endpoints)), key=lambda i: (scores[i], self._random()), reverse=True)
        return [endpoints[i] for i in order[: self.count]]
