"""The ext_proc handler: Envoy streams each HTTP request's headers and body here; the EPP answers with the endpoint
that should serve it (Endpoint Picker Protocol, names in `protocol.extproc`). This module only translates: the
director (`epp.requestcontrol.director`) decides.

Body modes:
* FULL_DUPLEX_STREAMED (what our Envoy config uses): body chunks accumulate; the headers response is held until
  the body ends, then sent with the destination header, a recomputed Content-Length, clear_route_cache and
  dynamic metadata, followed by the body in chunks of at most 62,000 bytes.
* BUFFERED (and any Envoy that does not announce its mode): headers are answered at once; the body response
  carries the header mutation.
Messages come read from their wire bytes (`epp.handlers.wire.ExtProcRequest`: the headers, body, end_of_stream and
body modes; metadata and attributes through the message classes, when a message has them). The JSON body is
re-serialized only when the EPP changes it (a model rewrite). A request's completion (in-flight accounting,
scheduler hooks, metrics) is known at its response trailers or, when the server sent none, when its ext_proc stream
ends (our bootstrap's response_trailer_mode SEND keeps the stream open until the response ends). A request the
director queues (flow control) is answered through the transport's `reply` once it is routed (the interface:
`epp.handlers`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from collections.abc import Callable

import cython
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import duration_pb2
from prometheus_client.core import GaugeMetricFamily

from epp.handlers import Reply
from epp.handlers.wire import ExtProcRequest, field, key, nesting, processing_request
from epp.metrics import unlabelled
from epp.requestcontrol.director import Director, RequestContext
from epp.requestcontrol.types import RoutingDecision
from epp.wireformat import varint
from protocol import extproc, tracing
from protocol.limits import ByteBudget
from protocol.openai import OpenAIError, load_json_body

FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
CONTINUE_AND_REPLACE = pb.CommonResponse.CONTINUE_AND_REPLACE
EXT_PROC_ATTRIBUTES = "envoy.filters.http.ext_proc"  # the key Envoy files CEL attributes under

log = logging.getLogger(__name__)


# The keys of the fields the per-request answers are composed of (epp.handlers.wire), by message.
_ANSWER_TO = {phase: key(pb.ProcessingResponse, phase) for phase in ("request_headers", "request_body")}
_COMMON = key(pb.BodyResponse, "response")  # (HeadersResponse's is the same field)
_HEADER_MUTATION = key(pb.CommonResponse, "header_mutation")
_STATUS = key(pb.CommonResponse, "status")
_BODY_MUTATION = key(pb.CommonResponse, "body_mutation")
_SET_HEADER = key(pb.HeaderMutation, "set_headers")
_OPTION_HEADER = key(base_pb2.HeaderValueOption, "header")
_OVERWRITE = key(base_pb2.HeaderValueOption, "append_action") + varint(OVERWRITE)
_HEADER_KEY, _RAW_VALUE = key(base_pb2.HeaderValue, "key"), key(base_pb2.HeaderValue, "raw_value")
_WHOLE_BODY = key(pb.BodyMutation, "body")
_REPLACE = _STATUS + varint(CONTINUE_AND_REPLACE)


def _header_key(name: str) -> bytes:
    """A header's key field, for `_set_header` (the per-request ones are built once, below)."""
    return field(_HEADER_KEY, name.encode())


@cython.ccall
def _set_header(named: bytes, value: bytes) -> bytes:
    """A HeaderMutation's set_headers entry (OVERWRITE_IF_EXISTS_OR_ADD); `named` is the header's key field. The one
    header builder: the per-request answers are composed of these, and the cached and rare ones merge them in."""
    return field(_SET_HEADER, field(_OPTION_HEADER, named + field(_RAW_VALUE, value)) + _OVERWRITE)


_REQUEST_ID_KEY = _header_key(extproc.REQUEST_ID_HEADER)
_TRACEPARENT_KEY = _header_key(tracing.TRACEPARENT_HEADER)
_CONTENT_LENGTH_KEY = _header_key("content-length")
_CONTENT_TYPE_JSON = _set_header(_header_key("content-type"), b"application/json")


