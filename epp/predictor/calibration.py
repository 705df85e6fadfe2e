"""How much slower or faster each endpoint is than the pool's model predicts: one factor per endpoint and target.

The pool's regression (`predictor.py`) maps an endpoint's state to a latency as if every endpoint were the same
GPU. An InferencePool may select pods on two kinds of node (an H100 and an A100 generation, or one GPU shared with
another workload): then the same state means twice the latency on the slow ones, and a pool-wide model predicts the
average of both, too slow for the fast endpoints and too fast for the slow ones, which the latency scorer then
overloads. So each endpoint gets a multiplicative factor per target (TTFT, TPOT): the exponentially weighted mean
of log(observed / model's prediction) over the requests it served, starting at 1 (log 0) for an endpoint not seen
yet. Until an endpoint has served 1 / WEIGHT requests the mean weighs them equally, with PRIOR requests' worth of a
ratio of 1 (each new one weighs 1 / (n + PRIOR)), so a new endpoint is calibrated within a few requests without one
outlier setting its factor. A prediction for an endpoint is the model's times its factor; a slower GPU stretches
prefill and decode steps alike, so one factor per target, whatever the request's size. The predictor starts
calibrating once its model has learnt from `min_observations` requests: the residuals of its first fits say little
of the endpoints.

The model keeps learning from the raw latencies, so a factor is a residual against the pool's average, not an
input the model fits around (that loop would have no fixed scale and could drift). On alike endpoints the factors
stay near 1: with WEIGHT 0.02 (a memory of ~50 requests per endpoint) and the ~0.3 spread of log ratios of short
prompts, a factor's noise is ~3 %.
On the sim pool with every other server half as fast (`epp-bench compare --workload mixed-gpus`) see
`LatencyPredictor`'s figures in the README.

Bounded: one entry per endpoint name, at most MAX_ENDPOINTS (the oldest entry goes first); a departed endpoint's
entry goes with the next pool change (`forget`), so one that comes back starts again from 1.
"""

from __future__ import annotations

import math

WEIGHT = 0.02  # of each new log ratio in the mean, once an endpoint has served 1 / WEIGHT - PRIOR requests
PRIOR = 4  # requests' worth of a ratio of 1 that a new endpoint's factor starts from
MAX_ENDPOINTS = 4096
MAX_LOG_FACTOR = math.log(100.0)  # a factor stays within 1/100 .. 100 whatever one observation says


class EndpointCalibration:
    def __init__(self, weight: float = WEIGHT):
        if not 0 < weight <= 1:
            raise ValueError(f"EndpointCalibration: weight must be in (0, 1], got {weight!r}")
        self.weight = weight
        # endpoint name -> [log TTFT factor, log TPOT factor, TTFT factor, TPOT factor, TTFT and TPOT requests
        # learnt from]; read directly by LatencyPredictor.predict_endpoints
        self.factors: dict[str, list[float]] = {}

    def factor(self, name: str, target: int) -> float:
        """Endpoint `name`'s factor for `target` (0 TTFT, 1 TPOT): 1 until it has served a request."""
        entry = self.factors.get(name)
        return 1.0 if entry is None else entry[target + 2]

    def ttft(self, name: str) -> float:
        return self.factor(name, 0)

    def tpot(self, name: str) -> float:
        return self.factor(name, 1)

    def learn(self, name: str, target: int, ratio: float) -> None:
        """One request served by `name`: its observed / model-predicted `ratio` for `target` (0 TTFT, 1 TPOT)."""
        if not (ratio > 0 and math.isfinite(ratio)):
            return
        factors = self.factors
        entry = factors.get(name)
        if entry is None:
            if len(factors) >= MAX_ENDPOINTS:
                del factors[next(iter(factors))]
            entry = factors[name] = [0.0, 0.0, 1.0, 1.0, 0, 0]
        seen = entry[target + 4] = entry[target + 4] + 1
        weight = max(self.weight, 1.0 / (seen + PRIOR))
        log_factor = entry[target] + weight * (math.log(ratio) - entry[target])
        log_factor = min(max(log_factor, -MAX_LOG_FACTOR), MAX_LOG_FACTOR)
        entry[target] = log_factor
        entry[target + 2] = math.exp(log_factor)

    def forget(self, keep: set[str]) -> None:
        """Drop the endpoints not in `keep` (the pool's members now)."""
        for name in [n for n in self.factors if n not in keep]:
            del self.factors[name]
