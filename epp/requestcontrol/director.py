"""The director: a request's lifecycle in the EPP, from its headers to the end of its response.

Request path (`route`): the model (validated against the pool's declared models) -> rewrite (the
x-llm-d-model-name-rewrite header or the pool's InferenceModelRewrite rules) -> objective lookup (priority) ->
admission -> scheduling -> in-flight accounting and metrics -> a RoutingDecision. Errors are OpenAIError with the
status the client gets.
Admission: the subset hint must allow an endpoint and the pool must have one (else 503). With flow control
(`epp.flowcontrol`, on by default) a request goes straight on while the pool has room and nothing waits (no
queue, no await); otherwise `route` returns an awaitable that resolves to the decision once the request's turn
comes (by priority band, fairly between flows; it is then scheduled among the endpoints that can start it now), or
raises 429 with retry-after when it expires or does not fit (503 when the pool has emptied meanwhile).
Without flow control, sheddable requests (priority < 0) get 429 while the pool is saturated and the rest go on.
A Responses follow-up (previous_response_id; GET and DELETE /v1/responses/{id}) is pinned to the endpoint that stored
its response, which `epp.requestcontrol.stored_responses` knows or finds by asking the pool (404 when none has it).
After the proxy has the answer, `after_routed` runs the scheduler's pre-request hooks (the prefix index records the
pick; the at-pick ones, unless the next decision came first) and observes the decision's histograms, off the
request's critical path.
Response path: `on_response_headers` (status, the endpoint that served; when the proxy sends them: our bootstrap
skips that round trip when its access log brings both, and a prompt then stops counting as its pick's pending
prefill once the pick's recent TTFT has passed: `_release_prefilled`), `on_response_chunk` (the usage tail, and a
rewritten model's name turned back into the client's), `on_complete` when the request is over (in-flight
accounting, the scheduler's response-complete hooks, metrics). `on_complete` runs exactly once per routed request,
whatever ended it.
The proxy's access log (`on_access_log`: Envoy writes a request's record when it ends and sends it within its
flush interval) brings a request's status and served endpoint, and for a streamed response its TTFT. Timings (the
scheduler's response-timed hooks, which the latency predictor learns from) come from the response body, when it
streamed through the EPP (at `on_complete`), or else from that record, with the time per output token from the
endpoint's scraped inter-token latency over the request's decode. Once the proxy has sent one record, each request
that ended without its status or its timings waits in `awaiting_records` for its record, and a record that comes
first (under load the proxy's flush can beat the stream's end to the EPP) waits in `early_records` for its
request's end; both tables are bounded in entries and age, so records that never come (a sampled access log) or
never match (another replica's requests) cost a request's status metrics or an observation, not memory.
"""

from __future__ import annotations

import itertools
import json
import logging
import random
import re
import uuid
from collections.abc import Awaitable, Callable
from heapq import heappop, heappush
from time import monotonic, perf_counter, time_ns

import cython

from epp.datalayer.datastore import Datastore
from epp.datalayer.endpoint import Endpoint, ModelRewrite, PoolState
from epp.flowcontrol import DEFAULT_FLOW, EVICTED_TTL, FlowController, FlowControlRejected
from epp.metrics import EPPMetrics
from epp.requestcontrol.stored_responses import HEAD_BYTES, ResponseLocator, gone
from epp.requestcontrol.tracing import RequestTracing
from epp.requestcontrol.types import RoutingDecision
from epp.scheduling.errors import SchedulingError
from epp.scheduling.scheduler import Scheduler
from epp.scheduling.types import CycleState, ResponseInfo, SchedulingRequest, SchedulingResult
from protocol.extproc import (
    DROPPED_SATURATED,
    DROPPED_TTL_EXPIRED,
    FAIRNESS_ID_HEADER,
    MAX_REQUEST_ID_CHARS,
    MODEL_NAME_REWRITE_HEADER,
    OBJECTIVE_HEADER,
    REQUEST_ID_HEADER,
    agent_identity,
    canonical_headers,
)
from protocol.openai import (
    RESPONSES,
    RESPONSES_PATH,
    OpenAIError,
    RequestKind,
    error_style,
    model_not_found,
    prompt_text,
    request_kind,
)
from protocol.responses import RESPONSE_ID_PREFIX

log = logging.getLogger("epp.requestcontrol")

STORED_RESPONSE_PATH = f"{RESPONSES_PATH}/{RESPONSE_ID_PREFIX}"  # GET and DELETE /v1/responses/{id}

