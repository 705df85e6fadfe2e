"""predicted-latency-filter: drop the endpoints that are predicted slower than the fastest by more than the
predictor's own error, and let the profile's scorers choose among the rest.

Reads: the scheduler's latency predictor (`LatencyPredictionReader`), as predicted-latency-scorer does: predicted TTFT
of the request on each candidate (and TPOT for a long answer, `max_tokens` at least `longOutputTokens`), and the
predictor's recent ratios observed / predicted (`_Target.ratio_quantile`) for requests of this one's size (prompt
tokens between the same powers of two; pool-wide until that class has a few).
Keeps candidate e when prediction(e) x low <= prediction(best) x high, where low and high are the (1 - confidence)
and confidence quantiles of the recent ratios: e's latency could then still be the lowest, given how wrong recent
predictions for such requests were. First on TTFT; then, for a long answer, on TPOT among the candidates TTFT kept.
Not on their sum TTFT + TPOT x max_tokens: the sum's band is TPOT's (the larger part, and the less exact), within
which a long prompt queued behind another long prefill (+0.6 s of TTFT, predicted within ~5 %) passed as readily as
an idle endpoint. On the heterogeneous workload (256-token answers), routed in process by this profile, the
6,000-token prompts' TTFT p90 was 956 ms against round robin's 783, from prompts sent to endpoints predicted 1.4 s
while others were predicted 0.75 s.
What the prediction cannot tell apart is left to the scorers, which read exact signals (a prefix match, an adapter
loaded, a queue); what it can (a candidate behind a 6,000-token prefill when others are idle) never reaches them.
So it composes with them by a rule and with no weight: as the predictor's error shrinks, the band narrows and the
prediction decides more; while it is cold (or its windowed error above its bound) every candidate passes. Feeds the
predictor as predicted-latency-scorer does (`PredictorFeed`), so a profile needs only one of the two.
Parameters: confidence (0.9, in (0.5, 1)), longOutputTokens (256).
Trade-offs: one band per request size for the whole pool; the scorers after it still weigh what the prediction
already counted (their signals are its inputs) among the candidates it kept, which is where they are more exact
than it is; the load scorers' request counts are not (a server prefilling a 6,000-token prompt shows no queue), so
the default profile (`epp.config.loader.DEFAULT_CONFIG`) has predicted-latency-scorer in their place.
"""

from __future__ import annotations

from epp.config import ConfigError
from epp.datalayer.endpoint import Endpoint
from epp.scheduling.framework import Filter, Parameters, Stability, register
from epp.scheduling.plugins.predicted_latency_scorer import FED, OBSERVED, ROUTED_FEATURES, PredictorFeed
from epp.scheduling.predictions import CACHED_TOKENS, PREDICTED_LATENCY, PREDICTION_READS
from epp.scheduling.types import CycleState, SchedulingRequest


@register("predicted-latency-filter", Stability.BETA)
class PredictedLatencyFilter(Filter, PredictorFeed):
    consumes = PREDICTION_READS
    produces = (PREDICTED_LATENCY, CACHED_TOKENS, ROUTED_FEATURES, FED, OBSERVED)

    def __init__(self, parameters: dict | None):
        p = Parameters("predicted-latency-filter", parameters)
        self.own_predictor()
        self.confidence = float(p.get("confidence", 0.9, (int, float)))
        self.long_output_tokens = p.get("longOutputTokens", 256, int, minimum=1)
        p.done()
        if not 0.5 < self.confidence < 1:
            raise ConfigError(
                f"predicted-latency-filter: parameter confidence must be in (0.5, 1), got {self.confidence!r}"
            )

    def filter(self, cycle_state: CycleState, request: SchedulingRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        if len(endpoints) < 2:
            return endpoints
        output = request.max_tokens
        long_output = output is not None and output >= self.long_output_tokens
        predicted = self.predictions.get(cycle_state, request, endpoints, tpot=long_output)
        if predicted is None:
            return endpoints
        predictor, size = self.predictions.predictor, request.prompt_tokens_estimate
        kept = self._within_band(range(len(endpoints)), [ttft for ttft, _ in predicted], predictor.ttft, size)
        if long_output and predicted[0][1] is not None and len(kept) > 1:
            kept = self._within_band(kept, [predicted[i][1] for i in kept], predictor.tpot, size)
        return [endpoints[i] for i in kept]

    def _within_band(self, candidates, predicted: list[float], target, size: int) -> list[int]:
        """The candidates (indices) whose prediction x low <= the best prediction x high (the size class's ratio
        quantiles)."""
        confidence = self.confidence
        limit = min(predicted) * target.ratio_quantile(confidence, size) / target.ratio_quantile(1 - confidence, size)
        return [i for i, p in zip(candidates, predicted, strict=True) if p <= limit]
