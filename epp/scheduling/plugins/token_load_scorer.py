"""token-load-scorer: prefer endpoints with fewer prompt tokens in flight, counting the request's own uncached
ones (llm-d router's scorer of the same type and parameter).

Reads: each candidate's in-flight prompt tokens not yet answered (`in_flight_tokens`, the EPP's own count, exact
within a burst) plus this request's tokens that candidate does not hold (its estimated prompt tokens x the share of
its blocks the profile's prefix index does not place there: `PrefixMatchReader`).
Score: 1 - min(1, tokens / queueThresholdTokens): absolute, not relative to the other candidates, so equally idle
endpoints tie (the picker's random choice spreads them).
Parameters: queueThresholdTokens (4194304, llm-d's default: 128 requests of 32K tokens; 0 or less means the default).
Trade-offs: sees prefill work, which request counts miss, and credits a warm cache; blind to decode work (the
tokens leave the count at the endpoint's answer) and to other routers' traffic; with a threshold far above the
pool's load the scores differ little, which only matters when it is summed with other scorers.
"""

from __future__ import annotations

from epp.datalayer.endpoint import Endpoint
from epp.scheduling.framework import Parameters, PrefixMatchReader, Scorer, Stability, register
from epp.scheduling.types import CycleState, SchedulingRequest

DEFAULT_THRESHOLD = 4194304


@register("token-load-scorer", Stability.BETA)
class TokenLoadScorer(Scorer, PrefixMatchReader):
    consumes = ("in_flight_tokens",)

    def __init__(self, parameters: dict | None):
        p = Parameters("token-load-scorer", parameters)
        threshold = p.get("queueThresholdTokens", DEFAULT_THRESHOLD, int)
        p.done()
        self.threshold = float(threshold if threshold > 0 else DEFAULT_THRESHOLD)

    def score(self, cycle_state: CycleState, request: SchedulingRequest, endpoints: list[Endpoint]) -> list[float]:
        prompt = request.prompt_tokens_estimate
        fractions = self.prefix_index.match_fractions(cycle_state, request, endpoints)
        threshold = self.threshold
        return [
            1.0 - min(1.0, (e.in_flight_tokens + prompt * (1.0 - f)) / threshold)
            for e, f in zip(endpoints, fractions, strict=True)
        ]