_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
_USAGE_TAIL_BYTES = 4096
# Ended requests awaiting their access-log record: at most this many (the oldest go first; ~7-9 KB each with their
# contexts and, for a request whose timings are learnt, its scheduling result: a few tens of MB when records never
# come) for at most this long (a record comes within Envoy's flush interval, 0.1 s in our bootstrap, or its export
# timeout, 5 s). 4,096 entries cover 2 s of ended requests at 2,000 a second.
AWAITING_RECORDS_LIMIT = 4096
AWAITING_RECORDS_SECONDS = 10.0
# Before the proxy's first record, only this many wait for theirs: a proxy that sends neither response headers nor
# records (not our bootstrap) costs ~2 MB of requests waiting in vain, not the full table.
UNCONFIRMED_AWAITING_LIMIT = 256
# Records that came before the EPP saw their request end (under load Envoy's flush can beat the ext_proc stream's end
# to the EPP), kept as long: every record of a request the EPP is not waiting for lands here (one not streamed,
# another replica's), so the age bound is short and the table holds ~100 B an entry.
EARLY_RECORDS_SECONDS = 2.0
# Successful responses, with a plugin reading timings and none ever come from either source, before it says so (once),
# and the least time since the first of them: at start-up, at 1,000 responses a second, 100 end before the proxy's
# first access-log flush (0.1 s in our bootstrap).
UNTIMED_RESPONSES_WARNING = 100
UNTIMED_WARNING_SECONDS = 2.0


@cython.final
@cython.cclass
class RequestContext:
    """One request's state from its headers to the end of its response; owned by the director, held by the
    handler of the request's ext_proc stream."""

    dispatched = cython.declare(cython.bint, visibility="public")
    endpoint = cython.declare(object, visibility="public")
    error_style = cython.declare(object, visibility="public")
    first_chunk_at = cython.declare(cython.double, visibility="public")
    headers = cython.declare(dict, visibility="public")
    in_flight_tokens = cython.declare(cython.Py_ssize_t, visibility="public")
    kind = cython.declare(object, visibility="public")
    labels = cython.declare(object, visibility="public")
    metrics_age = cython.declare(cython.double, visibility="public")
    model = cython.declare(object, visibility="public")
    request = cython.declare(object, visibility="public")
    response_head = cython.declare(object, visibility="public")
    response_tail = cython.declare(object, visibility="public")
    result = cython.declare(object, visibility="public")
    routed_at = cython.declare(cython.double, visibility="public")
    scheduling_seconds = cython.declare(cython.double, visibility="public")
    served = cython.declare(object, visibility="public")
    status = cython.declare(object, visibility="public")
    streamed = cython.declare(cython.bint, visibility="public")
    subset = cython.declare(object, visibility="public")
    target_model = cython.declare(object, visibility="public")
    trace = cython.declare(object, visibility="public")
    trace_times = cython.declare(object, visibility="public")

    def __init__(self, headers: dict[str, str], subset: frozenset[str] | None):
        self.headers = headers
        self.subset = subset  # allowed "ip:port" from the proxy's subset hint; None = no hint
        self.model = self.target_model = ""  # the client's model name and the one the model server will see
        # the per-request metrics' labels (epp.metrics.REQUEST_LABELS): model, target model (bounded:
        # EPPMetrics.model_names), fairness id (bounded: EPPMetrics.fairness_label) and priority, as llm-d's are before
        # it knows them
        self.labels = ("", "", DEFAULT_FLOW, "0")
        self.request: SchedulingRequest | None = None
        self.result: SchedulingResult | None = None
        self.endpoint: Endpoint | None = None  # the pick, while the request is in flight
        self.in_flight_tokens = 0  # its prompt tokens counted in the pick's in_flight_tokens, until it answers
        self.routed_at = 0.0
        self.metrics_age = -1.0  # how old the pick's metrics (its latest scrape) were when it was picked; -1 = none
        self.scheduling_seconds = 0.0  # the decision's time, until its histograms observe it (Director.after_routed)
        self.served: str | None = None  # the endpoint that answered, as the proxy reports it
        self.status = ""  # the response's HTTP status
        self.response_tail = b""  # the last bytes of the response body (where the usage is)
        self.dispatched = False  # flow control let it through: its completion frees the turn
        self.first_chunk_at = 0.0  # when the first response body chunk came through (monotonic), 0 = none yet
        self.streamed = False  # the client asked for a streamed response (its first chunk is then the first token)
        self.kind: RequestKind | None = None  # the API its path names (None: another path)
        self.error_style = "openai"  # the shape of the errors the EPP answers it with (protocol.openai.error_style)
        self.response_head: bytes | None = None  # a stored Responses answer's first bytes, until its id is learnt
        self.trace = None  # its gateway.request span, when traced (epp.requestcontrol.tracing)
        # when traced: (queued from, queued until or 0, scheduled from, scheduled until), time_ns(), until its spans
        # are made (Director.after_routed)
        self.trace_times: list[int] | None = None


