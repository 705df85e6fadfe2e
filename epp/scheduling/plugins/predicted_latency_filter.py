"""predicted-latency-filter: drop the endpoints that are predicted slower than the fastest by more than the
predictor's own error, and let the profile's scorers choose among the rest.

Reads: the pool's latency predictor (`epp.predictor.shared(pool)`), as predicted-latency-scorer does: predicted TTFT
of the request on each candidate (for a long answer, `max_tokens` at least `longOutputTokens`, TTFT + TPOT x
max_tokens) and the predictor's recent ratios observed / predicted (`_Target.ratio_quantile`).
Keeps candidate e when prediction(e) x low <= prediction(best) x high, where low and high are the (1 - confidence)
and confidence quantiles of the recent ratios: e's latency could then still be the lowest, given how wrong recent
predictions were. What the prediction cannot tell apart is left to the scorers, which read exact signals (a prefix
match, an adapter loaded, a queue); what it can (a candidate behind a 6,000-token prefill when others are idle)
never reaches them. So it composes with them by a rule and with no weight: as the predictor's error shrinks, the
band narrows and the prediction decides more; while it is cold (or its windowed error above its bound) every
candidate passes. Feeds the predictor as predicted-latency-scorer does (`PredictorFeed`), so a profile needs only one
of the two.
Parameters: pool ("default"), confidence (0.9, in (0.5, 1)), longOutputTokens (256).
Trade-offs: one band for the whole pool and every request size; the scorers after it still weigh what the
prediction already counted (their signals are its inputs) among the candidates it kept, which is where they are
more exact than it is.
"""

from __future__ import annotations

from epp.datalayer.endpoint import Endpoint
from epp.predictor import shared
from epp.predictor.candidates import PREDICTED_LATENCY, PREDICTION_READS
from epp.scheduling.errors import ConfigError
from epp.scheduling.framework import Filter, Parameters, register
from epp.scheduling.plugins.predicted_latency_scorer import OBSERVED, ROUTED_FEATURES, PredictorFeed
from epp.scheduling.types import CycleState, SchedulingRequest


@register("predicted-latency-filter")
class PredictedLatencyFilter(Filter, PredictorFeed):
    consumes = PREDICTION_READS
    produces = (PREDICTED_LATENCY, ROUTED_FEATURES, OBSERVED)

    def __init__(self, parameters: dict | None):
        p = Parameters("predicted-latency-filter", parameters)
        self.predictions = shared(p.get("pool", "default", str))
        self.confidence = float(p.get("confidence", 0.9, (int, float)))
        self.long_output_tokens = p.get("longOutputTokens", 256, int, minimum=1)
        p.done()
        self.unseen_bodies = 0  # successful responses without a body through the EPP, while nothing was learnt
        if not 0.5 < self.confidence < 1:
            raise ConfigError(
                f"predicted-latency-filter: parameter confidence must be in (0.5, 1), got {self.confidence!r}"
            )

    def filter(self, cycle_state: CycleState, request: SchedulingRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        if len(endpoints) < 2:
            return endpoints
        predicted = self.predicted_costs(cycle_state, request, endpoints)
        if predicted is None:
            return endpoints
        costs, with_tpot = predicted
        predictor, confidence = self.predictions.predictor, self.confidence
        target = predictor.tpot if with_tpot else predictor.ttft  # TPOT: the larger part of a long answer's time
        limit = min(costs) * target.ratio_quantile(confidence) / target.ratio_quantile(1.0 - confidence)
        return [e for e, c in zip(endpoints, costs, strict=True) if c <= limit]
