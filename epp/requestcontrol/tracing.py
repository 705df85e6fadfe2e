"""The EPP's request traces (--otlp-traces-endpoint, --trace-sampling-ratio): a `gateway.request` span per request,
continuing the client's W3C traceparent, else the one Envoy's ext_proc call carried in its gRPC metadata (Envoy's
own trace of the request), else a new trace; children for flow control (the time queued) and scheduling (every
candidate, each scorer's scores in the candidates' order, each plugin's time, the totals, the pick and the
fallbacks; each plugin's time as `gateway.plugins` and `gateway.plugin_seconds`, in the order they ran). The request
sent upstream carries the request span's traceparent (a header mutation), so the model
server's spans join the trace (a gateway that traces, Envoy with its tracer on, makes its own upstream span their
parent instead: still the same trace).

Why not the OpenTelemetry SDK here (the model server uses it, as vLLM does): its spans cost the EPP more than the
request itself. Measured in process (`epp-bench handler-cpu`'s path, default profile, docs/observability.md): 160 us
of CPU per request untraced, 318 us with the SDK's spans (a request and a scheduling span with these attributes,
batch processor, OTLP exporter); a bare SDK span costs ~18 us to make and ~40 us to encode. So the spans are written
here straight into the OTLP protobuf (`ExportTraceServiceRequest`), and a thread sends them in batches to the
collector's TraceService/Export over gRPC (`OTLPExporter`), off the request path, bounded (MAX_PENDING_REQUESTS:
beyond, spans are dropped and counted).

Written so that a request's spans cost few Python operations, whatever the pool's size: what repeats is encoded
once and looked up (attribute keys, the model, the status; the candidates, and the pick with its fallbacks, per list
of endpoints; the profile and the plugins' names per layout); the scheduling span's numbers (the totals, each
scorer's scores, each plugin's seconds) are packed by one struct per layout (`_Shape`); a request's spans are
entries of ScopeSpans.spans when made, so the exporter only joins them, and go to it in one `add` at the request's
end. What the request path pays when a request is sampled: its ids and start time when its headers arrive, the
traceparent of the answer, and two clock readings around scheduling; the spans' bytes are made after the answer has
gone out (`Director.after_routed`) and at the request's end. A request that is not sampled costs a random number.
`epp-bench handler-cpu --tracing on|bare` measures it in process (docs/observability.md).
"""

from __future__ import annotations

import functools
import logging
import random
import struct
import threading
from collections import deque
from itertools import chain
from time import time_ns
from typing import Any

import grpc

from epp.datalayer.endpoint import Endpoint
from epp.scheduling.types import SchedulingRequest, SchedulingResult, TypedName
from epp.wireformat import varint
from protocol import tracing

log = logging.getLogger("epp.tracing")

EXPORT_PATH = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
EXPORT_INTERVAL_SECONDS = 0.5  # a batch leaves at least this often (the SDK's batch processor: 5 s)
EXPORT_BATCH_REQUESTS = 256  # or as soon as this many requests' spans wait (2-3 spans each)
EXPORT_TIMEOUT_SECONDS = 5.0
MAX_PENDING_REQUESTS = 4096  # requests' spans waiting for the exporter; beyond, new ones are dropped (a collector down)
MAX_SHAPES = 1024  # scheduling spans' layouts kept (a profile's scorers and plugins, its number of candidates)


# -- the OTLP protobuf, written by hand (opentelemetry/proto/trace/v1/trace.proto, common/v1/common.proto) ---------
def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: its key (field number << 3 | 2), the length, the payload."""
    return tag + varint(len(payload)) + payload


def _any(value: Any) -> bytes:
    """An AnyValue: string 1, bool 2, int 3, double 4, array 5 (of strings or doubles)."""
    if isinstance(value, str):
        return _field(b"\x0a", value.encode())
    if isinstance(value, bool):
        return b"\x10" + (b"\x01" if value else b"\x00")
    if isinstance(value, int):
        return b"\x18" + varint(value & 0xFFFFFFFFFFFFFFFF)
    if isinstance(value, float):
        return b"\x21" + _pack_d(value)
    if value and isinstance(value[0], str):
        return _field(b"\x2a", b"".join([_field(b"\x0a", _field(b"\x0a", v.encode())) for v in value]))
    return _field(b"\x2a", b"".join([_DOUBLE_ITEM + _pack_d(float(v)) for v in value]))


_pack_d = struct.Struct("<d").pack
_DOUBLE_ITEM = b"\x0a\x09\x21"  # ArrayValue.values: an AnyValue of 9 bytes holding a double (field 4)


@functools.lru_cache(maxsize=1024)
def _key(key: str) -> bytes:
    return _field(b"\x0a", key.encode())


def attribute(key: str, value: Any) -> bytes:
    """A span's attribute (Span.attributes, field 9: a KeyValue of key 1 and value 2)."""
    return _field(b"\x4a", _key(key) + _field(b"\x12", _any(value)))


