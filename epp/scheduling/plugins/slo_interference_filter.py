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

Reads: the request headers `x-llm-d-slo-ttft-ms` / `x-llm-d-slo-tpot-ms` (slo-headroom-filter's) and its `max_tokens`; the
scheduler's latency predictor (`LatencyPredictionReader`): the request's predicted TTFT and TPOT on the endpoint it
was routed to, the prefix match (cached tokens, `CandidatePredictions.cached_tokens`, which the scheduler wires to
its profile's prefix index; without one every prompt counts as uncached) and the learnt prefill rate (seconds per uncached
prompt token on the endpoint, `PrefillBacklog.rate`).
State, per endpoint (`Ledger`): each request in flight there that stated objectives, with its slacks: objective -
predicted TTFT there at routing (and when its first token is expected: routing + predicted TTFT), and (TPOT objective
- predicted TPOT) x (max_tokens - 1), the decode time it may lose to stalls and still meet its mean time per output
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
Cost: the slacks are budgets on a per-endpoint clock of the prefill time placed there, so placing a prefill is one
addition whatever the requests in flight, and counting the requests it breaks is two bisections of the sorted TPOT
budgets plus a look at the few waiting for their first token; the prefix match only on the endpoints where the
prefill, with nothing cached, would break one.
Parameters: none.
Trade-offs: a request that missed its TTFT objective through a prefill placed beside it is dropped, but one that
missed it otherwise (the prediction was wrong) is still protected for its decode. The predicted TPOT an entry starts
from already includes the stalls typical of the traffic it was learnt from, so the slack is conservative (a stall
can count twice); and a request waiting for its first token is held back by one chunk of a later prefill, not all
of it (the engine's chunk size is not known here), so the whole prefill is an upper bound. Both err towards keeping
long prefills apart. Only this EPP's requests are known (several EPP replicas each protect their own); the stall is
the prefill's time at the endpoint's learnt rate, whatever the batch there.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from time import monotonic

from epp.datalayer.endpoint import Endpoint
from epp.scheduling.framework import (
    Filter,
    LatencyPredictionReader,
    Parameters,
    PreRequest,
    ResponseComplete,
    Stability,
    register,
)
from epp.scheduling.plugins.slo_headroom_filter import TPOT_HEADER, TTFT_HEADER, objective_seconds
from epp.scheduling.predictions import CACHED_TOKENS, PREDICTED_LATENCY, PREDICTION_READS
from epp.scheduling.types import CycleState, ResponseInfo, SchedulingRequest, SchedulingResult, StateKey


class InFlight:
    """One request in flight with objectives. Its slacks are kept as budgets on its endpoint's stall clock
    (`Ledger.stalled`): slack now = budget - stalled, so a prefill placed there charges every request at once.
    tpot_budget is infinite for a request without a TPOT objective (or once it is lost), ttft_budget for one
    without a TTFT objective."""

    __slots__ = ("endpoint", "first_token_at", "tpot_budget", "ttft_budget")

    def __init__(self, endpoint: str, ttft_budget: float, first_token_at: float, tpot_budget: float):
        self.endpoint = endpoint
        self.ttft_budget = ttft_budget
        self.first_token_at = first_token_at  # time.monotonic() when its first token is expected
        self.tpot_budget = tpot_budget


class Ledger:
    """The requests with objectives in flight on one endpoint.
    stalled: prefill seconds placed there since the ledger was opened (it closes when its last entry goes);
    tpot_budgets: the TPOT budgets, sorted, so that the requests a prefill would break are two bisections away;
    pending: the entries with a TTFT objective that may still wait for their first token, sorted by TTFT budget
    (every budget >= stalled: those a prefill pushed below it are gone)."""

    __slots__ = ("pending", "stalled", "tpot_budgets")

    def __init__(self) -> None:
        self.stalled = 0.0
        self.tpot_budgets: list[float] = []
        self.pending: list[InFlight] = []

    def add(self, f: InFlight) -> None:
        """A request with its slacks as budgets on this ledger's clock (slack + stalled)."""
        if f.tpot_budget != math.inf:
            insort(self.tpot_budgets, f.tpot_budget)
        if f.ttft_budget != math.inf:
            insort(self.pending, f, key=_ttft_budget)

    def remove(self, f: InFlight) -> None:
        self.drop_tpot(f)
        if f.ttft_budget != math.inf and f in self.pending:
            self.pending.remove(f)

    def broken(self, stall: float, now: float) -> int:
        """The requests that a prefill of `stall` seconds placed here `now` makes miss an objective they still
        meet."""
        low, high = self.stalled, self.stalled + stall
        budgets = self.tpot_budgets
        count = bisect_left(budgets, high) - bisect_left(budgets, low)
        for f in self.pending:  # held back in their first token (and not already counted for their decode)
            if f.ttft_budget >= high:
                break
            if now < f.first_token_at and f.tpot_budget >= high:
                count += 1
        return count

    def stall(self, seconds: float, now: float) -> None:
        """A prefill of `seconds` is placed here `now`: every request here loses that much of its decode slack,
        those waiting for their first token of their TTFT slack too; one whose TTFT slack it uses up is lost."""
        self.stalled += seconds
        pending = self.pending
        gone = bisect_left(pending, self.stalled, key=_ttft_budget)
        for f in pending[:gone]:
            if now < f.first_token_at:
                self.drop_tpot(f)
        del pending[:gone]

    def drop_tpot(self, f: InFlight) -> None:
        if f.tpot_budget != math.inf:
            budgets = self.tpot_budgets
            del budgets[bisect_left(budgets, f.tpot_budget)]
            f.tpot_budget = math.inf

    def __bool__(self) -> bool:
        return bool(self.tpot_budgets or self.pending)


def _ttft_budget(f: InFlight) -> float:
    return f.ttft_budget


# The request's entry (None: it stated no usable objective, or it could not be predicted), for its completion.
IN_FLIGHT: StateKey[InFlight] = StateKey("slo-interference-in-flight")


@register("slo-interference-filter", Stability.BETA)
class SLOInterferenceFilter(Filter, LatencyPredictionReader, PreRequest, ResponseComplete):
    consumes = PREDICTION_READS
    produces = (PREDICTED_LATENCY, CACHED_TOKENS, IN_FLIGHT)
    # the entry and the stall must be in place before the next request of a burst is scheduled
    at_pick = True

    def __init__(self, parameters: dict | None):
        p = Parameters("slo-interference-filter", parameters)
        self.own_predictor()
        p.done()
        self.ledgers: dict[str, Ledger] = {}  # endpoint name -> its requests in flight with objectives; none empty

    def prefill_seconds(
        self, cycle_state: CycleState, request: SchedulingRequest, endpoints: list[Endpoint]
    ) -> list[float]:
        """The predicted prefill time of `request` on each of `endpoints` (its uncached prompt tokens at the
        endpoint's learnt rate)."""
        prompt = request.prompt_tokens_estimate
        tokens = self.predictions.cached(cycle_state, request, endpoints)
        rate = self.predictions.predictor.backlog.rate
        return [(prompt - min(max(c, 0), prompt)) * rate(e.spec.name) for e, c in zip(endpoints, tokens, strict=True)]

    def filter(self, cycle_state: CycleState, request: SchedulingRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        ledgers = self.ledgers
        if len(endpoints) < 2 or not ledgers or not self.predictions.predictor.ttft_ready:
            return endpoints
        # the endpoints where the prefill, with nothing of it cached, would break a request; the prefix match (a
        # lookup per endpoint) only for those
        now = monotonic()
        prompt, rate = request.prompt_tokens_estimate, self.predictions.predictor.backlog.rate
        exposed = [
            i
            for i, e in enumerate(endpoints)
            if (ledger := ledgers.get(e.spec.name)) and ledger.broken(prompt * rate(e.spec.name), now)
        ]
        if not exposed:
            return endpoints
        broken = [0] * len(endpoints)
        stalls = self.prefill_seconds(cycle_state, request, [endpoints[i] for i in exposed])
        for i, stall in zip(exposed, stalls, strict=True):
            broken[i] = ledgers[endpoints[i].spec.name].broken(stall, now)
        fewest = min(broken)
        return [e for e, b in zip(endpoints, broken, strict=True) if b == fewest]

    def pre_request(self, request: SchedulingRequest, result: SchedulingResult) -> None:
        endpoint = result.primary
        name, cycle_state, now = endpoint.spec.name, result.cycle_state, monotonic()
        ledger = self.ledgers.get(name)
        if ledger is not None:
            ledger.stall(self.prefill_seconds(cycle_state, request, [endpoint])[0], now)
        entry = self._entry(request, cycle_state, endpoint, now)
        if entry is None:
            if ledger is not None and not ledger:
                del self.ledgers[name]
            return
        if ledger is None:
            ledger = self.ledgers[name] = Ledger()
        entry.ttft_budget += ledger.stalled
        entry.tpot_budget += ledger.stalled
        ledger.add(entry)
        cycle_state.write(IN_FLIGHT, entry)

    def _entry(
        self, request: SchedulingRequest, cycle_state: CycleState, endpoint: Endpoint, now: float
    ) -> InFlight | None:
        """The request's own entry on `endpoint` (its slacks, not yet on the ledger's clock), when it states an
        objective it can still meet there and it can be predicted."""
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
            tpot_objective = None
        ttft_slack = math.inf if ttft_objective is None else ttft_objective - ttft
        tpot_slack = math.inf if tpot_objective is None else (tpot_objective - tpot) * (output - 1)
        if ttft_slack < 0.0 or tpot_slack < 0.0 or (ttft_slack == tpot_slack == math.inf):
            return None  # lost already (nothing placed beside it changes that), or nothing to keep
        return InFlight(endpoint.spec.name, ttft_slack, now + ttft, tpot_slack)

    def response_complete(
        self, request: SchedulingRequest, result: SchedulingResult, endpoint: Endpoint, response: ResponseInfo
    ) -> None:
        entry = result.cycle_state.read(IN_FLIGHT)
        if entry is None:
            return
        result.cycle_state.write(IN_FLIGHT, None)
        ledger = self.ledgers.get(entry.endpoint)
        if ledger is None:
            return
        ledger.remove(entry)
        if not ledger:
            del self.ledgers[entry.endpoint]