MAX_CACHED_ROUTING_ANSWERS = 4096  # bounds _routing_answer (pools have at most a few hundred endpoints)


def _build_routing_answer(hostports: tuple[str, ...], headers_phase: bool, scores: dict[str, float] | None) -> bytes:
    """What every answer routing to these endpoints shares, followed in each answer by the request's own fields
    (`epp.handlers.wire`): the destination header, the fallback headers, clear_route_cache and the dynamic metadata.
    The header carries the primary only: Envoy's ORIGINAL_DST cluster reads one ip:port. The fallbacks are in the
    metadata's comma list (the protocol) and, for our Envoy bootstrap's retries, one per header. `scores` ("ip:port"
    -> the candidate's weighted total) go beside the destination in the same namespace, as llm-d's router writes them
    (a struct under x-gateway-destination-endpoint-scores): one namespace entry holds both, since a second would
    replace the first when Envoy merges the answer."""
    answer = pb.ProcessingResponse()
    common = answer.request_headers.response if headers_phase else answer.request_body.response
    common.clear_route_cache = True
    set_headers = [_set_header(_header_key(extproc.DESTINATION_ENDPOINT_HEADER), hostports[0].encode())]
    # A lone pick is its own fallback: without a host in the retry's header, a reset of the pick's connection (its
    # server busy restarting a peer's streams) ends in Envoy's "no healthy upstream" 503 instead of a retry there.
    fallbacks = hostports[1:] or hostports
    for i, name in enumerate(extproc.FALLBACK_ENDPOINT_HEADERS):
        set_headers.append(_set_header(_header_key(name), fallbacks[min(i, len(fallbacks) - 1)].encode()))
    common.header_mutation.MergeFromString(b"".join(set_headers))
    namespace = answer.dynamic_metadata.get_or_create_struct(extproc.DESTINATION_ENDPOINT_NAMESPACE)
    namespace[extproc.DESTINATION_ENDPOINT_KEY] = ",".join(hostports)
    if scores is not None:
        namespace.get_or_create_struct(extproc.DESTINATION_ENDPOINT_SCORES_KEY).update(scores)
    return answer.SerializeToString()


@functools.lru_cache(maxsize=MAX_CACHED_ROUTING_ANSWERS)
def _routing_answer(hostports: tuple[str, ...], headers_phase: bool) -> bytes:
    """`_build_routing_answer` without scores, serialized once per list of endpoints."""
    return _build_routing_answer(hostports, headers_phase, None)


_STREAMED_RESPONSE_IN = {  # the fields that nest a StreamedBodyResponse in each direction's answer
    direction: (
        key(pb.ProcessingResponse, f"{direction}_body"),
        _COMMON,
        _BODY_MUTATION,
        key(pb.BodyMutation, "streamed_response"),
    )
    for direction in ("request", "response")
}
_STREAMED_BODY = key(pb.StreamedBodyResponse, "body")
_STREAMED_END = key(pb.StreamedBodyResponse, "end_of_stream") + varint(True)


@cython.ccall
def streamed_chunk(direction: str, chunk: bytes, last: bool) -> bytes:
    """The answer that sends `chunk` of the request's ("request") or the response's ("response") streamed body on
    (FULL_DUPLEX_STREAMED), `last` with end_of_stream. One per streamed token: composed from bytes it takes 0.31
    against 0.84 µs through the message classes (measured compiled, a 100-byte SSE chunk); proto3 leaves out an empty
    body and a false end_of_stream, and so does this (the same bytes as the classes', tests/epp/test_wire.py)."""
    streamed = field(_STREAMED_BODY, chunk) if chunk else b""
    if last:
        streamed += _STREAMED_END
    return nesting(_STREAMED_RESPONSE_IN[direction], len(streamed)) + streamed


