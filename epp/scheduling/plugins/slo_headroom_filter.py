"""slo-headroom-filter: a request that states latency objectives goes to an endpoint predicted to meet them.

Reads: the request headers `x-slo-ttft-ms` and `x-slo-tpot-ms` (GIE/llm-d's names; milliseconds, either or both)
and the pool's latency predictor (`epp.predictor.shared(pool)`), as predicted-latency-scorer does.
Keeps the candidates whose predicted TTFT and TPOT are within the objectives less `headroom` (0.2: predicted at
most 80 % of the objective), leaving room for the prediction's error. When none qualifies it keeps the single
candidate closest to its objectives (the smallest predicted/objective ratio), so the request is still served as
well as the pool can; shedding it instead belongs to flow control.
Passes every candidate through when the request states no objective, when a header is not a positive number (an
objective the client got wrong is no reason to fail its request), and while the predictor is cold; a TPOT objective
is ignored while TPOT is cold.
Parameters: pool ("default"), headroom (0.2, in [0, 1)).
Trade-offs: the headroom trades objectives met against spreading: a large one sends SLO traffic to the emptiest
endpoints only; filtering acts before scoring, so among the endpoints that qualify the scorers (prefix, load) still
choose, which keeps cache affinity for requests with loose objectives.
"""

from __future__ import annotations

import math

from epp.datalayer.endpoint import Endpoint
from epp.predictor import shared
from epp.predictor.candidates import PREDICTED_LATENCY, PREDICTION_READS
from epp.scheduling.errors import ConfigError
from epp.scheduling.framework import Filter, Parameters, register
from epp.scheduling.types import CycleState, SchedulingRequest

TTFT_HEADER = "x-slo-ttft-ms"
TPOT_HEADER = "x-slo-tpot-ms"


def _objective(headers: dict[str, str], name: str) -> float | None:
    """Seconds, or None when absent or not a positive finite number."""
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        return None
    return value / 1e3 if math.isfinite(value) and value > 0 else None


@register("slo-headroom-filter")
class SLOHeadroomFilter(Filter):
    consumes = PREDICTION_READS
    produces = (PREDICTED_LATENCY,)

    def __init__(self, parameters: dict | None):
        p = Parameters("slo-headroom-filter", parameters)
        self.predictions = shared(p.get("pool", "default", str))
        headroom = float(p.get("headroom", 0.2, (int, float), minimum=0))
        p.done()
        if headroom >= 1:
            raise ConfigError(f"slo-headroom-filter: parameter headroom must be < 1, got {headroom!r}")
        self.allowance = 1.0 - headroom

    def filter(self, cycle_state: CycleState, request: SchedulingRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        headers = request.headers
        if TTFT_HEADER not in headers and TPOT_HEADER not in headers:
            return endpoints
        ttft_slo, tpot_slo = _objective(headers, TTFT_HEADER), _objective(headers, TPOT_HEADER)
        if ttft_slo is None and tpot_slo is None:
            return endpoints
        predicted = self.predictions.get(cycle_state, request, endpoints, tpot=tpot_slo is not None)
        if predicted is None:
            return endpoints
        # The worst ratio of prediction to objective per candidate: <= allowance means it meets both with headroom.
        ratios = []
        for ttft, tpot in predicted:
            ratio = ttft / ttft_slo if ttft_slo is not None else 0.0
            if tpot_slo is not None and tpot is not None:
                ratio = max(ratio, tpot / tpot_slo)
            ratios.append(ratio)
        allowance = self.allowance
        kept = [e for e, r in zip(endpoints, ratios, strict=True) if r <= allowance]
        return kept or [endpoints[ratios.index(min(ratios))]]