@cython.annotation_typing(True)
@cython.final
@cython.cclass
class Director:
    """Everything one EPP needs per request: the live pool, the scheduler and the metrics."""

    datastore = cython.declare(object, visibility="public")
    scheduler = cython.declare(object, visibility="public")
    metrics = cython.declare(object, visibility="public")
    flow_control = cython.declare(object, visibility="public")
    awaiting_records = cython.declare(dict, visibility="public")
    early_records = cython.declare(dict, visibility="public")
    access_log_seen = cython.declare(cython.bint, visibility="public")
    response_headers_seen = cython.declare(cython.bint, visibility="public")
    prefilling = cython.declare(list, visibility="public")
    _order = cython.declare(object, visibility="public")
    untimed_responses = cython.declare(cython.Py_ssize_t, visibility="public")
    untimed_since = cython.declare(cython.double, visibility="public")
    responses = cython.declare(object, visibility="public")
    _labelled_state = cython.declare(object, visibility="public")
    emit_endpoint_scores = cython.declare(cython.bint, visibility="public")
    tracing = cython.declare(object, visibility="public")
    load_changed = cython.declare(object, visibility="public")
    forward_record = cython.declare(object, visibility="public")
    turn = cython.declare(object, visibility="public")

    def __init__(
        self,
        datastore: Datastore,
        scheduler: Scheduler,
        metrics: EPPMetrics,
        flow_control: FlowController | None = None,
        emit_endpoint_scores: bool = False,
        tracing: RequestTracing | None = None,
    ):
        self.datastore = datastore
        self.emit_endpoint_scores = emit_endpoint_scores  # each decision carries its candidates' totals
        self.tracing = tracing
        self.scheduler = scheduler
        self.metrics = metrics
        self._labelled_state: PoolState | None = None  # the pool state whose model names the metrics pinned
        self.flow_control = flow_control
        # request id -> (ended at, its context, the pick, its output tokens): ended requests waiting for their
        # access-log record
        self.awaiting_records: dict[str, tuple[float, RequestContext, Endpoint, int | None]] = {}
        # request id -> (arrived at, TTFT, status, served endpoint): records that came before their request's end
        self.early_records: dict[str, tuple[float, float | None, str, str | None]] = {}
        self.access_log_seen = False
        self.response_headers_seen = False
        # (when its prefill should be over, order, context): routed requests whose pick's in_flight_tokens count
        # their prompt while the proxy reports no response headers (`_release_prefilled`)
        self.prefilling: list[tuple[float, int, RequestContext]] = []
        self._order = itertools.count()
        self.untimed_responses = 0  # successful responses while no timings ever came (-1: some did, or it was said)
        self.untimed_since = 0.0  # when the first of them ended
        self.responses = ResponseLocator()  # where each stored Responses answer is (previous_response_id)
        # told each time this EPP's in-flight counts change, when peer replicas share them (epp.replicas)
        self.load_changed: Callable[[], None] | None = None
        # given each access-log record that matches no request this EPP saw end: the gateway sends a replica the
        # records of every replica's requests, and the one that routed it learns from it (epp.replicas)
        self.forward_record: Callable[[str, float | None, str, str | None], None] | None = None
        # the replicas' turns (ReplicaChannel.turn): None to pick now, or an awaitable of this replica's turn
        self.turn: Callable[[], Awaitable[None] | None] | None = None

    @cython.ccall
    def new_request(
        self, headers: dict[str, str], subset: frozenset[str] | None, stream_traceparent: str | None = None
    ) -> RequestContext:
        """A request's context; traced (when tracing is on and it is sampled) from here, continuing the client's
        traceparent, else `stream_traceparent` (what the proxy's ext_proc call carried)."""
        self.datastore.note_request()
        ctx = RequestContext(canonical_headers(headers), subset)
        path = headers.get(":path", "")
        ctx.kind = request_kind(path)
        ctx.error_style = error_style(path)
        if self.tracing is not None:
            ctx.trace = self.tracing.start(ctx.headers, stream_traceparent)
            if ctx.trace is not None:
                ctx.trace_times = [0, 0, 0, 0]
        return ctx

    # -- request path ------------------------------------------------------------------------------------------
    def route(
        self, ctx: RequestContext, payload: dict | None, raw: bytes | None
    ) -> RoutingDecision | Awaitable[RoutingDecision]:
        """Pick the endpoints for a request; `payload` is its parsed JSON body (None: a request without body).
        Returns the decision, or an awaitable of it while the request waits in flow control. Raises OpenAIError
        (recorded in the metrics) when the request cannot be routed."""
        try:
            body, changed = self._resolve_model(ctx, payload, raw)
            request = self._scheduling_request(ctx, payload)
            previous = self._stored_response(ctx, payload)
            if previous is not None:  # a follow-up (or a GET, DELETE): only the endpoint that stored it can answer
                known = self.responses.known(previous)
                # (a stale endpoint, its scrapes failing, may be gone: asking the pool tells)
                if known is None or not any(e.hostport == known and not e.stale for e in self.datastore.endpoints):
                    return self._find_then_admit(ctx, request, body, changed, previous, known)
                request.subset = _pinned(request.subset, known)
                self.responses.routed_known += 1
            return self._admit(ctx, request, body, changed)
        except SchedulingError as error:
            raise self._failed(ctx, _openai_error(error)) from None
        except OpenAIError as error:
            raise self._failed(ctx, error) from None

    @staticmethod
    def _stored_response(ctx: RequestContext, payload: dict | None) -> str | None:
        """The stored response a request needs: a Responses follow-up's previous_response_id, or the id in the path
        of GET or DELETE /v1/responses/{id}. A Responses answer to be stored is learnt from its first bytes."""
        kind = ctx.kind
        if kind is RESPONSES:
            if payload is None:
                return None
            if payload.get("store") is not False:
                ctx.response_head = b""
            previous = payload.get("previous_response_id")
            return previous if isinstance(previous, str) and previous.startswith(RESPONSE_ID_PREFIX) else None
        if kind is not None:  # (another generation API's path: not a stored response's)
            return None
        path = ctx.headers.get(":path", "").partition("?")[0]
        if path.startswith(STORED_RESPONSE_PATH):
            return path[len(RESPONSES_PATH) + 1 :].partition("/")[0]
        return None

    async def _find_then_admit(self, ctx, request, body, changed, previous: str, known: str | None) -> RoutingDecision:
        """A follow-up whose stored response this replica has not seen (or whose endpoint left): ask the pool."""
        subset = request.subset
        hostports = [e.hostport for e in self.datastore.endpoints if subset is None or e.hostport in subset]
        found = await self.responses.find(previous, hostports, agent_identity(ctx.headers))
        if found is None:
            raise self._failed(ctx, gone(previous, known))
        request.subset = _pinned(subset, found)
        try:
            decision = self._admit(ctx, request, body, changed)
        except SchedulingError as error:
            raise self._failed(ctx, _openai_error(error)) from None
        except OpenAIError as error:
            raise self._failed(ctx, error) from None
        return decision if isinstance(decision, RoutingDecision) else await decision

    def _admit(self, ctx: RequestContext, request, body, changed) -> RoutingDecision | Awaitable[RoutingDecision]:
        """Admission (flow control), then scheduling."""
        if request.subset is not None and not request.subset:
            raise OpenAIError("the subset hint allows no endpoint", 503)
        endpoints = self.datastore.endpoints
        flow_control = self.flow_control
        if flow_control is None:
            self.scheduler.admit(request, endpoints)
        elif not endpoints:
            raise OpenAIError("no ready endpoint", 503)  # waiting would not make one
        elif flow_control.try_dispatch(request.priority, request.fairness_id or DEFAULT_FLOW):
            ctx.dispatched = True
        else:
            return self._wait_for_turn(ctx, request, body, changed)
        return self._schedule(ctx, request, body, changed)

    async def _wait_for_turn(self, ctx, request, body, changed) -> RoutingDecision:
        flow_control = self.flow_control
        if ctx.trace_times is not None:
            ctx.trace_times[0] = time_ns()
        try:
            await flow_control.wait(
                request.priority,
                request.fairness_id or DEFAULT_FLOW,
                len(body or b""),
                request.prompt_tokens_estimate,
                flow_control.config.request_ttl(request.objective),
            )
        except FlowControlRejected as rejected:
            if not self.datastore.endpoints:  # the pool emptied while it waited: no retry would be served sooner
                raise self._failed(ctx, OpenAIError("no ready endpoint", 503)) from None
            reason = DROPPED_TTL_EXPIRED if rejected.outcome == EVICTED_TTL else DROPPED_SATURATED
            raise self._failed(ctx, OpenAIError(str(rejected), 429, retry_after=1, dropped_reason=reason)) from None
        if ctx.trace_times is not None:
            ctx.trace_times[1] = time_ns()
        ctx.dispatched = True
        try:
            decision = self._schedule(ctx, request, body, changed, waited=True)
        except SchedulingError as error:
            raise self._failed(ctx, _openai_error(error)) from None
        return decision if isinstance(decision, RoutingDecision) else await decision

    async def _schedule_prepared(
        self, ctx, request, body, changed, prepared, waited: bool, turn=None
    ) -> RoutingDecision:
        cycle_state = prepared if isinstance(prepared, CycleState) else await prepared
        if turn is None and self.turn is not None:
            turn = self.turn()
        if turn is not None:
            started = perf_counter()
            await turn  # directly: the pick must be made in the loop pass that grants the turn
            self.metrics.turn_wait.labels().observe(perf_counter() - started)
        try:
            return self._decide(ctx, request, body, changed, cycle_state, waited)
        except SchedulingError as error:
            raise self._failed(ctx, _openai_error(error)) from None

    @property
    def longest_wait(self) -> float | None:
        """The longest a request may wait in flow control (the proxy must wait as long for its answer)."""
        return None if self.flow_control is None else self.flow_control.longest_ttl

    @cython.ccall
    def _failed(self, ctx: RequestContext, error: OpenAIError) -> OpenAIError:
        error.style = ctx.error_style
        if ctx.dispatched:  # its turn in flow control is over
            ctx.dispatched = False
            self.flow_control.complete()
        self.record_error(ctx, error)
        return error

    @cython.ccall
    def record_error(self, ctx: RequestContext, error: OpenAIError) -> None:
        self.metrics.errors.labels(*ctx.labels, str(error.status)).inc()
        if ctx.trace is not None:
            self.tracing.failed(ctx.trace, error.status, str(error))

    @cython.ccall
    def _resolve_model(self, ctx: RequestContext, payload: dict | None, raw: bytes | None) -> tuple[bytes | None, bool]:
        if payload is None:
            return None, False
        model = payload.get("model")
        if not isinstance(model, str) or not model:
            raise OpenAIError("`model` is required and must be a non-empty string", param="model")
        state = self.datastore.state
        if state.models is not None and model not in state.models:
            raise model_not_found(model)
        target = ctx.headers.get(MODEL_NAME_REWRITE_HEADER)
        if target and state.models is not None and target not in state.models and not _rewrite_target(target, state):
            # the gateway strips clients' copies of this header; whoever set it may not widen the pool's allowlist
            raise model_not_found(target)
        target = target or _rewrite(model, state.rewrites)
        ctx.model, ctx.target_model = model, target or model
        ctx.streamed = payload.get("stream") is True
        if state is not self._labelled_state:
            self._labelled_state = state
            self.metrics.model_names.pinned = pinned_model_names(state)
        label = self.metrics.model_names
        model_label = label(model)
        ctx.labels = (model_label, label(target) if target and target != model else model_label, *ctx.labels[2:])
        if target and target != model:
            payload["model"] = target
            return json.dumps(payload, separators=(",", ":")).encode(), True
        return raw, False

    @cython.ccall
    def _scheduling_request(self, ctx: RequestContext, payload: dict | None) -> SchedulingRequest:
        headers = ctx.headers
        objective = headers.get(OBJECTIVE_HEADER)
        prompt = prompt_text(payload, ctx.kind) if payload is not None else ""
        request_id = headers.get(REQUEST_ID_HEADER)
        if not request_id or len(request_id) > MAX_REQUEST_ID_CHARS:
            request_id = str(uuid.uuid4())
        priority = self.datastore.priority(objective)
        # an agent's turns share one flow (llm-d's agent-identity) when the client names no fairness id
        fairness_id = headers.get(FAIRNESS_ID_HEADER) or agent_identity(headers)
        labels = ctx.labels
        ctx.labels = (labels[0], labels[1], self.metrics.fairness_label(fairness_id or DEFAULT_FLOW), str(priority))
        return SchedulingRequest(
            request_id=request_id,
            model=ctx.target_model,
            prompt=prompt,
            prompt_tokens_estimate=len(prompt) // 4,
            priority=priority,
            objective=objective,
            fairness_id=fairness_id,
            max_tokens=_max_tokens(payload),
            streamed=ctx.streamed,
            payload=payload,
            kind=ctx.kind,
            headers=headers,
            subset=ctx.subset,
        )

    @cython.ccall
    def _schedule(
        self, ctx, request, body, body_changed, waited: bool = False
    ) -> RoutingDecision | Awaitable[RoutingDecision]:
        """The decision, or an awaitable of it while a PrepareData plugin works in a worker thread (tokenizing a
        long prompt) or this replica waits for its turn to pick (`turn`). A request that `waited` in flow control for
        its turn (a slot freed) goes to an endpoint that can start it now, not into a full one's queue."""
        prepared = self.scheduler.prepare(request)
        if isinstance(prepared, CycleState):
            turn = self.turn() if self.turn is not None else None
            if turn is None:
                return self._decide(ctx, request, body, body_changed, prepared, waited)
            return self._schedule_prepared(ctx, request, body, body_changed, prepared, waited, turn)
        return self._schedule_prepared(ctx, request, body, body_changed, prepared, waited)

    def _decide(
        self, ctx: RequestContext, request, body, body_changed, cycle_state: CycleState, waited: bool
    ) -> RoutingDecision:
        metrics = self.metrics
        started = perf_counter()
        times = ctx.trace_times
        if times is not None:
            times[2] = time_ns()
        if self.prefilling:
            self._release_prefilled(monotonic())
        endpoints = self.datastore.endpoints
        if waited:
            roomy = self.scheduler.detector.with_room(endpoints)
            subset = request.subset
            # (a follow-up pinned to its stored response's endpoint goes there, room or not: nowhere else answers it)
            if subset is None or any(e.hostport in subset for e in roomy):
                endpoints = roomy
        result = self.scheduler.schedule(request, endpoints, cycle_state)
        self.scheduler.on_picked(request, result)
        ctx.scheduling_seconds = perf_counter() - started  # observed once the proxy has its answer
        ctx.request, ctx.result = request, result
        endpoint = ctx.endpoint = result.primary
        endpoint.in_flight_requests += 1
        endpoint.in_flight_tokens += request.prompt_tokens_estimate
        ctx.in_flight_tokens = request.prompt_tokens_estimate
        endpoint.routed_total += 1
        if self.load_changed is not None:
            self.load_changed()
        ctx.routed_at = monotonic()
        picked_metrics = endpoint.metrics
        if picked_metrics is not None and picked_metrics.scraped_at > 0:  # (0: metrics no scrape made)
            ctx.metrics_age = ctx.routed_at - picked_metrics.scraped_at
        if endpoint.recent_ttft and not self.response_headers_seen:
            heappush(self.prefilling, (ctx.routed_at + endpoint.recent_ttft, next(self._order), ctx))
        metrics.requests.labels(*ctx.labels).inc()
        metrics.running.labels(*ctx.labels).inc()
        scores = traceparent = None
        if self.emit_endpoint_scores:
            scores = {e.spec.hostport: total for e, total in zip(result.candidates, result.totals, strict=True)}
        if times is not None:
            times[3] = time_ns()
            traceparent = ctx.trace.traceparent
        return RoutingDecision(request.request_id, result.endpoints, body, body_changed, scores, traceparent)

    @cython.ccall
    def _observe_decision(self, ctx: RequestContext) -> None:
        """The decision's histograms (its time, each plugin's, the prompt's size, how old the metrics it picked on
        were), once per routed request."""
        seconds = ctx.scheduling_seconds
        if not seconds:
            return  # observed already (or never decided)
        ctx.scheduling_seconds = 0.0
        times = ctx.trace_times
        if times is not None:  # the decision's spans
            ctx.trace_times = None
            queued = (times[0], times[1]) if times[1] else None
            self.tracing.decided(ctx.trace, ctx.request, ctx.result, queued, (times[2], times[3]))
        metrics = self.metrics
        metrics.scheduler_e2e.labels().observe(seconds)
        if ctx.metrics_age >= 0:
            metrics.picked_metrics_age.labels().observe(ctx.metrics_age)
        durations = metrics.plugin_durations
        for name, plugin_seconds in ctx.result.timings:
            series = durations.get(name)
            if series is None:
                series = durations[name] = metrics.plugin_duration.labels("scheduler", name.type, name.name)
            series.observe(plugin_seconds)
        if ctx.model:  # (a request with a body)
            metrics.input_tokens.labels(*ctx.labels).observe(ctx.request.prompt_tokens_estimate)

    @cython.ccall
    def after_routed(self, ctx: RequestContext) -> None:
        """The proxy has its answer: what it need not have waited for. The scheduler's at-pick hooks (unless a later
        decision ran them first), the decision's histograms, then the other pre-request hooks (the prefix index)."""
        self.scheduler.record_picks()
        self._observe_decision(ctx)
        request = ctx.request
        if ctx.response_head is not None and ctx.endpoint is not None:  # an answer to be stored: its session's hint
            session = agent_identity(ctx.headers)
            if session is not None:
                self.responses.routed(session, ctx.endpoint.hostport)
        if request is not None and request.prompt and ctx.endpoint is not None:
            self.scheduler.on_routed(request, ctx.result)
            request.prompt = ""  # recorded once
            request.payload = None

    # -- response path -----------------------------------------------------------------------------------------
    @cython.ccall
    def on_response_headers(self, ctx: RequestContext, status: str, served: str | None) -> None:
        ctx.status, ctx.served = status, served
        self.response_headers_seen = True
        self._release_prompt_tokens(ctx)
        if self.load_changed is not None:
            self.load_changed()

    @cython.ccall
    def _release_prefilled(self, now: float) -> None:
        """Without response headers the EPP does not see an endpoint answer: a request's prompt stops counting as
        pending there once the endpoint's recent TTFT has passed since it was routed (or at its end, if sooner; or
        at its end when the endpoint has no TTFT yet). Counted to the end, every endpoint looked as loaded as the
        requests decoding there, and the load scorers outvoted LoRA affinity: multi-lora at 16/s, TTFT mean / p90
        70 / 123-125 ms against 63-64 / 109 with the response headers (2 runs each). Only scheduling reads the
        counts, so they are brought up to date when a cycle starts, not by a timer per request."""
        due = self.prefilling
        while due and due[0][0] <= now:
            self._release_prompt_tokens(heappop(due)[2])

    def release_prefilled(self) -> float:
        """Release the prompts whose pick's recent TTFT has passed (`_release_prefilled`) now; when the next one is
        due (monotonic seconds; 0: none waits). Peer replicas read this EPP's pending prefill between its own
        decisions (epp.replicas), so each is released when due, not at the next decision."""
        due = self.prefilling
        if due:
            self._release_prefilled(monotonic())
        return due[0][0] if due else 0.0

    @staticmethod
    def _release_prompt_tokens(ctx: RequestContext) -> None:
        """The endpoint has answered (the response headers came, or its recent TTFT passed), or the request is over:
        its prompt is no longer work waiting there. in_flight_tokens stands for pending prefill (in-flight-tokens-
        scorer, the predictor's feature). Counting it to the response's end lost a conversation its own server
        (shared-prefix-multi-turn at 16/s, before the predictor: mean TTFT 56-87 ms and prefix hits 81-87 % against
        52-54 ms and 89-90 %)."""
        if ctx.endpoint is not None and ctx.in_flight_tokens:
            ctx.endpoint.in_flight_tokens -= ctx.in_flight_tokens
            ctx.in_flight_tokens = 0

    @cython.ccall
    def rewrites_response(self, ctx: RequestContext) -> bool:
        """A rewritten model's name goes back to the client's name in the response (its length then changes)."""
        return bool(ctx.target_model) and ctx.target_model != ctx.model

    def on_response_chunk(self, ctx: RequestContext, chunk: bytes, rewrite: bool) -> bytes:
        """Keep the tail (the usage is at the end); with `rewrite`, the chunk with the client's model name."""
        if chunk:
            if ctx.response_head is not None:
                self._learn_response_id(ctx, chunk)
            if not ctx.first_chunk_at:
                ctx.first_chunk_at = monotonic()
            ctx.response_tail = (ctx.response_tail + chunk)[-_USAGE_TAIL_BYTES:]
            if rewrite and self.rewrites_response(ctx):
                pattern = re.compile(rb'("model"\s*:\s*)' + re.escape(json.dumps(ctx.target_model).encode()))
                chunk = pattern.sub(lambda m: m.group(1) + json.dumps(ctx.model).encode(), chunk)
        return chunk

    def _learn_response_id(self, ctx: RequestContext, chunk: bytes) -> None:
        """A stored Responses answer names its id in its first bytes: its follow-ups go where it was served."""
        head = ctx.response_head + chunk
        where = ctx.served or (ctx.endpoint.hostport if ctx.endpoint is not None else None)
        if where is None or self.responses.learn_from_body(head, where) or len(head) >= HEAD_BYTES:
            ctx.response_head = None
        else:
            ctx.response_head = head

    @cython.ccall
    def on_complete(self, ctx: RequestContext) -> None:
        """The request is over, whether or not its response came through the EPP. What the proxy has not told yet
        (its status and the endpoint that served, when it sent no response headers; a streamed response's TTFT)
        comes with its access-log record, if the proxy sends them: the request then waits for it in
        `awaiting_records`, and its outcome (status metrics, timings) is settled when it comes."""
        endpoint = ctx.endpoint
        request = ctx.request
        self._observe_decision(ctx)  # (when it ended before its answer was out: after_routed did not run)
        if ctx.trace is not None:
            self.tracing.finished(ctx.trace, ctx.status)
            ctx.trace = None
        if endpoint is not None:  # first: flow control's next dispatch sees the slot this request frees
            self._release_prompt_tokens(ctx)
            ctx.endpoint = None
            endpoint.in_flight_requests -= 1
            if self.load_changed is not None:
                self.load_changed()
        if ctx.dispatched:
            ctx.dispatched = False
            self.flow_control.complete()
        if endpoint is None:
            return
        now = monotonic()
        tail = ctx.response_tail
        output_tokens = _usage(_COMPLETION_TOKENS, tail)
        response = ResponseInfo(
            ctx.status,
            output_tokens=output_tokens,
            prompt_tokens=_usage(_PROMPT_TOKENS, tail),
            cached_tokens=_usage(_CACHED_TOKENS, tail),
        )
        self.scheduler.on_finished(request, ctx.result, endpoint, response)
        timed = ctx.streamed and self.scheduler.wants_timings  # a streamed response's timings are learnt
        if not timed:  # from here on only timings read the result
            ctx.result = None  # (most of what a request awaiting its access-log record would hold, for ~0.1 s)
        metrics = self.metrics
        metrics.running.labels(*ctx.labels).dec()
        status = ctx.status
        wants_timings = timed and status.startswith("2")
        if ctx.first_chunk_at and ctx.streamed and status.startswith("2"):  # the body came through: its timings
            ttft = ctx.first_chunk_at - ctx.routed_at
            endpoint.observe_ttft(ttft)
            if timed:
                tpot = (now - ctx.first_chunk_at) / (output_tokens - 1) if output_tokens and output_tokens > 1 else None
                self._timed(request, ctx.result, endpoint, ttft, tpot)
        elif not status or (wants_timings and self.access_log_seen):
            early = self.early_records.pop(request.request_id, None)
            if early is None:
                # until the proxy's first record (its first flush after the first request ends) no status is known
                # to come that way: a few wait for it, so that a fresh EPP counts its first requests too
                limit = AWAITING_RECORDS_LIMIT if self.access_log_seen else UNCONFIRMED_AWAITING_LIMIT
                _remember(
                    self.awaiting_records,
                    request.request_id,
                    (now, ctx, endpoint, output_tokens),
                    AWAITING_RECORDS_SECONDS,
                    limit,
                )
            else:
                _, ttft, record_status, served = early
                self._settle(ctx, endpoint, now, output_tokens, ttft, record_status, served)
            return
        self._settle(ctx, endpoint, now, output_tokens, None, "", None)

    @cython.ccall
    def _settle(
        self,
        ctx: RequestContext,
        endpoint: Endpoint,
        ended: float,
        output_tokens: int | None,
        ttft: float | None,
        status: str,
        served: str | None,
    ) -> None:
        """An ended request's outcome: the status and served endpoint (the response headers', else the access-log
        record's), the record's TTFT (with the endpoint's inter-token latency over its decode) for a streamed
        response whose body did not come through, and the metrics that depend on them."""
        status, served = ctx.status or status, ctx.served or served
        request, result = ctx.request, ctx.result
        wants_timings = self.scheduler.wants_timings
        if status.startswith("2") and not ctx.first_chunk_at:
            if ctx.streamed and ttft is not None:
                endpoint.observe_ttft(ttft)
                if wants_timings:
                    tpot = endpoint.inter_token_latency(ctx.routed_at + ttft, ended)
                    self._timed(request, result, endpoint, ttft, tpot)
            elif wants_timings and self.untimed_responses >= 0:
                self._untimed(ended)
        metrics = self.metrics
        if status.startswith("2"):
            metrics.duration.labels(*ctx.labels).observe(ended - ctx.routed_at)
        elif status:
            metrics.errors.labels(*ctx.labels, status[:3]).inc()
        if output_tokens is not None:
            metrics.output_tokens.labels(*ctx.labels).observe(output_tokens)
        if served:
            picked = served == endpoint.hostport
            metrics.served.labels("pick" if picked else "other").inc()
            if not picked:
                log.debug("request %s was served by %s, not the pick %s", request.request_id, served, endpoint.hostport)

    # -- outcomes from the proxy's access log -------------------------------------------------------------------
    @cython.ccall
    def on_access_log(self, request_id: str, ttft: float | None, status: str, served: str | None) -> None:
        """The proxy's access-log record of an ended request: `ttft` seconds from sending it to the model server
        to the first byte of the response body (the first token of a streamed response; None when no body came),
        its status ("" when the record has none) and the endpoint that served it. Its time per output token is the
        endpoint's own mean gap between tokens from then to the request's end (`Endpoint.inter_token_latency`, None
        when the engine publishes no such histogram or the decode was too short to see in its scrapes). A record
        that comes before the EPP saw its request end waits for it in `early_records`; with peer replicas, it goes
        to them too (`forward_record`): it may be one of theirs."""
        if not self.match_record(request_id, ttft, status, served) and self.forward_record is not None:
            self.forward_record(request_id, ttft, status, served)

    @cython.ccall
    def match_record(self, request_id: str, ttft: float | None, status: str, served: str | None) -> bool:
        """An access-log record, from the proxy or forwarded by a peer replica (`on_access_log`); whether it settled
        a request this EPP saw end."""
        self.access_log_seen = True
        entry = self.awaiting_records.pop(request_id, None)
        if entry is not None:
            ended, ctx, endpoint, output_tokens = entry
            self._settle(ctx, endpoint, ended, output_tokens, ttft, status, served)
            return True
        _remember(
            self.early_records,
            request_id,
            (monotonic(), ttft, status, served),
            EARLY_RECORDS_SECONDS,
            AWAITING_RECORDS_LIMIT,
        )
        return False

    @cython.ccall
    def _timed(self, request, result, endpoint, ttft: float, tpot: float | None) -> None:
        self.untimed_responses = -1
        self.scheduler.on_timed(request, result, endpoint, ttft, tpot)

    @cython.ccall
    def _untimed(self, now: float) -> None:
        self.untimed_responses += 1
        if self.untimed_responses == 1:
            self.untimed_since = now
        elif (
            self.untimed_responses >= UNTIMED_RESPONSES_WARNING and now - self.untimed_since >= UNTIMED_WARNING_SECONDS
        ):
            log.warning(
                "%d successful responses in %.0f s and no timings of any: the latency predictor learns only from "
                "streamed responses whose timings reach the EPP (the gateway's OpenTelemetry access log sent to the "
                "EPP, or Envoy ext_proc response_body_mode FULL_DUPLEX_STREAMED) and abstains until then",
                self.untimed_responses,
                now - self.untimed_since,
            )
            self.untimed_responses = -1


