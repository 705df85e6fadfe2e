"""What the predictor knows of one (request, endpoint) pair at routing time, and the model's input vector.

The director gets `Features` for the endpoint a request went to at routing time (`LatencyPredictor.routed`, which
builds them with `endpoint_features`) and hands them back with the observed latencies when the request completes
(`LatencyPredictor.observe`); the scheduling plugins gather the same raw measurements for every candidate to predict. Both
sides go through `matrix`, so what is trained on is exactly what is predicted from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from epp.datalayer.endpoint import Endpoint
from epp.datalayer.load import queue_depth, running_requests


@dataclass(frozen=True)
class Features:
    """One request on one endpoint at routing time."""

    waiting: int  # the endpoint's waiting requests (last scrape, plus what this EPP routed there since)
    running: int  # its running requests (likewise)
    kv_usage: float  # its KV-cache usage, 0-1 (last scrape)
    in_flight_tokens: int  # prompt tokens this EPP routed there that have not finished (no scrape lag)
    prompt_tokens: int  # the request's prompt tokens (estimate)
    cached_tokens: int  # of those, the part expected in the endpoint's prefix cache (the prefix scorer's match)
    adapter_loaded: bool = True  # its LoRA adapter is loaded there (`Endpoint.adapter_loaded`; True: base model)
    backlog_tokens: float = 0.0  # prefill tokens queued there ahead of this request, probably not done yet (backlog.py)
    endpoint: str = ""  # its name: a long prompt's observation measures that endpoint's prefill rate (backlog.py)

    def __post_init__(self) -> None:
        if not 0 <= self.cached_tokens <= self.prompt_tokens:
            raise ValueError(f"cached_tokens must be within [0, prompt_tokens], got {self.cached_tokens}")


def endpoint_features(
    endpoint: Endpoint, prompt_tokens: int, cached_tokens: int, adapter: str | None, backlog_tokens: float = 0.0
) -> Features:
    """The features of sending a request to `endpoint` now.

    `cached_tokens` is clipped to `prompt_tokens` (both are estimates); `adapter` is the request's LoRA adapter name,
    None for a base-model request. Waiting and running are the scheduler's lag-corrected counts
    (`epp.datalayer.load`): a scrape is up to 50 ms old, and a burst routed since then is what makes a server busy.
    """
    m = endpoint.metrics
    cached = min(max(cached_tokens, 0), prompt_tokens)
    waiting, running, tokens = queue_depth(endpoint), running_requests(endpoint), endpoint.in_flight_tokens
    if m is None:
        return Features(
            waiting, running, 0.0, tokens, prompt_tokens, cached, adapter is None, backlog_tokens, endpoint.spec.name
        )
    loaded = adapter is None or endpoint.adapter_loaded(adapter)
    return Features(
        waiting, running, m.kv_usage, tokens, prompt_tokens, cached, loaded, backlog_tokens, endpoint.spec.name
    )


# The raw measurements of one (request, endpoint) pair, in this order: a row of `matrix`'s input. `vector` reads
# them from recorded Features (training), `LatencyPredictor.predict_endpoints` gathers them for every candidate.
RAW = (
    "waiting",
    "running",
    "kv_usage",
    "in_flight_tokens",
    "uncached_tokens",  # prompt_tokens - cached_tokens
    "adapter_missing",  # 1 when the request's LoRA adapter must be loaded first, else 0
    "backlog_tokens",
    "busy",  # 1 when the endpoint has running or waiting requests, else 0
    "backlogged",  # 1 when backlog_tokens > 0, else 0
)
# Scales keep every input near 1, so that the ridge penalty treats them alike and the normal equations stay
# well conditioned.
TOKENS = 1000.0
REQUESTS = 10.0
_SCALES = np.array([1 / REQUESTS, 1 / REQUESTS, 1.0, 1 / TOKENS, 1 / TOKENS, 1.0, 1 / TOKENS, 1.0, 1.0])
_RUNNING, _IN_FLIGHT, _UNCACHED = RAW.index("running"), RAW.index("in_flight_tokens"), RAW.index("uncached_tokens")


def raw(f: Features) -> tuple[float, ...]:
    """The raw measurements (RAW) of recorded features."""
    busy = f.running or f.waiting
    return (
        f.waiting,
        f.running,
        f.kv_usage,
        f.in_flight_tokens,
        f.prompt_tokens - f.cached_tokens,
        0.0 if f.adapter_loaded else 1.0,
        f.backlog_tokens,
        1.0 if busy else 0.0,
        1.0 if f.backlog_tokens else 0.0,
    )


def matrix(rows: np.ndarray) -> np.ndarray:
    """The model's inputs (n x SIZE) for n rows of raw measurements (n x len(RAW)): one array operation per
    column group, whatever the number of candidates. Why each input (the sim's step-time model and a GPU's both
    have this shape):
    * own prefill work: uncached prompt tokens (prompt_tokens x (1 - cached fraction));
    * work ahead of it: the prefill backlog there (and whether there is any: then the request waits for it, and
      for at least one step that prefills), the EPP's in-flight prompt tokens there, and the waiting requests;
    * decode work each prefill chunk shares a step with: running requests, and their product with the own prefill
      (a long prompt spans several steps, each paying for the running batch);
    * busy or idle: a request that finds the server idle starts at once, one that finds it busy first waits for
      the current step;
    * in-flight tokens times own prefill and times running requests: a long prompt already queued delays a short
      one that joins it in every chunked-prefill step, and the work ahead grows with the decode batch;
    * memory pressure (KV usage; preemptions and a full cache delay admission);
    * a LoRA adapter that must be loaded first.
    """
    x = np.empty((len(rows), SIZE))
    x[:, 0] = 1.0
    scaled = x[:, 1 : 1 + len(RAW)]
    np.multiply(rows, _SCALES, out=scaled)
    own, ahead, batch = scaled[:, _UNCACHED], scaled[:, _IN_FLIGHT], scaled[:, _RUNNING]
    np.multiply(own, batch, out=x[:, -3])
    np.multiply(ahead, own, out=x[:, -2])
    np.multiply(ahead, batch, out=x[:, -1])
    return x


def factors(coefficients: Sequence[float]) -> tuple[float, ...]:
    """`coefficients` of `matrix`'s SIZE inputs as factors of the raw measurements (RAW) and of the products of
    three of them, the scales folded in: what `predict_rows` multiplies."""
    c = [float(v) for v in coefficients]
    raw_factors = [c[1 + i] * float(s) for i, s in enumerate(_SCALES)]
    own, ahead, batch = (float(_SCALES[i]) for i in (_UNCACHED, _IN_FLIGHT, _RUNNING))
    return (c[0], *raw_factors, c[-3] * own * batch, c[-2] * ahead * own, c[-1] * ahead * batch)


def predict_rows(rows: Sequence[Sequence[float]], k: tuple[float, ...]) -> list[float]:
    """matrix(rows) @ coefficients for `k` = factors(coefficients), in plain arithmetic: for a few rows, without
    numpy's fixed cost per call (~10 us for the matrix and the product, whatever the number of rows)."""
    k0, k1, k2, k3, k4, k5, k6, k7, k8, k9, own_by_batch, ahead_by_own, ahead_by_batch = k
    return [
        k0
        + k1 * waiting
        + k2 * running
        + k3 * kv_usage
        + k4 * in_flight
        + k5 * uncached
        + k6 * adapter_missing
        + k7 * backlog
        + k8 * busy
        + k9 * backlogged
        + (own_by_batch * running + ahead_by_own * in_flight) * uncached
        + ahead_by_batch * in_flight * running
        for waiting, running, kv_usage, in_flight, uncached, adapter_missing, backlog, busy, backlogged in rows
    ]


def vector(f: Features) -> list[float]:
    """The model's inputs for recorded features (training, and one-at-a-time predictions)."""
    return matrix(np.array([raw(f)], dtype=float))[0].tolist()


SIZE = len(RAW) + 4  # the constant, the raw measurements and three products
