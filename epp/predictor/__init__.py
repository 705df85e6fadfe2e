"""Predicted latency: a per-pool online model of TTFT and time per output token (`predictor.py` says which two
calls the request path makes), shared by the director, which feeds it, and the scheduling plugins, which read it
(`predicted-latency-scorer`, `slo-headroom-filter`)."""

from __future__ import annotations

from epp.predictor.candidates import CandidatePredictions
from epp.predictor.features import Features, endpoint_features
from epp.predictor.predictor import LatencyPredictor

__all__ = ["CandidatePredictions", "Features", "LatencyPredictor", "endpoint_features", "forget", "shared"]

_SHARED: dict[str, CandidatePredictions] = {}


def shared(pool: str = "default") -> CandidatePredictions:
    """The process's predictions for `pool`, created on first use, so that the plugins (built from the scheduler
    config, which names the pool) and the director reach the same predictor: the director feeds
    `shared(pool).predictor.observe(...)` and sets `shared(pool).cached_tokens`. Keyed by names from the config,
    so bounded by its size."""
    candidates = _SHARED.get(pool)
    if candidates is None:
        candidates = _SHARED[pool] = CandidatePredictions(LatencyPredictor())
    return candidates


def forget(pool: str = "default") -> None:
    """Drop `pool`'s predictions: the next `shared(pool)` starts a predictor that has learnt nothing (a benchmark
    that builds an EPP's scheduler in a process that may have built one before)."""
    _SHARED.pop(pool, None)
