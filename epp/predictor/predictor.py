"""The pool's latency predictor: TTFT and time per output token (TPOT) of a request on an endpoint, learnt online.

The two calls the request path makes, on a scheduler's predictor (`Scheduler.predictions.predictor`): the
predictor plugins' hooks make both (`PredictorFeed`, run by the scheduler as the director reports the request's
progress); the scheduling plugins only predict.
  (a) at routing time, for the endpoint it picked (its prompt goes into that endpoint's prefill backlog):
        features = predictor.routed(endpoint, prompt_tokens, cached_tokens, adapter)
  (b) when the request completes:
        predictor.observe(features, ttft_seconds, tpot_seconds)   # tpot None when fewer than two tokens came back
      only for a streamed response that produced tokens: a non-streamed body's first byte comes after its last
      token, so its "TTFT" would teach the model end-to-end times; failed requests teach nothing.
`cached_tokens` is the prefix scorer's match on that endpoint (`PrefixCacheScorer.cached_tokens`), `adapter` the
request's LoRA adapter or None. Everything is synchronous and bounded: `routed` costs ~2 us; `observe` is O(n^2)
for n = 13 inputs plus an O(n^3) re-solve every `refit_every` observations, ~40 us amortised for both targets
(a 2-core dev box, pure Python); the state is two n x n systems, two error windows and one backlog entry and one
prefill rate per endpoint. The models learn from about `max_learn_rate` observations a second at most (200): above
it, from every k-th, k set from the rate over the last quarter of a second (records come in the proxy's flushes,
every 100 ms); a burst after a quiet spell is learnt whole for its first quarter of a second. At a thousand
streamed requests a second consecutive observations repeat each other, and learning from every one was the larger
part of what the predictor cost each request (`epp-bench handler-cpu --streamed`, `epp-bench overhead --streamed`);
the prefill rates (`PrefillBacklog.learn`) still see every observation, their clean samples being rare.

Model: one weighted online ridge regression per target (`OnlineRidge`, coefficients >= 0) on `features.vector`. Each observation is
weighted by 1 / y^2, so the fit minimises squared *relative* error, which is what MAPE scores and what routing
needs: a 40 ms error matters on a 50 ms TTFT, not on a 2 s one. Forgetting (decay 0.998, ~500 observations of
memory) follows drift in the workload and the servers. An endpoint's TTFT is the model's times its slowness, its
prefill time per token measured on its own long prompts over the endpoints' mean (`PrefillBacklog.slowness`; the
model learns each TTFT divided by it): a pool of two GPU generations gets one model, scaled per endpoint.

Cold start: each target reports no prediction (None) until it has `min_observations` and its error over the last
`window` observations, measured before learning from each one (prequential), is at most `max_mape`. The plugins
then abstain and the other scorers decide. A target that later degrades past `max_mape` goes quiet again.
`max_mape` is 0.3: on the agentic workload (long shared tools prompts, subagents) the TTFT error stays at 36-47 %
and routing by those predictions was worse than the scorers alone, for one EPP (TTFT mean / p90 84-86 / 145-153
against 80 / 136 ms) and more so for three sharing replicas (103 / 179 against 87 / 145 ms); on the workloads where
the predictor earns its place (heterogeneous prompts, KV pressure) its error is 16-18 % and nothing changed
(docs/2026-11-30-replicas-notebook.md, "On a quiet host after the merges", the two tries after its runs).

Trade-offs: one model for the whole pool assumes endpoints that differ only in prefill speed, if at all (TPOT is not
scaled per endpoint: its features see the batch, not the GPU); a linear model in
these inputs captures prefill and decode cost and queueing ahead, not their saturation knees; TPOT is predicted
from the state at routing time, not from what arrives during decoding.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from time import monotonic

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from epp.datalayer.endpoint import Endpoint
from epp.predictor.backlog import PrefillBacklog
from epp.predictor.features import RAW, SIZE, Features, endpoint_features, factors, matrix, predict_rows, vector
from epp.predictor.ridge import OnlineRidge

# Latencies below these floors are weighted as if they were the floor: it bounds one tiny observation's weight.
TTFT_FLOOR = 0.001
TPOT_FLOOR = 0.0005
# Up to this many candidates, predict_endpoints does the model's arithmetic in Python: numpy's fixed cost per call
# is larger below it (measured: see predict_endpoints).
FEW_CANDIDATES = 8


# Ratios a size class needs before its own quantiles replace the pool-wide ones: few, since a rare class (20 % of
# the requests, 25 % of their responses sampled) takes minutes to fill a window, and a few of its own ratios already
# bound its error better than the pool-wide ones, which the other classes make.
SIZE_CLASS_MIN = 10
# The span over which the rate of observations sets how many the models learn from (LatencyPredictor._learns):
# a few of the proxy's access-log flushes (100 ms apart), short enough that a burst is sampled within it.
LEARN_RATE_WINDOW = 0.25


def size_class(prompt_tokens: int) -> int:
    """Prompt lengths between consecutive powers of two share a class (bounded: 17 classes up to 100k tokens)."""
    return max(prompt_tokens, 1).bit_length()


class _Ratios:
    """A sliding window of ratios observed / predicted, with a sorted copy made on demand after a change."""

    def __init__(self, window: int):
        self.values: deque[float] = deque(maxlen=window)
        self._sorted: list[float] | None = None

    def add(self, ratio: float) -> None:
        self.values.append(ratio)
        self._sorted = None

    def quantile(self, q: float) -> float:
        ordered = self._sorted
        if ordered is None:
            ordered = self._sorted = sorted(self.values)
        if not ordered:
            return 1.0
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class _Target:
    """One predicted quantity: its regression and, over a sliding window, its absolute percentage errors and its
    ratios observed / predicted, pool-wide and per request size class (`size_class`).

    Why per size: the errors are not alike across sizes. On the sim pool (`python -m harness.bench.prediction --route
    epp-predicted --phase 20 --trace`) the ratios of ~150-token prompts spread 0.77-1.70 (q10-q90: their TTFT is a
    few decode steps, and a step more or less is a large share) and those of ~3,700-token prompts 0.90-1.13 (mostly
    their own prefill). One pool-wide band (0.82-1.60) is too wide to tell a long prompt on an idle endpoint from one
    queued behind another long prefill, and too narrow for a short one."""

    def __init__(self, floor: float, window: int, decay: float, refit_every: int):
        self.floor = floor
        self.window = window
        # every input measures work, so every coefficient is >= 0 (ridge.py says why that matters for routing)
        self.model = OnlineRidge(SIZE, decay=decay, refit_every=refit_every, nonnegative=True)
        self.errors: deque[float] = deque(maxlen=window)
        self.ratios = _Ratios(window)
        self.ratios_by_size: dict[int, _Ratios] = {}

    def learn(self, x: list[float], y: float, prompt_tokens: int, slowness: float = 1.0) -> None:
        """One observation `y` of inputs `x`, of a request with `prompt_tokens` (its size class), on an endpoint
        whose `slowness` scales the model's predictions there: the model learns y / slowness."""
        if self.model.coefficients is not None:  # before the first fit there is no prediction to score
            predicted = max(self.model.predict(x) * slowness, self.floor)
            self.errors.append(abs(predicted - y) / y)
            ratio = y / predicted
            self.ratios.add(ratio)
            size = size_class(prompt_tokens)
            by_size = self.ratios_by_size.get(size)
            if by_size is None:
                by_size = self.ratios_by_size[size] = _Ratios(self.window)
            by_size.add(ratio)
        y /= slowness
        self.model.add(x, y, 1.0 / max(y, self.floor) ** 2)

    def ratio_quantile(self, q: float, prompt_tokens: int | None = None) -> float:
        """The q-quantile of observed / predicted over the window (1.0 before any): a prediction times this is
        what the latency stays under for a share q of recent requests; of requests of the size of
        `prompt_tokens` when given and that size class has at least SIZE_CLASS_MIN ratios."""
        if prompt_tokens is not None:
            by_size = self.ratios_by_size.get(size_class(prompt_tokens))
            if by_size is not None and len(by_size.values) >= SIZE_CLASS_MIN:
                return by_size.quantile(q)
        return self.ratios.quantile(q)

    @property
    def mape(self) -> float | None:
        # Read from the metrics scrape's thread too: sum() over a deque of floats runs in C under the GIL, so the
        # event loop cannot append in the middle of it.
        return sum(self.errors) / len(self.errors) if self.errors else None