# The answers that are the same for every request: serialized once.
_REQUEST_HEADERS_CONTINUE = pb.ProcessingResponse(
    request_headers=pb.HeadersResponse(response=pb.CommonResponse())
).SerializeToString()
_REQUEST_TRAILERS_ANSWER = pb.ProcessingResponse(request_trailers=pb.TrailersResponse()).SerializeToString()
_RESPONSE_HEADERS_ANSWER = pb.ProcessingResponse(
    response_headers=pb.HeadersResponse(response=pb.CommonResponse())
).SerializeToString()
_RESPONSE_HEADERS_REFRAMED = pb.ProcessingResponse(  # the body will change length: let the proxy re-frame it
    response_headers=pb.HeadersResponse(
        response=pb.CommonResponse(header_mutation=pb.HeaderMutation(remove_headers=["content-length"]))
    )
).SerializeToString()
_RESPONSE_BODY_CONTINUE = pb.ProcessingResponse(
    response_body=pb.BodyResponse(response=pb.CommonResponse())
).SerializeToString()
_RESPONSE_TRAILERS_ANSWER = pb.ProcessingResponse(response_trailers=pb.TrailersResponse()).SerializeToString()


@functools.lru_cache(maxsize=16)
def _wait_answer(seconds: int) -> bytes:
    """The answer to a request queued in flow control: wait `seconds` for its routing. One per TTL setting."""
    return pb.ProcessingResponse(override_message_timeout=duration_pb2.Duration(seconds=seconds)).SerializeToString()


_DROPPED_REASON_KEY = _header_key(extproc.DROPPED_REASON_HEADER)


def immediate_response(error: OpenAIError) -> bytes:
    """The ImmediateResponse of a request the EPP does not route: its status and OpenAI error body, retry-after when
    the error has one, and on a drop (429, 503) llm-d's dropped-reason header."""
    headers = _CONTENT_TYPE_JSON
    if error.retry_after is not None:
        headers += _set_header(_header_key("retry-after"), str(error.retry_after).encode())
    reason = error.dropped_reason or extproc.DROPPED_REASONS_BY_STATUS.get(error.status)
    if reason is not None:
        headers += _set_header(_DROPPED_REASON_KEY, reason.encode())
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=error.status),
            headers=pb.HeaderMutation.FromString(headers),
            body=error.to_json(),
            details=error.message[:200],
        )
    ).SerializeToString()


def subset_hint(message: ExtProcRequest) -> frozenset[str] | None:
    """The proxy's allowed endpoints, from metadata_context; None when there is no hint."""
    if not message.metadata:  # (most proxies send none: nothing parsed to find out)
        return None
    request = pb.ProcessingRequest.FromString(message.metadata)
    namespace = request.metadata_context.filter_metadata.get(extproc.SUBSET_HINT_NAMESPACE)
    if namespace is None or extproc.SUBSET_HINT_KEY not in namespace.fields:
        return None
    value = namespace.fields[extproc.SUBSET_HINT_KEY]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        items = [v.string_value for v in value.list_value.values]
    elif kind == "string_value":
        items = value.string_value.split(",")
    else:
        items = []
    return frozenset(s.strip() for s in items if s.strip())


def served_endpoint(message: ExtProcRequest) -> str | None:
    """The endpoint that served the request: the gateway's metadata (protocol), else Envoy's upstream.address
    attribute (what our Envoy bootstrap sends)."""
    if not message.metadata:
        return None
    request = pb.ProcessingRequest.FromString(message.metadata)
    namespace = request.metadata_context.filter_metadata.get(extproc.SERVED_ENDPOINT_NAMESPACE)
    value = namespace.fields.get(extproc.SERVED_ENDPOINT_KEY) if namespace is not None else None
    if value is not None and value.string_value:
        return value.string_value
    attributes = request.attributes.get(EXT_PROC_ATTRIBUTES)
    value = attributes.fields.get("upstream.address") if attributes is not None else None
    return value.string_value if value is not None and value.string_value else None


QUEUE_TIMEOUT_MARGIN_SECONDS = 2  # beyond the longest TTL: the 429 of an expired request reaches the proxy in time
DEFAULT_MAX_BODY_BYTES = 32 << 20  # like the model servers' request size limit
# What a request_body message holds besides its body chunk (the oneof's framing, the forwarded metadata): far less
# than this, so a message longer than the body allowance by more than this carries a body over the limit.
MESSAGE_ENVELOPE_BYTES = 1 << 20


