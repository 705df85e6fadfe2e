"""The ext_proc server: Envoy streams each HTTP request's headers and body here; the EPP answers with the endpoint
that should serve it (Endpoint Picker Protocol, names in `protocol.extproc`).

Body modes:
* FULL_DUPLEX_STREAMED (what our Envoy config uses): body chunks accumulate; the headers response is held until
  the body ends, then sent with the destination header, a recomputed Content-Length, clear_route_cache and
  dynamic metadata, followed by the body in chunks of at most 62,000 bytes.
* BUFFERED (and any Envoy that does not announce its mode): headers are answered at once; the body response
  carries the header mutation.
The JSON body is re-serialized only when the EPP changes it (a model rewrite). A request's completion (in-flight
accounting, scheduler hooks, metrics) is known when its ext_proc stream ends.
"""

from __future__ import annotations

import json
import logging
import random
import re
import time
import uuid

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from epp.datalayer.datastore import Datastore
from epp.datalayer.endpoint import Endpoint, ModelRewrite, PoolState
from epp.metrics import EPPMetrics
from epp.scheduling.errors import SchedulingError
from epp.scheduling.scheduler import Scheduler
from epp.scheduling.types import SchedulingRequest, SchedulingResult
from protocol import extproc
from protocol.openai import OpenAIError, load_json_body, model_not_found, prompt_text

log = logging.getLogger("epp.server")

FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
CONTINUE_AND_REPLACE = pb.CommonResponse.CONTINUE_AND_REPLACE
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_USAGE_TAIL_BYTES = 4096
EXT_PROC_ATTRIBUTES = "envoy.filters.http.ext_proc"  # the key Envoy files CEL attributes under


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()), append_action=OVERWRITE
    )


def immediate_response(error: OpenAIError) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=error.status),
            headers=pb.HeaderMutation(set_headers=[_header("content-type", "application/json")]),
            body=error.to_json(),
            details=error.message[:200],
        )
    )


def subset_hint(request: pb.ProcessingRequest) -> frozenset[str] | None:
    """The proxy's allowed endpoints, from metadata_context; None when there is no hint."""
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


def served_endpoint(request: pb.ProcessingRequest) -> str | None:
    """The endpoint that served the request: the gateway's metadata (protocol), else Envoy's upstream.address
    attribute (what our Envoy bootstrap sends)."""
    namespace = request.metadata_context.filter_metadata.get(extproc.SERVED_ENDPOINT_NAMESPACE)
    value = namespace.fields.get(extproc.SERVED_ENDPOINT_KEY) if namespace is not None else None
    if value is not None and value.string_value:
        return value.string_value
    attributes = request.attributes.get(EXT_PROC_ATTRIBUTES)
    value = attributes.fields.get("upstream.address") if attributes is not None else None
    return value.string_value if value is not None and value.string_value else None


DEFAULT_MAX_BODY_BYTES = 32 << 20  # like the model servers' request size limit


class BodyBudget:
    """Body bytes the requests of one ext_proc connection may hold at once (their bodies are buffered until they
    end): a request whose chunk would go over it is answered 413, the others go on."""

    __slots__ = ("held", "limit")

    def __init__(self, limit: int):
        self.limit = limit
        self.held = 0

    def reserve(self, size: int) -> bool:
        if self.held + size > self.limit:
            return False
        self.held += size
        return True

    def release(self, size: int) -> None:
        self.held -= size


class EndpointPicker:
    """Everything one EPP needs per request: the live pool, the scheduler, the metrics and the request limits."""

    def __init__(
        self,
        datastore: Datastore,
        scheduler: Scheduler,
        metrics: EPPMetrics,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ):
        self.datastore = datastore
        self.scheduler = scheduler
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes


