"""slo-interference-filter: keep a request's prefill off the endpoints where it would push requests already there
past their latency objectives.

Why: slo-headroom-filter asks whether a request meets its own objectives on a candidate, not what it does to the
requests already there. With chunked prefill every step that prefills a chunk of a new prompt also decodes the
endpoint's running requests and prefills its waiting ones, so they wait for that chunk: a new prompt's prefill time
lands in the token gaps of every request decoding beside it, and a chunk of it in the first-token time of every
request still waiting for its first token there. A 6,000-token summary with a loose objective passes everywhere,
the scorers send it to the emptiest endpoint, and there its ~0.6 s of prefill (on the sim: 3 chunked steps of ~0.2
s) stretches the decode of the chat turns whose 50 ms per-token objective leaves ~1 s of slack over 64 tokens, and
holds back the first token of a chat turn routed there a moment before it (300 ms objective, ~100 ms predicted).

Reads: the request headers `x-slo-ttft-ms` / `x-slo-tpot-ms` (slo-headroom-filter's) and its `max_tokens`; the
pool's latency predictor (`epp.predictor.shared(pool)`): the request's predicted TTFT and TPOT on the endpoint it
was routed to, the prefix match (cached tokens, `CandidatePredictions.cached_tokens`, which predicted-latency-filter
or -scorer wires; without them every prompt counts as uncached) and the learnt prefill rate (seconds per uncached
prompt token, `PrefillBacklog.seconds_per_token`).
State, per endpoint: each request in flight there that stated objectives, with its slacks: objective - predicted
TTFT there at routing (and when its first token is expected: routing + predicted TTFT), and (TPOT objective -
predicted TPOT) x (max_tokens - 1), the decode time it may lose to stalls and still meet its mean time per output
token (no TPOT slack without a max_tokens of at least 2). Every request routed to the endpoint after it (with or
without objectives of its own) takes its predicted prefill time (uncached prompt tokens x seconds per token) off the
TPOT slack, and off the TTFT slack while the first token is not expected yet. An entry goes when its request
completes: ResponseComplete runs once per routed request whatever ended it (an error status, a reset, a cancelled
client), so the state is bounded by the requests in flight.
Filter: a candidate breaks an in-flight request when the new prefill time exceeds a slack of it (one whose slack is
already gone is lost whatever this placement does, and is not counted). Keeps the candidates that break none; when
every candidate breaks some, those that break the fewest (goodput counts requests). Among those kept, the next
filters and the scorers choose as before, so a short prompt (a few ms of prefill) is almost never constrained and a
long one goes where the requests beside it can absorb it, which segregates long prefills from tight-objective
requests only as far as the objectives in flight require. Inert without requests with objectives in flight; passes
every candidate while the predictor is cold (no slack is known then) and for a single candidate.
Cost: one lookup per candidate (the least slack there, kept when its entries change); the prefix match and the
count only on the endpoints where the prefill could break a request.
Parameters: pool ("default").
Trade-offs: the predicted TPOT an entry starts from already includes the stalls typical of the traffic it was
learnt from, so the slack is conservative (a stall can count twice); and a request waiting for its first token is
held back by one chunk of a later prefill, not all of it (the engine's chunk size is not known here), so the whole
prefill is an upper bound. Both err towards keeping long prefills apart. Only this EPP's requests are known
(several EPP replicas each protect their own); the stall is the prefill's time at the pool's learnt rate, whatever
the batch there.
"""

from __future__ import annotations

import math
import time

from epp.datalayer.endpoint import Endpoint
from epp.predictor import shared
from epp.predictor.candidates import PREDICTED_LATENCY, PREDICTION_READS
from epp.scheduling.framework import Filter, Parameters, PreRequest, ResponseComplete, register
from epp.scheduling.plugins.slo_headroom_filter import TPOT_HEADER, TTFT_HEADER, objective_seconds
from epp.scheduling.types import CycleState, ResponseInfo, SchedulingRequest, SchedulingResult, StateKey


class InFlight:
    """One request in flight with objectives: the time its first token and its decode may still lose (seconds;
    infinite for an objective it did not state), and when its first token is expected (time.monotonic())."""

    __slots__ = ("endpoint", "first_token_at", "tpot_slack", "ttft_slack")

    def __init__(self, endpoint: str, ttft_slack: float, first_token_at: float, tpot_slack: float):
        self.endpoint = endpoint
        self.ttft_slack = ttft_slack
        self.first_token_at = first_token_at
        self.tpot_slack = tpot_slack

    def exposure(self, now: float) -> float:
        """The longest prefill that can start beside it `now` without making it miss an objective it still meets
        (infinite when it has lost one already: nothing placed beside it changes that)."""
        ttft, tpot = self.ttft_slack, self.tpot_slack
        if ttft < 0.0 or tpot < 0.0:
            return math.inf
        return ttft if now < self.first_token_at and ttft < tpot else tpot

    def stall(self, seconds: float, now: float) -> None:
        """A prefill of `seconds` was placed beside it `now`."""
        self.tpot_slack -= seconds
        if now < self.first_token_at:
            self.ttft_slack -= seconds