@cython.annotation_typing(True)
@cython.cclass
class RequestStream:
    """The ext_proc state machine of one stream (one HTTP request); see `epp.handlers` for the interface."""

    director = cython.declare(object, visibility="public")
    reply = cython.declare(object, visibility="public")
    budget = cython.declare(object, visibility="public")
    max_body_bytes = cython.declare(cython.Py_ssize_t, visibility="public")
    ctx = cython.declare(object, visibility="public")
    body_chunks = cython.declare(list, visibility="public")
    body_bytes = cython.declare(cython.Py_ssize_t, visibility="public")
    body_done = cython.declare(cython.bint, visibility="public")
    full_duplex = cython.declare(cython.bint, visibility="public")
    response_full_duplex = cython.declare(cython.bint, visibility="public")
    rewrite_back = cython.declare(cython.bint, visibility="public")
    routed = cython.declare(cython.bint, visibility="public")
    pending = cython.declare(object, visibility="public")
    held = cython.declare(list, visibility="public")
    completed = cython.declare(cython.bint, visibility="public")
    traceparent = cython.declare(object, visibility="public")

    def __init__(
        self,
        director: Director,
        reply: Reply,
        budget: ByteBudget | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        traceparent: str | None = None,
    ):
        self.director = director
        self.traceparent = traceparent  # the ext_proc stream's own (the proxy's trace of the request), when traced
        self.reply = reply
        self.budget = budget
        self.max_body_bytes = max_body_bytes
        self.ctx: RequestContext | None = None
        self.body_chunks: list[bytes] = []
        self.body_bytes = 0  # buffered now (reserved from the EPP's body budget)
        self.body_done = False
        self.full_duplex = False
        self.response_full_duplex = False
        self.rewrite_back = False
        self.routed = False  # answered with a destination: after_reply hands the pick to the director's hooks
        self.pending: asyncio.Future | None = None  # a routing the director queued, answered through reply
        self.held: list[bytes] = []  # answers to later messages, sent after the deferred one
        self.completed = False

    @property
    def awaiting_reply(self) -> bool:
        return self.pending is not None

    # -- dispatch ----------------------------------------------------------------------------------------------
    def handle(self, message: ExtProcRequest | pb.ProcessingRequest) -> list[bytes]:
        """Answers to one message: as our transports read it from the wire (`wire.ExtProcRequest`), or a message
        object (another caller's), which is read the same way from its bytes."""
        if type(message) is not ExtProcRequest:
            message = processing_request(message.SerializeToString())
        if self.pending is not None:  # answers go out in order: this message's wait behind the deferred one
            self.held.extend(self._handle(message))
            return []
        return self._handle(message)

    @cython.ccall
    def _handle(self, message: ExtProcRequest) -> list[bytes]:
        kind = message.kind
        if kind == "request_body":
            return self._on_request_body(message.body, message.end_of_stream)
        if kind == "request_headers":
            return self._on_request_headers(message)
        if kind == "response_headers":
            return self._on_response_headers(message)
        if kind == "response_body":
            return self._on_response_body(message.body, message.end_of_stream)
        if kind == "request_trailers":
            out = [] if self.body_done else self._on_request_body(b"", True)
            return [*out, _REQUEST_TRAILERS_ANSWER]
        if kind == "response_trailers":  # the response is over
            self._complete()
            return [_RESPONSE_TRAILERS_ANSWER]
        return []

    # -- request path ------------------------------------------------------------------------------------------
    @cython.ccall
    def _on_request_headers(self, message: ExtProcRequest) -> list[bytes]:
        if self.ctx is not None:  # one request per stream: a second one would leave the first in flight for good
            return [self._reject(OpenAIError("request headers came twice on one ext_proc stream", 400))]
        # the proxy attaches its metadata to the headers message
        self.ctx = self.director.new_request(message.headers, subset_hint(message), self.traceparent)
        modes = message.body_modes
        if modes is not None:
            self.full_duplex = modes[0] == FULL_DUPLEX
            self.response_full_duplex = modes[1] == FULL_DUPLEX
        if message.end_of_stream:  # no body (GET, ...): route now
            self.body_done = True
            return self._route(None, None, headers_phase=True)
        if self.full_duplex:
            return []  # answer the headers once the body is complete
        return [_REQUEST_HEADERS_CONTINUE]

    def oversized(self, size: int) -> list[bytes] | None:
        """The transport asks before it buffers a message of `size` bytes: one that can only hold a body chunk
        over the limit is refused unread (Envoy may send a fast upload as one message), sparing the copies that
        parsing it would make."""
        if self.body_done or self.ctx is None:
            return None
        if size <= self.max_body_bytes - self.body_bytes + MESSAGE_ENVELOPE_BYTES:
            return None
        return self._refuse_body(self._too_large())

    def _too_large(self) -> OpenAIError:
        return OpenAIError(f"request body is larger than {self.max_body_bytes} bytes", 413)

    @cython.ccall
    def _on_request_body(self, chunk: bytes, end_of_stream: bool) -> list[bytes]:
        if self.body_done:
            return []  # answered already (413): the rest of the body is dropped
        if self.ctx is None:
            self.body_done = True
            return [self._reject(OpenAIError("a request body came before its headers on the ext_proc stream", 400))]
        if chunk:
            size = len(chunk)
            if self.body_bytes + size > self.max_body_bytes:
                return self._refuse_body(self._too_large())
            if self.budget is not None and not self.budget.reserve(size):
                return self._refuse_body(
                    OpenAIError("the gateway is buffering too many request bodies; retry later", 413)
                )
            self.body_bytes += size
            self.body_chunks.append(chunk)
        if not end_of_stream:
            return []
        self.body_done = True
        raw = self.body_chunks[0] if len(self.body_chunks) == 1 else b"".join(self.body_chunks)
        self._release_body()
        try:
            payload = load_json_body(raw)
        except OpenAIError as error:
            return [self._reject(error)]
        return self._route(payload, raw, headers_phase=self.full_duplex)

    @cython.ccall
    def _release_body(self) -> None:
        self.body_chunks = []
        if self.budget is not None:
            self.budget.release(self.body_bytes)
        self.body_bytes = 0

    @cython.ccall
    def _refuse_body(self, error: OpenAIError) -> list[bytes]:
        self.body_done = True
        self._release_body()
        return [self._reject(error)]

    @cython.ccall
    def _route(self, payload: dict | None, raw: bytes | None, headers_phase: bool) -> list[bytes]:
        try:
            decision = self.director.route(self.ctx, payload, raw)
        except OpenAIError as error:
            return [immediate_response(error)]
        if isinstance(decision, RoutingDecision):
            return self._answers(decision, headers_phase)
        # the director's wait is the task itself, so that cancelling it (the stream ended) ends the wait even before
        # it began, rather than a task around it that would drop it unstarted
        waiting = self.pending = asyncio.ensure_future(decision)
        waiting.add_done_callback(functools.partial(self._answer_later, headers_phase=headers_phase))
        # the request waits in flow control: the proxy is told to wait for the answer as long as it may take
        # (Envoy's ext_proc max_message_timeout bounds it; the template sets it above the longest TTL)
        return [_wait_answer(math.ceil(self.director.longest_wait or 0) + QUEUE_TIMEOUT_MARGIN_SECONDS)]

    def _answer_later(self, waiting: asyncio.Future[RoutingDecision], headers_phase: bool) -> None:
        if waiting is not self.pending or waiting.cancelled():
            return  # the stream ended first (finish): nobody to answer
        self.pending = None
        try:
            answers = self._answers(waiting.result(), headers_phase)
        except OpenAIError as error:
            answers = [immediate_response(error)]
        except Exception:  # a bug costs this request a 500, not an answer the proxy waits for until its timeout
            log.exception("routing a request that waited in flow control failed")
            answers = [immediate_response(OpenAIError("EPP internal error", 500))]
        answers, self.held = answers + self.held, []
        self.reply(answers)

    @cython.ccall
    def _answers(self, decision: RoutingDecision, headers_phase: bool) -> list[bytes]:
        self.routed = True
        self.rewrite_back = self.response_full_duplex and self.director.rewrites_response(self.ctx)
        body = decision.body
        set_headers = _set_header(_REQUEST_ID_KEY, decision.request_id.encode())
        if body is not None:
            set_headers += _set_header(_CONTENT_LENGTH_KEY, str(len(body)).encode())
        if decision.traceparent is not None:  # the model server continues the request's trace
            set_headers += _set_header(_TRACEPARENT_KEY, decision.traceparent.encode())
        common = [field(_HEADER_MUTATION, set_headers)]
        if not headers_phase and decision.body_changed:  # BUFFERED: the body response carries the rewritten body
            common += (_REPLACE + nesting((_BODY_MUTATION, _WHOLE_BODY), len(body)), body)
        phase = _ANSWER_TO["request_headers" if headers_phase else "request_body"]
        hostports = tuple([e.spec.hostport for e in decision.endpoints])
        if decision.scores is None:
            routing = _routing_answer(hostports, headers_phase)
        else:  # (different for each request: not cached)
            routing = _build_routing_answer(hostports, headers_phase, decision.scores)
        head = b"".join(
            (
                routing,
                nesting((phase, _COMMON), sum(map(len, common))),
                *common,
            )
        )
        if not headers_phase or body is None:
            return [head]
        size = extproc.MAX_BODY_CHUNK_BYTES
        return [head] + [
            streamed_chunk("request", body[start : start + size], start + size >= len(body))
            for start in range(0, len(body), size) or (0,)
        ]

    @cython.ccall
    def _reject(self, error: OpenAIError) -> bytes:
        if self.ctx is not None:
            error.style = self.ctx.error_style  # (a Messages request's errors are Anthropic's shape)
            self.director.record_error(self.ctx, error)
        return immediate_response(error)

    # -- response path -----------------------------------------------------------------------------------------
    @cython.ccall
    def _on_response_headers(self, message: ExtProcRequest) -> list[bytes]:
        status = message.headers.get(":status", "")
        if self.ctx is not None:
            self.director.on_response_headers(self.ctx, status, served_endpoint(message))
        return [_RESPONSE_HEADERS_REFRAMED if self.rewrite_back else _RESPONSE_HEADERS_ANSWER]

    @cython.ccall
    def _on_response_body(self, chunk: bytes, end_of_stream: bool) -> list[bytes]:
        if self.ctx is not None:
            chunk = self.director.on_response_chunk(self.ctx, chunk, self.rewrite_back)
        if not self.response_full_duplex:
            return [_RESPONSE_BODY_CONTINUE]
        return [streamed_chunk("response", chunk, end_of_stream)]  # one answer per streamed token

    def after_reply(self) -> None:
        """Work the proxy need not wait for: the director's after-routing hooks, once the answer is on its way."""
        if self.routed:
            self.routed = False
            self.director.after_routed(self.ctx)

    def finish(self) -> None:
        """The ext_proc stream ended: the request is over, whether or not its response body came through here."""
        if self.body_bytes:
            self._release_body()  # ended mid-body (reset, disconnect)
        if self.pending is not None:
            self.pending.cancel()  # still queued: the director's wait ends with the stream
            self.pending = None
        self._complete()

    @cython.ccall
    def _complete(self) -> None:
        """The director hears once that the request is over: at its response trailers or when the stream ends."""
        if self.ctx is not None and not self.completed:
            self.completed = True
            self.director.on_complete(self.ctx)


class BufferedBodyCollector:
    """The request body bytes all ext_proc streams buffer now, out of the EPP-wide body budget, read when Prometheus
    scrapes."""

    def __init__(self, budget: ByteBudget):
        self.budget = budget

    def collect(self):
        name = "inference_extension_ext_proc_buffered_body_bytes"
        doc = "Request body bytes all ext_proc streams buffer now (--max-buffered-body-bytes bounds them)."
        yield from unlabelled(GaugeMetricFamily, [(name, doc, self.budget.held)])


def stream_factory(
    director: Director, budget: ByteBudget | None, max_body_bytes: int
) -> Callable[[Reply, str | None], RequestStream]:
    """What a transport calls for each new ext_proc stream: `new_stream(reply, traceparent=None)`. Defined here, the
    release build compiles it (a closure in the wiring ran as Python, once a request)."""

    def new_stream(reply: Reply, traceparent: str | None = None) -> RequestStream:
        return RequestStream(director, reply, budget, max_body_bytes, traceparent)

    return new_stream