# The same attribute for a value that comes back (a model, a status), encoded once
_repeated = functools.lru_cache(maxsize=4096)(attribute)
_REQUEST_ID_KEY = _key("gateway.request_id")


def _string_attribute(key_field: bytes, text: str) -> bytes:
    """A string attribute whose key's field (`_key`) is made once: the request's id, new every request."""
    value = text.encode()
    any_value = b"\x0a" + varint(len(value)) + value
    key_value = key_field + b"\x12" + varint(len(any_value)) + any_value
    return b"\x4a" + varint(len(key_value)) + key_value


@functools.lru_cache(maxsize=4096)
def _candidates(endpoints: tuple[Endpoint, ...]) -> bytes:
    """`gateway.candidates`, made once for each list of endpoints (by identity: an endpoint whose address changes is
    a new Endpoint, epp/datalayer/datastore.py)."""
    return attribute("gateway.candidates", [e.hostport for e in endpoints])


@functools.lru_cache(maxsize=4096)
def _routed(endpoints: tuple[Endpoint, ...]) -> bytes:
    """`gateway.pick` and `gateway.fallbacks`, made once for each order of the endpoints."""
    return attribute("gateway.pick", endpoints[0].hostport) + attribute(
        "gateway.fallbacks", [e.hostport for e in endpoints[1:]]
    )


def _doubles_head(key: str, count: int) -> bytes:
    """An attribute holding an array of `count` doubles, up to its items (each `_DOUBLE_ITEM` and 8 bytes)."""
    items = 11 * count
    array = 1 + len(varint(items)) + items
    key_field = _key(key)
    key_value = len(key_field) + 1 + len(varint(array)) + array
    return b"\x4a" + varint(key_value) + key_field + b"\x12" + varint(array) + b"\x2a" + varint(items)


class _Shape:
    """A scheduling span's attributes for one layout (its profile, scorers, plugins and number of candidates): the
    strings made once (`constant`: the profile, the plugins), and one struct that packs every number of a decision
    (the totals, each scorer's scores, each plugin's seconds), each number after the bytes that precede it: the
    heads of the attributes and the items' keys. A decision's numbers then take one list copy, one slice assignment
    and one pack, however many candidates and scorers (one attribute and one packing per number cost ~3 us a
    request, profiled)."""

    __slots__ = ("constant", "pack", "suffix", "template")

    def __init__(self, profile: str, scorers: tuple[TypedName, ...], totals: int, candidates: int, plugins: tuple):
        self.constant = _repeated("gateway.profile", profile) + attribute("gateway.plugins", [p.name for p in plugins])
        groups = [("gateway.totals", totals)]
        groups += [(f"gateway.scorer.{scorer.name}.scores", candidates) for scorer in scorers]
        groups.append(("gateway.plugin_seconds", len(plugins)))
        prefixes, pending = [], b""
        for key, count in groups:
            head = _doubles_head(key, count)
            if not count:  # an empty array: its head goes before the next number, or after them all
                pending += head
                continue
            prefixes.append(pending + head + _DOUBLE_ITEM)
            prefixes += [_DOUBLE_ITEM] * (count - 1)
            pending = b""
        self.suffix = pending
        self.pack = struct.Struct("<" + "".join([f"{len(p)}sd" for p in prefixes])).pack
        self.template = [item for p in prefixes for item in (p, 0.0)]


_SERVER_KIND = b"\x30\x02"  # Span.kind = SPAN_KIND_SERVER
_INTERNAL_KIND = b"\x30\x01"
_TIMES = struct.Struct("<QBQ").pack  # start_time_unix_nano (field 7, fixed64), the end's key (field 8), the end


def _name(text: str, kind: bytes) -> bytes:
    """A span's name, its kind and the key of its start time: what goes between its ids and its times."""
    return _field(b"\x2a", text.encode()) + kind + b"\x39"