class LatencyPredictor:
    """Parameters: min_observations (100), max_mape (0.3: predictions are withheld while the windowed error is
    worse), window (200 observations for the error), decay (0.998 per observation), refit_every (8), max_learn_rate
    (about 200 observations a second learnt at most)."""

    def __init__(
        self,
        min_observations: int = 100,
        max_mape: float = 0.3,
        window: int = 200,
        decay: float = 0.998,
        refit_every: int = 8,
        max_learn_rate: float = 200.0,
    ):
        if min_observations < 1 or max_mape <= 0 or window < 1 or not max_learn_rate > 0:
            raise ValueError(
                "LatencyPredictor: min_observations >= 1, max_mape > 0, window >= 1 and max_learn_rate > 0 required"
            )
        self.min_observations, self.max_mape, self.max_learn_rate = min_observations, max_mape, max_learn_rate
        self._learn_stride = 1  # learn from every k-th observation (see _learns)
        self._seen, self._seen_since = 0, -math.inf  # observations since, and when the window began
        self.ttft = _Target(TTFT_FLOOR, window, decay, refit_every)
        self.tpot = _Target(TPOT_FLOOR, window, decay, refit_every)
        self.ttft_ready = self.tpot_ready = False
        self.backlog = PrefillBacklog()
        # told of every observation this EPP makes, when peer replicas learn from it too (epp.replicas)
        self.observed: Callable[[Features, float, float | None], None] | None = None
        # (the fitted coefficients it was built from, SIZE x k matrix, floors, each column's factors): _coefficients
        self._matrix: tuple[tuple, np.ndarray, np.ndarray, tuple[tuple[float, ...], ...]] | None = None

    def routed(
        self,
        endpoint: Endpoint,
        prompt_tokens: int,
        cached_tokens: int,
        adapter: str | None,
        now: float | None = None,
        timed: bool = True,
    ) -> Features | None:
        """A request goes to `endpoint`: its uncached prompt tokens join the endpoint's prefill backlog, and its
        features there now are returned, to hand back to `observe`; None when the request will not be `timed` (a
        response that is not streamed has no TTFT to learn from, so nothing would read them)."""
        now = monotonic() if now is None else now
        uncached = prompt_tokens - min(max(cached_tokens, 0), prompt_tokens)
        ahead = self.backlog.add(endpoint.spec.name, uncached, now)
        return endpoint_features(endpoint, prompt_tokens, cached_tokens, adapter, ahead) if timed else None

    def observe(
        self, features: Features, ttft: float, tpot: float | None, now: float | None = None, own: bool = True
    ) -> None:
        """Learn from one completed request: seconds to its first token and mean seconds per later token. `own`:
        this EPP routed it (`observed` hears of it); False: a peer replica did and sent what it learnt."""
        if not (math.isfinite(ttft) and ttft > 0.0) or (tpot is not None and not (math.isfinite(tpot) and tpot > 0)):
            raise ValueError(f"observed latencies must be finite and positive, got ttft={ttft!r} tpot={tpot!r}")
        if own and self.observed is not None:
            self.observed(features, ttft, tpot)
        backlog, name = self.backlog, features.endpoint
        # the slowness the prediction was scored with: before this request's own sample
        slowness = backlog.slowness(name)
        backlog.learn(name, features.prompt_tokens - features.cached_tokens, features.backlog_tokens, ttft)
        if not self._learns(monotonic() if now is None else now):
            return
        x = vector(features)
        self.ttft.learn(x, ttft, features.prompt_tokens, slowness)
        self.ttft_ready = self._ready(self.ttft)
        if tpot is not None:
            self.tpot.learn(x, tpot, features.prompt_tokens)
            self.tpot_ready = self._ready(self.tpot)

    def _learns(self, now: float) -> bool:
        """Whether the models learn from this observation: all of them up to about max_learn_rate a second; above
        it every k-th, k = the rate over the last LEARN_RATE_WINDOW over max_learn_rate, rounded."""
        elapsed = now - self._seen_since
        if elapsed >= LEARN_RATE_WINDOW:
            if self._seen_since > -math.inf:
                self._learn_stride = max(1, round(self._seen / elapsed / self.max_learn_rate))
            self._seen, self._seen_since = 0, now
        self._seen += 1
        return self._seen % self._learn_stride == 0

    def _ready(self, target: _Target) -> bool:
        mape = target.mape
        return target.model.count >= self.min_observations and mape is not None and mape <= self.max_mape

    def predict_ttft(self, features: Features) -> float | None:
        """Seconds to the first token, or None during cold start."""
        if not self.ttft_ready:
            return None
        return max(self.ttft.model.predict(vector(features)) * self.backlog.slowness(features.endpoint), TTFT_FLOOR)

    def predict_tpot(self, features: Features) -> float | None:
        """Mean seconds per output token after the first, or None during cold start."""
        if not self.tpot_ready:
            return None
        return max(self.tpot.model.predict(vector(features)), TPOT_FLOOR)

    def predict_endpoints(
        self,
        endpoints: list[Endpoint],
        prompt_tokens: int,
        cached_tokens: list[int],
        adapter: str | None,
        now: float | None = None,
        tpot: bool = True,
    ) -> list[tuple[float, float | None]] | None:
        """(TTFT, TPOT or None) of one request on each endpoint: what `predict_*` would say of the features
        `routed` would record there, in one pass (the scheduling plugins' path); None during TTFT's cold start.
        TPOT is None too when `tpot` is False (nobody reads it) or TPOT is cold.
        Cost: one Python loop gathering the raw measurements (RAW), then for more than FEW_CANDIDATES one feature
        matrix and one matrix product for all of them (~25 us at 32 endpoints on a 2-core dev box, instead of ~90 us
        row by row), for fewer the same arithmetic in Python (`predict_rows`: at 4 endpoints ~1 us against numpy's
        fixed ~10 us)."""
        if not self.ttft_ready:
            return None
        now = monotonic() if now is None else now
        with_tpot = tpot and self.tpot_ready
        coefficients, floors, columns = self._coefficients(with_tpot)
        prefill = self.backlog
        queues, rates, seconds_per_token = prefill.queues, prefill.rates, prefill.seconds_per_token
        reference = prefill.reference
        missing = 1.0 if adapter is not None else 0.0  # for an endpoint without metrics
        few = len(endpoints) <= FEW_CANDIDATES
        rows: list = []  # the raw measurements: a row per candidate when few, else flat for numpy
        add = rows.append if few else rows.extend
        slowness: list[float] = []  # each endpoint's (PrefillBacklog.slowness)
        # queue_depth / running_requests (epp.datalayer.load), PrefillBacklog.tokens and .rate, inlined: this loop
        # is the per-candidate cost of the predictor
        for e, cached in zip(endpoints, cached_tokens, strict=True):
            name = e.spec.name
            measured = rates.get(name)  # [seconds per token, samples] once measured there
            if measured is None:
                rate = seconds_per_token
                slowness.append(1.0)
            else:
                rate = measured[0]
                slowness.append(rate / reference)
            queue = queues.get(name)
            backlog = 0.0
            if queue is not None:
                backlog = queue[0] - (now - queue[1]) / rate
                if backlog < 0.0:
                    backlog = 0.0
            uncached = prompt_tokens - (0 if cached < 0 else prompt_tokens if cached > prompt_tokens else cached)
            m, in_flight = e.metrics, e.in_flight_requests
            if m is None:
                waiting = running = in_flight
                kv, adapter_missing = 0.0, missing
            else:
                running, finished = m.running, e.in_flight_at_scrape - in_flight
                waiting = m.waiting - finished if finished > 0 else m.waiting
                unseen_waiting, unseen_running = in_flight - running, in_flight - m.waiting
                if unseen_waiting > waiting:
                    waiting = unseen_waiting
                if waiting < 0:
                    waiting = 0
                if unseen_running > running:
                    running = unseen_running
                kv = m.kv_usage
                adapter_missing = 0.0 if adapter is None or e.adapter_loaded(adapter) else 1.0
            busy = 1.0 if running or waiting else 0.0
            backlogged = 1.0 if backlog else 0.0
            add((waiting, running, kv, e.in_flight_tokens, uncached, adapter_missing, backlog, busy, backlogged))
        if few:
            ttft = [max(t * s, TTFT_FLOOR) for t, s in zip(predict_rows(rows, columns[0]), slowness, strict=True)]
            if not with_tpot:
                return [(t, None) for t in ttft]
            return list(zip(ttft, [max(t, TPOT_FLOOR) for t in predict_rows(rows, columns[1])], strict=True))
        raw = np.fromiter(rows, float, len(rows)).reshape(-1, len(RAW))
        predicted = matrix(raw) @ coefficients
        predicted[:, 0] *= np.fromiter(slowness, float, len(slowness))
        predicted = np.maximum(predicted, floors, out=predicted)
        if not with_tpot:
            return [(t, None) for t in predicted[:, 0].tolist()]
        return list(zip(predicted[:, 0].tolist(), predicted[:, 1].tolist(), strict=True))

    def _coefficients(self, with_tpot: bool) -> tuple[np.ndarray, np.ndarray, tuple[tuple[float, ...], ...]]:
        """The coefficients as a SIZE x k matrix (TTFT, then TPOT when asked), their floors and each column as
        `factors` for `predict_rows`, rebuilt only when a model was refitted."""
        fitted = (self.ttft.model.coefficients, self.tpot.model.coefficients if with_tpot else None)
        cached = self._matrix
        if cached is None or cached[0][0] is not fitted[0] or cached[0][1] is not fitted[1]:
            columns = [fitted[0]] if fitted[1] is None else list(fitted)
            floors = [TTFT_FLOOR, TPOT_FLOOR][: len(columns)]
            folded = tuple(factors(c) for c in columns)
            cached = self._matrix = (fitted, np.array(columns, dtype=float).T, np.array(floors), folded)
        return cached[1], cached[2], cached[3]

    @property
    def ttft_mape(self) -> float | None:
        """Mean absolute percentage error of TTFT over the last `window` observations (a fraction; None before
        any): the EPP's metrics export it."""
        return self.ttft.mape

    @property
    def tpot_mape(self) -> float | None:
        return self.tpot.mape

    @property
    def observations(self) -> int:
        return self.ttft.model.count

    def collect(self):
        """Its accuracy and what it learnt (inference_extension_latency_predictor_*), read when Prometheus
        scrapes."""
        error = GaugeMetricFamily(
            "inference_extension_latency_predictor_mape",
            "Mean absolute percentage error of the latency predictions over the recent window, by target.",
            labels=["target"],
        )
        for target, value in (("ttft", self.ttft_mape), ("tpot", self.tpot_mape)):
            if value is not None:
                error.add_metric([target], value)
        observations = CounterMetricFamily(
            "inference_extension_latency_predictor_observations",
            "Completed requests the latency predictor learnt from.",
        )
        observations.add_metric([], self.observations)
        slowness = GaugeMetricFamily(
            "inference_extension_latency_predictor_endpoint_slowness",
            "An endpoint's measured prefill time per token over the mean of the measured endpoints' (above 1: "
            "slower); its TTFT predictions are scaled by it.",
            labels=["model_server_pod"],
        )
        for name, value in self.backlog.measured_slowness().items():
            slowness.add_metric([name], value)
        yield from (error, observations, slowness)