# The request's entry (None: it stated no usable objective, or it could not be predicted), for its completion.
IN_FLIGHT: StateKey[InFlight] = StateKey("slo-interference-in-flight")


@register("slo-interference-filter")
class SLOInterferenceFilter(Filter, PreRequest, ResponseComplete):
    consumes = PREDICTION_READS
    produces = (PREDICTED_LATENCY, IN_FLIGHT)
    # the entry and the stall must be in place before the next request of a burst is scheduled
    at_pick = True

    def __init__(self, parameters: dict | None):
        p = Parameters("slo-interference-filter", parameters)
        self.predictions = shared(p.get("pool", "default", str))
        p.done()
        self.in_flight: dict[str, set[InFlight]] = {}  # endpoint name -> its entries; no empty sets
        # endpoint name -> the least exposure of its entries when they last changed: a lower bound now (time only
        # ends TTFT exposures), so the filter counts entries only where a prefill could break one
        self.tightest: dict[str, float] = {}

    def prefill_seconds(
        self, cycle_state: CycleState, request: SchedulingRequest, endpoints: list[Endpoint]
    ) -> list[float]:
        """The predicted prefill time of `request` on each of `endpoints` (its uncached prompt tokens at the pool's
        learnt rate)."""
        prompt = request.prompt_tokens_estimate
        cached = self.predictions.cached_tokens
        tokens = cached(cycle_state, request, endpoints) if cached is not None else [0] * len(endpoints)
        rate = self.predictions.predictor.backlog.seconds_per_token
        return [(prompt - min(max(c, 0), prompt)) * rate for c in tokens]

    def filter(self, cycle_state: CycleState, request: SchedulingRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        in_flight = self.in_flight
        if len(endpoints) < 2 or not in_flight or not self.predictions.predictor.ttft_ready:
            return endpoints
        # the endpoints where the prefill, with nothing of it cached, could break a request; the prefix match (a
        # lookup per endpoint) and the count only for those
        worst = request.prompt_tokens_estimate * self.predictions.predictor.backlog.seconds_per_token
        tightest = self.tightest
        exposed = [i for i, e in enumerate(endpoints) if tightest.get(e.spec.name, math.inf) < worst]
        if not exposed:
            return endpoints
        now = time.monotonic()
        broken = [0] * len(endpoints)
        stalls = self.prefill_seconds(cycle_state, request, [endpoints[i] for i in exposed])
        for i, stall in zip(exposed, stalls, strict=True):
            broken[i] = sum(f.exposure(now) < stall for f in in_flight[endpoints[i].spec.name])
        fewest = min(broken)
        return [e for e, b in zip(endpoints, broken, strict=True) if b == fewest]

    def _changed(self, name: str, now: float) -> None:
        entries = self.in_flight.get(name)
        if entries:
            self.tightest[name] = min(f.exposure(now) for f in entries)
        else:
            self.in_flight.pop(name, None)
            self.tightest.pop(name, None)

    def pre_request(self, request: SchedulingRequest, result: SchedulingResult) -> None:
        endpoint = result.primary
        name, cycle_state, now = endpoint.spec.name, result.cycle_state, time.monotonic()
        entries = self.in_flight.get(name)
        if entries:
            stall = self.prefill_seconds(cycle_state, request, [endpoint])[0]
            for f in entries:
                f.stall(stall, now)
        entry = self._entry(request, cycle_state, endpoint, now)
        if entry is not None:
            self.in_flight.setdefault(name, set()).add(entry)
            cycle_state.write(IN_FLIGHT, entry)
        if entries or entry is not None:
            self._changed(name, now)

    def _entry(
        self, request: SchedulingRequest, cycle_state: CycleState, endpoint: Endpoint, now: float
    ) -> InFlight | None:
        """The request's own entry on `endpoint`, when it states an objective and it can be predicted there."""
        ttft_objective = objective_seconds(request.headers, TTFT_HEADER)
        tpot_objective = objective_seconds(request.headers, TPOT_HEADER)
        output = request.max_tokens
        if output is None or output < 2:
            tpot_objective = None  # no decode budget to spend
        if ttft_objective is None and tpot_objective is None:
            return None
        predicted = self.predictions.get(cycle_state, request, [endpoint], tpot=tpot_objective is not None)
        if predicted is None:
            return None
        ttft, tpot = predicted[0]
        if tpot is None:  # TPOT still cold
            if ttft_objective is None:
                return None
            tpot_objective = None
        return InFlight(
            endpoint.spec.name,
            math.inf if ttft_objective is None else ttft_objective - ttft,
            now + ttft,
            math.inf if tpot_objective is None else (tpot_objective - tpot) * (output - 1),
        )

    def response_complete(
        self, request: SchedulingRequest, result: SchedulingResult, endpoint: Endpoint, response: ResponseInfo
    ) -> None:
        entry = result.cycle_state.read(IN_FLIGHT)
        if entry is None:
            return
        result.cycle_state.write(IN_FLIGHT, None)
        entries = self.in_flight.get(entry.endpoint)
        if entries is not None:
            entries.discard(entry)
            self._changed(entry.endpoint, time.monotonic())