REQUEST_NAME = _name(tracing.EPP_REQUEST_SPAN, _SERVER_KIND)
_FLOW_CONTROL_NAME = _name(tracing.EPP_FLOW_CONTROL_SPAN, _INTERNAL_KIND)
_SCHEDULING_NAME = _name(tracing.EPP_SCHEDULING_SPAN, _INTERNAL_KIND)


def span(trace_id: bytes, span_id: bytes, parent_id: bytes, name: bytes, start: int, end: int, rest: bytes) -> bytes:
    """A span as an entry of ScopeSpans.spans (field 2): `name` from `_name`, `rest` its attributes and status."""
    parent = b"\x22\x08" + parent_id if parent_id else b""
    message = b"".join((b"\x0a\x10", trace_id, b"\x12\x08", span_id, parent, name, _TIMES(start, 0x41, end), rest))
    return b"\x12" + varint(len(message)) + message


def export_request(spans: list[bytes], service_name: str) -> bytes:
    """An ExportTraceServiceRequest holding `spans` (entries of ScopeSpans.spans, `span`) of one service (Resource
    service.name) and one scope."""
    resource = _field(b"\x0a", _field(b"\x0a", _key("service.name") + _field(b"\x12", _any(service_name))))
    scope_spans = _field(b"\x12", _field(b"\x0a", _field(b"\x0a", b"epp")) + b"".join(spans))
    return _field(b"\x0a", resource + scope_spans)


# -- W3C trace context -------------------------------------------------------------------------------------------
def parse_traceparent(value: str | None) -> tuple[bytes, bytes, bool] | None:
    """(trace id, parent span id, sampled) of a W3C traceparent; None without one or for a malformed one."""
    if not value or len(value) < 55:
        return None
    parts = value.strip().split("-")
    if len(parts) < 4 or len(parts[0]) != 2 or parts[0] == "ff" or len(parts[1]) != 32 or len(parts[2]) != 16:
        return None
    try:
        trace_id, parent_id, flags = bytes.fromhex(parts[1]), bytes.fromhex(parts[2]), int(parts[3][:2], 16)
    except ValueError:
        return None
    if not any(trace_id) or not any(parent_id):
        return None
    return trace_id, parent_id, bool(flags & 1)


class Trace:
    """A sampled request's span while it lasts: its ids, its attributes' bytes and its children's spans."""

    __slots__ = ("attributes", "children", "error", "parent_id", "span_id", "start", "trace_id", "traceparent")

    def __init__(self, trace_id: bytes, span_id: bytes, parent_id: bytes, start: int):
        self.trace_id, self.span_id, self.parent_id, self.start = trace_id, span_id, parent_id, start
        self.traceparent = f"00-{trace_id.hex()}-{span_id.hex()}-01"  # what the upstream request carries
        self.attributes = b""
        self.children = b""  # the flow-control and scheduling spans, once decided
        self.error: str | None = None


class OTLPExporter:
    """Sends spans to an OpenTelemetry collector (OTLP/gRPC, `endpoint` "host:port" or a URL) in batches from a
    thread of its own. `add` takes a finished request's spans (`span`'s bytes, one after another), never blocking:
    beyond MAX_PENDING_REQUESTS they are dropped (counted in `dropped`)."""

    def __init__(self, endpoint: str, service_name: str = "epp"):
        self.target = endpoint.split("://", 1)[-1].rstrip("/")
        self.service_name = service_name
        self.pending: deque[bytes] = deque()
        self.dropped = 0
        self.exported = 0
        self._wake = threading.Event()
        self._stopping = False
        self._failing = False
        self._channel = grpc.insecure_channel(self.target)
        self._export = self._channel.unary_unary(EXPORT_PATH)  # bytes in, bytes out: the request is encoded here
        self._thread = threading.Thread(target=self._run, name="otlp-exporter", daemon=True)
        self._thread.start()

    def add(self, spans: bytes) -> None:
        pending = self.pending
        if len(pending) >= MAX_PENDING_REQUESTS:
            self.dropped += 1
            return
        pending.append(spans)
        if len(pending) == EXPORT_BATCH_REQUESTS:
            self._wake.set()

    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait(EXPORT_INTERVAL_SECONDS)
            self._wake.clear()
            self._send_pending()
        self._send_pending()

    def _send_pending(self) -> None:
        pending = self.pending
        while pending:
            batch = [pending.popleft() for _ in range(min(len(pending), EXPORT_BATCH_REQUESTS))]
            try:
                self._export(export_request(batch, self.service_name), timeout=EXPORT_TIMEOUT_SECONDS)
            except grpc.RpcError as error:
                self.dropped += len(batch)
                if not self._failing:  # once per outage
                    self._failing = True
                    log.warning(
                        "exporting traces to %s failed: %s; dropping spans until it answers", self.target, error
                    )
                continue
            self.exported += len(batch)
            if self._failing:
                self._failing = False
                log.info("exporting traces to %s again", self.target)

    def close(self) -> None:
        """Send what is pending and stop the thread."""
        self._stopping = True
        self._wake.set()
        self._thread.join(EXPORT_TIMEOUT_SECONDS + 1)
        self._channel.close()


