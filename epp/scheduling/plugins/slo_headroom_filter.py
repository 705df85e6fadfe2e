"""slo-headroom-filter: a request that states latency objectives goes to an endpoint predicted to meet them.

Reads: the request headers `x-llm-d-slo-ttft-ms` and `x-llm-d-slo-tpot-ms` (llm-d's names, the older `x-slo-ttft-ms` /
`x-slo-tpot-ms` as aliases: epp.requestcontrol.director copies them; milliseconds, either or both)
and the scheduler's latency predictor (`LatencyPredictionReader`), as predicted-latency-scorer does.
Keeps the candidates predicted to meet the objectives with the headroom the predictor's own recent error calls
for: a candidate qualifies when prediction x margin is within the objective, where the margin is the `confidence`
quantile of observed / predicted over the predictor's recent window for requests of this one's size
(`_Target.ratio_quantile`). So a request sent
to a qualifying endpoint meets its objective with probability about `confidence` if the recent errors hold: the
headroom grows when the predictions get worse and shrinks when they improve, with no number to tune per pool.
When none qualifies it keeps the single candidate closest to its objectives (the smallest predicted/objective
ratio), so the request is still served as well as the pool can; shedding it instead belongs to flow control.
Passes every candidate through when the request states no objective, when a header is not a positive number (an
objective the client got wrong is no reason to fail its request), and while the predictor is cold; a TPOT objective
is ignored while TPOT is cold.
Parameters: confidence (0.9, in (0, 1)): the share of qualifying requests that should meet their
objectives (a statement of the service level wanted, not a fitted weight).
Trade-offs: a high confidence sends SLO traffic to the emptiest endpoints only; filtering acts before scoring, so
among the endpoints that qualify the scorers (latency, prefix, load) still choose, which keeps cache affinity for
requests with loose objectives. The margin is one per pool, target and request size class.
"""

from __future__ import annotations

import math

from epp.config import ConfigError
from epp.datalayer.endpoint import Endpoint
from epp.scheduling.framework import Filter, LatencyPredictionReader, Parameters, Stability, register
from epp.scheduling.predictions import CACHED_TOKENS, PREDICTED_LATENCY, PREDICTION_READS
from epp.scheduling.types import CycleState, SchedulingRequest
from protocol.extproc import SLO_TPOT_HEADER, SLO_TTFT_HEADER

TTFT_HEADER = SLO_TTFT_HEADER
TPOT_HEADER = SLO_TPOT_HEADER


def objective_seconds(headers: dict[str, str], name: str) -> float | None:
    """Seconds, or None when absent or not a positive finite number."""
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        return None
    return value / 1e3 if math.isfinite(value) and value > 0 else None


@register("slo-headroom-filter", Stability.BETA)
class SLOHeadroomFilter(Filter, LatencyPredictionReader):
    consumes = PREDICTION_READS
    produces = (PREDICTED_LATENCY, CACHED_TOKENS)

    def __init__(self, parameters: dict | None):
        p = Parameters("slo-headroom-filter", parameters)
        self.own_predictor()
        self.confidence = float(p.get("confidence", 0.9, (int, float)))
        p.done()
        if not 0 < self.confidence < 1:
            raise ConfigError(f"slo-headroom-filter: parameter confidence must be in (0, 1), got {self.confidence!r}")

    def filter(self, cycle_state: CycleState, request: SchedulingRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        headers = request.headers
        if TTFT_HEADER not in headers and TPOT_HEADER not in headers:
            return endpoints
        ttft_slo, tpot_slo = objective_seconds(headers, TTFT_HEADER), objective_seconds(headers, TPOT_HEADER)
        if ttft_slo is None and tpot_slo is None:
            return endpoints
        predicted = self.predictions.get(cycle_state, request, endpoints, tpot=tpot_slo is not None)
        if predicted is None:
            return endpoints
        # The worst ratio of prediction x margin to objective per candidate: <= 1 means it meets both.
        predictor, confidence = self.predictions.predictor, self.confidence
        size = request.prompt_tokens_estimate
        ttft_scale = predictor.ttft.ratio_quantile(confidence, size) / ttft_slo if ttft_slo is not None else 0.0
        tpot_scale = predictor.tpot.ratio_quantile(confidence, size) / tpot_slo if tpot_slo is not None else 0.0
        ratios = []
        for ttft, tpot in predicted:
            ratio = ttft * ttft_scale
            if tpot is not None and tpot * tpot_scale > ratio:
                ratio = tpot * tpot_scale
            ratios.append(ratio)
        kept = [e for e, r in zip(endpoints, ratios, strict=True) if r <= 1.0]
        return kept or [endpoints[ratios.index(min(ratios))]]
