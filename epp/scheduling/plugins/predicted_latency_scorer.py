"""predicted-latency-scorer: prefer the endpoint predicted to answer this request soonest (GIE/llm-d's name).

Reads: the pool's latency predictor (`epp.predictor.shared(pool)`): predicted TTFT of this request on each
candidate from its scraped load, this EPP's in-flight tokens and prefill backlog there, the request's prompt
tokens and the part the prefix scorer expects cached there (once the director wires `cached_tokens`; until then
none), and whether its LoRA adapter is loaded; `max_tokens` of the request. For a long answer (`max_tokens` at
least `longOutputTokens`) the cost is the predicted end-to-end time, TTFT + TPOT x max_tokens, so that a decode
batch that would slow every token counts too.
Score: best cost / cost (1 for the fastest, 0.5 for one predicted twice as slow), so close predictions stay close
instead of being stretched to 0..1 as min-max would.
Abstains (None) while the predictor is cold (too few observations or its windowed error above its bound): the
other scorers then decide alone.
Parameters: pool ("default": which shared predictor), longOutputTokens (256).
Trade-offs: the prediction already accounts for a cache hit and an adapter load, so composing it with the prefix
and LoRA scorers counts those twice (weigh them lower next to it); it is only as good as the predictor's recent
error (`LatencyPredictor.ttft_mape`, for the EPP's metrics); one model per pool assumes alike endpoints.
"""

from __future__ import annotations

from epp.datalayer.endpoint import Endpoint
from epp.predictor import shared
from epp.predictor.candidates import PREDICTED_LATENCY, PREDICTION_READS
from epp.scheduling.framework import Parameters, Scorer, register
from epp.scheduling.types import CycleState, SchedulingRequest


@register("predicted-latency-scorer")
class PredictedLatencyScorer(Scorer):
    consumes = PREDICTION_READS
    produces = (PREDICTED_LATENCY,)

    def __init__(self, parameters: dict | None):
        p = Parameters("predicted-latency-scorer", parameters)
        self.predictions = shared(p.get("pool", "default", str))
        self.long_output_tokens = p.get("longOutputTokens", 256, int, minimum=1)
        p.done()

    def score(
        self, cycle_state: CycleState, request: SchedulingRequest, endpoints: list[Endpoint]
    ) -> list[float] | None:
        predicted = self.predictions.get(cycle_state, request, endpoints)
        if predicted is None:
            return None
        output = request.max_tokens
        if output is not None and output >= self.long_output_tokens and predicted[0][1] is not None:
            costs = [ttft + tpot * output for ttft, tpot in predicted]
        else:
            costs = [ttft for ttft, _ in predicted]
        best = min(costs)
        return [best / c for c in costs]
