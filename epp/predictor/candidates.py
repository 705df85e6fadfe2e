"""Predictions for one request on each candidate endpoint, shared by the scheduling plugins that read them.

The SLO filter and the latency scorer of one profile ask for the same request: the first call computes every
candidate's prediction, the second reuses it (only the last request's are kept, so memory stays flat). Reuse ends
when any request is routed (`LatencyPredictor.routed`), so a request scheduled again sees the backlog it joined.
"""

from __future__ import annotations

from collections.abc import Callable

from epp.datalayer.endpoint import Endpoint
from epp.predictor.predictor import LatencyPredictor
from epp.scheduling.types import SchedulingRequest

# The prompt tokens a candidate probably holds in its prefix cache for a request (the prefix scorer's match). The
# director sets it when it wires the predictor; without it every prompt counts as uncached, which still ranks the
# candidates by load but misses what a cache hit saves.
CachedTokens = Callable[[SchedulingRequest, Endpoint], int]


class CandidatePredictions:
    """Parameters: predictor; cached_tokens (see CachedTokens), None = nothing cached."""

    def __init__(self, predictor: LatencyPredictor, cached_tokens: CachedTokens | None = None):
        self.predictor = predictor
        self.cached_tokens = cached_tokens
        self._request: SchedulingRequest | None = None
        self._routings = -1  # predictor.routings when the predictions below were made
        self._by_name: dict[str, tuple[float, float | None]] = {}

    def get(self, request: SchedulingRequest, endpoints: list[Endpoint]) -> list[tuple[float, float | None]] | None:
        """(TTFT, TPOT or None) seconds per endpoint, in order; None while the predictor is cold."""
        if not self.predictor.ttft_ready:
            return None
        if request is not self._request or self._routings != self.predictor.routings:
            self._request, self._routings, self._by_name = request, self.predictor.routings, {}
        known = self._by_name
        missing = [e for e in endpoints if e.spec.name not in known]
        if missing:
            cached = self.cached_tokens
            tokens = [cached(request, e) for e in missing] if cached is not None else [0] * len(missing)
            model = request.model
            adapter = model if any(e.metrics is not None and (model in e.metrics.running_adapters or
                                                              model in e.metrics.waiting_adapters)
                                   for e in endpoints) else None  # fmt: skip
            predicted = self.predictor.predict_endpoints(missing, request.prompt_tokens_estimate, tokens, adapter)
            for e, p in zip(missing, predicted, strict=True):
                known[e.spec.name] = p
        return [known[e.spec.name] for e in endpoints]