class RequestStream:
    """The state machine of one ext_proc stream (one HTTP request)."""

    __slots__ = (
        "body_bytes", "body_chunks", "body_done", "budget", "endpoint", "full_duplex", "headers", "labels", "model", "picker", "request",
        "response_full_duplex", "response_tail", "result", "routed_at", "served", "status", "subset", "target_model",
    )  # fmt: skip

    def __init__(self, picker: EndpointPicker, budget: BodyBudget | None = None):
        self.picker = picker
        self.budget = budget
        self.headers: dict[str, str] = {}
        self.body_chunks: list[bytes] = []
        self.body_bytes = 0  # buffered now (reserved from the connection's budget)
        self.body_done = False
        self.full_duplex = False
        self.response_full_duplex = False
        self.subset: frozenset[str] | None = None
        self.request: SchedulingRequest | None = None
        self.result: SchedulingResult | None = None
        self.endpoint: Endpoint | None = None
        self.routed_at = 0.0
        self.model = self.target_model = ""
        self.labels = ("", "")  # the metrics' model and target model labels (bounded: EPPMetrics.model_label)
        self.served: str | None = None
        self.status = ""
        self.response_tail = b""

    # -- dispatch ----------------------------------------------------------------------------------------------
    def handle(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        kind = message.WhichOneof("request")
        if kind == "request_body":
            return self._on_request_body(message.request_body)
        if kind == "request_headers":
            return self._on_request_headers(message)
        if kind == "response_headers":
            return self._on_response_headers(message)
        if kind == "response_body":
            return self._on_response_body(message.response_body)
        if kind == "request_trailers":
            out = [] if self.body_done else self._on_request_body(pb.HttpBody(end_of_stream=True))
            return [*out, pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]
        if kind == "response_trailers":
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        return []

    # -- request path ------------------------------------------------------------------------------------------
    def _on_request_headers(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        self.picker.datastore.note_request()
        headers = self.headers
        for h in message.request_headers.headers.headers:
            headers[h.key.lower()] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
        self.subset = subset_hint(message)  # the proxy attaches its metadata to the headers message
        if message.HasField("protocol_config"):
            self.full_duplex = message.protocol_config.request_body_mode == FULL_DUPLEX
            self.response_full_duplex = message.protocol_config.response_body_mode == FULL_DUPLEX
        if message.request_headers.end_of_stream:  # no body (GET, ...): route now
            self.body_done = True
            return [self._route(None, b"", headers_phase=True)]
        if self.full_duplex:
            return []  # answer the headers once the body is complete
        return [pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=pb.CommonResponse()))]

    def _on_request_body(self, body: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if self.body_done:
            return []  # answered already (413): the rest of the body is dropped
        chunk = body.body
        if chunk:
            size = len(chunk)
            limit = self.picker.max_body_bytes
            if self.body_bytes + size > limit:
                return self._refuse_body(OpenAIError(f"request body is larger than {limit} bytes", 413))
            if self.budget is not None and not self.budget.reserve(size):
                return self._refuse_body(
                    OpenAIError("the gateway is buffering too many request bodies; retry later", 413)
                )
            self.body_bytes += size
            self.body_chunks.append(chunk)
        if not body.end_of_stream:
            return []
        self.body_done = True
        raw = self.body_chunks[0] if len(self.body_chunks) == 1 else b"".join(self.body_chunks)
        self._release_body()
        try:
            payload = load_json_body(raw)
        except OpenAIError as error:
            return [self._reject(error)]
        return self._route_body(payload, raw)

    def _release_body(self) -> None:
        self.body_chunks = []
        if self.budget is not None:
            self.budget.release(self.body_bytes)
        self.body_bytes = 0

    def _refuse_body(self, error: OpenAIError) -> list[pb.ProcessingResponse]:
        self.body_done = True
        self._release_body()
        return [self._reject(error)]

    def _route_body(self, payload: dict, raw: bytes) -> list[pb.ProcessingResponse]:
        model = payload.get("model")
        if not isinstance(model, str) or not model:
            return [self._reject(OpenAIError("`model` is required and must be a non-empty string", param="model"))]
        state = self.picker.datastore.state
        if state.models is not None and model not in state.models:
            return [self._reject(model_not_found(model))]
        target = self.headers.get(extproc.MODEL_NAME_REWRITE_HEADER)
        if target and state.models is not None and target not in state.models and not _rewrite_target(target, state):
            # the gateway strips clients' copies of this header; whoever set it may not widen the pool's allowlist
            return [self._reject(model_not_found(target))]
        target = target or _rewrite(model, state.rewrites)
        self.model, self.target_model = model, target or model
        label = self.picker.metrics.model_label
        self.labels = (label(model, state.models), label(self.target_model, state.models))
        if target and target != model:
            payload["model"] = target
            raw = json.dumps(payload, separators=(",", ":")).encode()
        response = self._route(payload, raw, headers_phase=self.full_duplex)
        if response.HasField("immediate_response") or not self.full_duplex:
            return [response]
        size = extproc.MAX_BODY_CHUNK_BYTES
        chunks = [raw[i : i + size] for i in range(0, len(raw), size)] or [b""]
        last = len(chunks) - 1
        return [response] + [
            pb.ProcessingResponse(
                request_body=pb.BodyResponse(
                    response=pb.CommonResponse(
                        body_mutation=pb.BodyMutation(
                            streamed_response=pb.StreamedBodyResponse(body=chunk, end_of_stream=i == last)
                        )
                    )
                )
            )
            for i, chunk in enumerate(chunks)
        ]

    def _route(self, payload: dict | None, raw: bytes, headers_phase: bool) -> pb.ProcessingResponse:
        picker = self.picker
        headers = self.headers
        request_id = headers.get(extproc.REQUEST_ID_HEADER) or str(uuid.uuid4())
        objective = headers.get(extproc.OBJECTIVE_HEADER)
        prompt = prompt_text(payload) if payload is not None else ""
        request = SchedulingRequest(
            request_id=request_id,
            model=self.target_model,
            prompt=prompt,
            prompt_tokens_estimate=len(prompt) // 4,
            priority=picker.datastore.priority(objective),
            objective=objective,
            fairness_id=headers.get(extproc.FAIRNESS_ID_HEADER),
            headers=headers,
            subset=self.subset,
        )
        endpoints = picker.datastore.endpoints
        started = time.perf_counter()
        try:
            if request.subset is not None and not request.subset:
                raise OpenAIError("the subset hint allows no endpoint", 503)
            picker.scheduler.admit(request, endpoints)
            result = picker.scheduler.schedule(request, endpoints)
        except SchedulingError as error:
            return self._reject(OpenAIError(str(error), error.status))
        except OpenAIError as error:
            return self._reject(error)
        metrics = picker.metrics
        metrics.scheduler_e2e.labels().observe(time.perf_counter() - started)
        for name, seconds in result.timings:
            metrics.plugin_duration.labels("scheduler", name.type, name.name).observe(seconds)
        self.request, self.result = request, result
        endpoint = self.endpoint = result.primary
        endpoint.in_flight_requests += 1
        endpoint.in_flight_tokens += request.prompt_tokens_estimate
        endpoint.routed_total += 1
        self.routed_at = time.monotonic()
        metrics.requests.labels(*self.labels).inc()
        metrics.running.labels(self.labels[0]).inc()
        if payload is not None:
            metrics.input_tokens.labels(*self.labels).observe(request.prompt_tokens_estimate)
        destinations = ",".join(e.hostport for e in result.endpoints)
        set_headers = [
            # The header carries the primary only: Envoy's ORIGINAL_DST cluster reads one ip:port. The fallbacks are
            # in the metadata's comma list (the protocol) and, for our Envoy bootstrap's retries, one per header.
            _header(extproc.DESTINATION_ENDPOINT_HEADER, endpoint.hostport),
            _header(extproc.REQUEST_ID_HEADER, request_id),
        ]
        fallbacks = result.endpoints[1:]
        if fallbacks:
            for i, name in enumerate(extproc.FALLBACK_ENDPOINT_HEADERS):
                set_headers.append(_header(name, fallbacks[min(i, len(fallbacks) - 1)].hostport))
        if payload is not None:
            set_headers.append(_header("content-length", str(len(raw))))
        common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=set_headers), clear_route_cache=True)
        metadata = struct_pb2.Struct()
        metadata.get_or_create_struct(extproc.DESTINATION_ENDPOINT_NAMESPACE)[extproc.DESTINATION_ENDPOINT_KEY] = (
            destinations
        )
        if headers_phase:
            return pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata)
        if payload is not None and self.model != self.target_model:
            common.status = CONTINUE_AND_REPLACE
            common.body_mutation.body = raw
        return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common), dynamic_metadata=metadata)

    def _reject(self, error: OpenAIError) -> pb.ProcessingResponse:
        metrics = self.picker.metrics
        metrics.errors.labels(*self.labels, str(error.status)).inc()
        return immediate_response(error)

    # -- response path -----------------------------------------------------------------------------------------
    def _on_response_headers(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        self.served = served_endpoint(message)
        for h in message.response_headers.headers.headers:
            if h.key == ":status":
                self.status = h.raw_value.decode() if h.raw_value else h.value
                break
        common = pb.CommonResponse()
        if self._rewrites_back():  # the body will change length: let the proxy re-frame it
            common.header_mutation.remove_headers.append("content-length")
        return [pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=common))]

    def _rewrites_back(self) -> bool:
        """A rewritten model's name goes back to the client's name in responses the EPP streams back."""
        return self.response_full_duplex and bool(self.target_model) and self.target_model != self.model

    def _on_response_body(self, body: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if body.body:
            self.response_tail = (self.response_tail + body.body)[-_USAGE_TAIL_BYTES:]
        if not self.response_full_duplex:
            return [pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse()))]
        chunk = body.body
        if chunk and self._rewrites_back():
            pattern = re.compile(rb'("model"\s*:\s*)' + re.escape(json.dumps(self.target_model).encode()))
            chunk = pattern.sub(lambda m: m.group(1) + json.dumps(self.model).encode(), chunk)
        mutation = pb.BodyMutation(
            streamed_response=pb.StreamedBodyResponse(body=chunk, end_of_stream=body.end_of_stream)
        )
        return [
            pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse(body_mutation=mutation)))
        ]

    def after_reply(self) -> None:
        """Work the proxy need not wait for: record the pick (prefix index) once the answer is on its way."""
        if self.request is not None and self.result is not None and self.routed_at and self.request.prompt:
            self.picker.scheduler.on_routed(self.request, self.result)
            self.request.prompt = ""  # recorded once

    def finish(self) -> None:
        """The ext_proc stream ended: the request is over, whether or not its response body came through here."""
        if self.body_bytes:
            self._release_body()  # ended mid-body (reset, disconnect)
        endpoint = self.endpoint
        if endpoint is None:
            return
        self.endpoint = None
        endpoint.in_flight_requests -= 1
        endpoint.in_flight_tokens -= self.request.prompt_tokens_estimate
        picker = self.picker
        picker.scheduler.on_finished(self.request, self.result, endpoint)
        metrics = picker.metrics
        metrics.running.labels(self.labels[0]).dec()
        if self.status.startswith("2"):  # a model server knows these names: from now on they are labels of their own
            metrics.model_served(self.model)
            metrics.model_served(self.target_model)
            declared = picker.datastore.state.models
            self.labels = (metrics.model_label(self.model, declared), metrics.model_label(self.target_model, declared))
            metrics.duration.labels(*self.labels).observe(time.monotonic() - self.routed_at)
        elif self.status:
            metrics.errors.labels(*self.labels, self.status[:3]).inc()
        if self.response_tail and (match := _COMPLETION_TOKENS.search(self.response_tail)):
            metrics.output_tokens.labels(*self.labels).observe(int(match.group(1)))
        if self.served:
            picked = self.served == endpoint.hostport
            metrics.served.labels("pick" if picked else "other").inc()
            if not picked:
                log.debug("request %s was served by %s, not the pick %s", self.request.request_id, self.served,
                          endpoint.hostport)  # fmt: skip


def _rewrite_target(name: str, state: PoolState) -> bool:
    return any(name == target for rule in state.rewrites for target, _ in rule.targets)


def _rewrite(model: str, rewrites: tuple[ModelRewrite, ...]) -> str | None:
    for rule in rewrites:  # in order; "*" (an InferenceModelRewrite rule without matches) takes any model
        if rule.model in (model, "*") and rule.targets:
            names, weights = zip(*rule.targets, strict=True)
            return random.choices(names, weights)[0]
    return None


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    def __init__(self, picker: EndpointPicker):
        self.picker = picker

    async def Process(self, request_iterator, context: grpc.aio.ServicerContext):
        stream = RequestStream(self.picker)
        try:
            async for message in request_iterator:
                for response in stream.handle(message):
                    yield response
                stream.after_reply()
        finally:
            stream.finish()