def _remember(table: dict[str, tuple], request_id: str, entry: tuple, seconds: float, limit: int) -> None:
    """Keep `entry` (its first item the time it came) under `request_id` in a table bounded in size (`limit`) and
    age (`seconds`); an id that comes twice is dropped: what it names is ambiguous."""
    if request_id in table:
        del table[request_id]
        return
    table[request_id] = entry
    oldest = next(iter(table))  # insertion order is age order
    if len(table) > limit or table[oldest][0] < entry[0] - seconds:
        del table[oldest]  # one out per one in: the table never passes its limit (which only ever grows)


def _usage(pattern: re.Pattern[bytes], tail: bytes) -> int | None:
    match = pattern.search(tail) if tail else None
    return int(match.group(1)) if match else None


def _max_tokens(payload: dict | None) -> int | None:
    if payload is None:
        return None
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):  # the first of them the body names
        if key in payload:
            value = payload[key]
            return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
    return None


def pinned_model_names(state: PoolState) -> frozenset[str]:
    """The model names that are always their own metric label: those the pool declares and its rewrite rules name
    (llm-d pins its InferenceModelRewrite rules' names the same way)."""
    names = set(state.models or ())
    for rule in state.rewrites:
        names.add(rule.model)
        names.update(target for target, _ in rule.targets)
    return frozenset(names)


def _pinned(subset: frozenset[str] | None, hostport: str) -> frozenset[str]:
    """Only `hostport`, if the proxy's subset hint allows it."""
    return frozenset((hostport,)) if subset is None or hostport in subset else frozenset()


def _openai_error(error: SchedulingError) -> OpenAIError:
    return OpenAIError(str(error), error.status, retry_after=1 if error.status == 429 else None)


def _rewrite_target(name: str, state: PoolState) -> bool:
    return any(name == target for rule in state.rewrites for target, _ in rule.targets)


def _rewrite(model: str, rewrites: tuple[ModelRewrite, ...]) -> str | None:
    for rule in rewrites:  # in order; "*" (an InferenceModelRewrite rule without matches) takes any model
        if rule.model in (model, "*") and rule.targets:
            names, weights = zip(*rule.targets, strict=True)
            return random.choices(names, weights)[0]
    return None
