"""Predictions for one request on each candidate endpoint, shared by the scheduling plugins that read them.

The SLO filter and the latency scorer of one profile ask for the same request: the first computes the candidates'
predictions and keeps them in the cycle state (PREDICTED_LATENCY), the second reuses them; a later cycle (a retry)
starts afresh, so it sees the backlog its own routing added.
"""

from __future__ import annotations

from collections.abc import Callable

from epp.datalayer.endpoint import Endpoint, adapter_listed
from epp.datalayer.load import QUEUE_DEPTH_READS, RUNNING_REQUESTS_READS
from epp.predictor.predictor import LatencyPredictor
from epp.scheduling.types import CycleState, SchedulingRequest, StateKey

# Endpoint name -> (TTFT, TPOT or None) seconds for this cycle's request.
PREDICTED_LATENCY: StateKey[dict[str, tuple[float, float | None]]] = StateKey("predicted-latency")
# Endpoint name -> the prompt tokens it probably holds in its prefix cache for this cycle's request (`CachedTokens`),
# for the endpoints predicted so far.
CACHED_TOKENS: StateKey[dict[str, int]] = StateKey("predicted-latency-cached-tokens")
# What a plugin reading the predictions consumes (`Plugin.consumes`).
PREDICTION_READS = (
    *dict.fromkeys(
        (
            *QUEUE_DEPTH_READS,
            *RUNNING_REQUESTS_READS,
            "kv_usage",
            "in_flight_tokens",
            "running_adapters",
            "waiting_adapters",
        )
    ),
    PREDICTED_LATENCY,
)

# The prompt tokens a candidate probably holds in its prefix cache for a request: the prefix scorer's match
# (`PrefixCacheScorer.cached_tokens`). The director sets it when it wires the predictor; without it every prompt
# counts as uncached, which still ranks the candidates by load but misses what a cache hit saves.
CachedTokens = Callable[[CycleState, SchedulingRequest, list[Endpoint]], list[int]]


class CandidatePredictions:
    """Parameter: predictor. The scheduler sets, from its prefix index (`PrefixIndexStats`): cached_tokens (see
    CachedTokens; None = nothing cached) and unknown_tokens (a CachedTokens too: what to expect cached on an endpoint
    the prefix index knows nothing of, `unknown_endpoint_tokens`), counted in the predictions the plugins compare
    (`get`) and not in the features the predictor learns from (`cached`); None = none."""

    def __init__(self, predictor: LatencyPredictor):
        self.predictor = predictor
        self.cached_tokens: CachedTokens | None = None
        self.unknown_tokens: CachedTokens | None = None
        self._adapters: set[str] = set()

    def adapter(self, model: str, endpoints: list[Endpoint]) -> str | None:
        """`model` when it is a LoRA adapter, None for a base-model request. An adapter is a name some endpoint
        reported running or waiting, now or earlier: a request for an adapter that no candidate holds right now is
        still one that must load it (the feature that matters), not a base-model request."""
        return model if adapter_listed(model, endpoints, self._adapters) else None

    def cached(self, cycle_state: CycleState, request: SchedulingRequest, endpoints: list[Endpoint]) -> list[int]:
        """The prompt tokens each of `endpoints` probably holds for `request` (0 without a prefix index), looked up
        once per endpoint and cycle (CACHED_TOKENS)."""
        lookup = self.cached_tokens
        if lookup is None:
            return [0] * len(endpoints)
        known = cycle_state.read(CACHED_TOKENS)
        if known is None:
            known = {}
            cycle_state.write(CACHED_TOKENS, known)
        missing = [e for e in endpoints if e.spec.name not in known]
        if missing:
            for e, tokens in zip(missing, lookup(cycle_state, request, missing), strict=True):
                known[e.spec.name] = tokens
        return [known[e.spec.name] for e in endpoints]

    def get(
        self, cycle_state: CycleState, request: SchedulingRequest, endpoints: list[Endpoint], tpot: bool
    ) -> list[tuple[float, float | None]] | None:
        """(TTFT, TPOT or None) seconds per endpoint, in order; None while the predictor is cold. TPOT is predicted
        only when `tpot` (the caller reads it) and TPOT is past its cold start."""
        predictor = self.predictor
        if not predictor.ttft_ready:
            return None
        tpot = tpot and predictor.tpot_ready
        known = cycle_state.read(PREDICTED_LATENCY)
        if known is None:
            known = {}
            cycle_state.write(PREDICTED_LATENCY, known)
        missing = [e for e in endpoints if (p := known.get(e.spec.name)) is None or (tpot and p[1] is None)]
        if missing:
            tokens = self.cached(cycle_state, request, missing)
            if self.unknown_tokens is not None:
                expected = self.unknown_tokens(cycle_state, request, missing)
                tokens = [t if t >= x else x for t, x in zip(tokens, expected, strict=True)]
            adapter = self.adapter(request.model, endpoints)
            predicted = predictor.predict_endpoints(missing, request.prompt_tokens_estimate, tokens, adapter, tpot=tpot)
            for e, p in zip(missing, predicted, strict=True):
                known[e.spec.name] = p
        return [known[e.spec.name] for e in endpoints]
