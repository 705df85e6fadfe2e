"""Predicted latency: an online model of TTFT and time per output token (`predictor.py` says which two calls the
request path makes). A scheduler owns one (`Scheduler.predictions`: `epp.scheduling.predictions`) for the plugins of its profile that read it:
the predictor plugins' hooks feed it and the scheduling plugins read it (`predicted-latency-scorer`,
`predicted-latency-filter`, `slo-headroom-filter`, `slo-interference-filter`)."""

from __future__ import annotations

import os

# The predictor's matrix products are small (the candidates by a dozen features; fits over a bounded window), and
# OpenBLAS's worker threads only busy-wait beside the event loop after each: 1.5 % of the EPP's CPU at concurrency 32
# on 2 cores (`perf record`). Set before numpy loads OpenBLAS; an environment that sets it keeps its own.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from epp.predictor.features import Features, endpoint_features
from epp.predictor.predictor import LatencyPredictor

__all__ = ["Features", "LatencyPredictor", "endpoint_features"]