def _span_id() -> bytes:
    return random.getrandbits(64).to_bytes(8, "big")


class RequestTracing:
    """The director's spans. `exporter` takes each finished request's spans (`OTLPExporter.add`); `ratio`: the share
    of new traces kept (a continued trace keeps its parent's decision)."""

    def __init__(self, exporter: Any, ratio: float = 1.0):
        self.exporter = exporter
        self.ratio = ratio
        self._shapes: dict[tuple, _Shape] = {}

    def start(self, headers: dict[str, str], stream_traceparent: str | None) -> Trace | None:
        """The request's span, continuing the client's traceparent, else the ext_proc stream's; None when the
        request is not sampled."""
        client = headers.get(tracing.TRACEPARENT_HEADER)
        parent = None
        if client is not None or stream_traceparent is not None:
            parent = parse_traceparent(client) or parse_traceparent(stream_traceparent)
        if parent is None:
            if self.ratio < 1.0 and random.random() >= self.ratio:
                return None
            ids = random.getrandbits(192).to_bytes(24, "big")  # a trace id and a span id in one draw
            return Trace(ids[:16], ids[16:], b"", time_ns())
        trace_id, parent_id, sampled = parent
        if not sampled:
            return None
        return Trace(trace_id, _span_id(), parent_id, time_ns())

    def decided(
        self,
        trace: Trace,
        request: SchedulingRequest,
        result: SchedulingResult,
        queued: tuple[int, int] | None,
        scheduled: tuple[int, int],
    ) -> None:
        """The request's flow-control span (`queued`: when it entered and left the queue, ns) and scheduling span
        (`scheduled`: its start and end, ns) under its request span."""
        trace.attributes += _string_attribute(_REQUEST_ID_KEY, request.request_id) + _repeated(
            "gen_ai.request.model", request.model
        )
        names, seconds = zip(*result.timings, strict=True) if result.timings else ((), ())
        raw = result.raw_scores
        layout = (result.profile, tuple(raw), len(result.totals), len(result.candidates), names)
        shape = self._shapes.get(layout)
        if shape is None:
            if len(self._shapes) >= MAX_SHAPES:
                self._shapes.clear()
            shape = self._shapes[layout] = _Shape(*layout)
        numbers = shape.template.copy()
        numbers[1::2] = [*result.totals, *chain.from_iterable(raw.values()), *seconds]
        attributes = b"".join(
            (
                shape.constant,
                _candidates(tuple(result.candidates)),
                _routed(tuple(result.endpoints)),
                shape.pack(*numbers),
                shape.suffix,
            )
        )
        children = span(trace.trace_id, _span_id(), trace.span_id, _SCHEDULING_NAME, *scheduled, attributes)
        if queued is not None:
            children += span(trace.trace_id, _span_id(), trace.span_id, _FLOW_CONTROL_NAME, *queued, b"")
        trace.children = children

    def failed(self, trace: Trace, status: int, message: str) -> None:
        """The EPP answered the request with an error."""
        trace.attributes += attribute("http.response.status_code", status) + attribute("gateway.error", message)
        if status >= 500:
            trace.error = message

    def finished(self, trace: Trace, status: str) -> None:
        """The request is over (`status`: the response's HTTP status, "" when the proxy has not told it): its spans
        go to the exporter, all in one."""
        rest = trace.attributes
        if status[:3].isdigit():
            rest += _repeated("http.response.status_code", int(status[:3]))
        if trace.error is not None:  # Status (field 15): message 2, code 3 (STATUS_CODE_ERROR = 2)
            rest += _field(b"\x7a", _field(b"\x12", trace.error.encode()) + b"\x18\x02")
        request = span(trace.trace_id, trace.span_id, trace.parent_id, REQUEST_NAME, trace.start, time_ns(), rest)
        self.exporter.add(trace.children + request)
