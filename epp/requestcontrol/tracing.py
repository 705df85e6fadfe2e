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
here straight into the OTLP protobuf (`ExportTraceServiceRequest`) from pre-encoded field keys, and a thread sends
them in batches to the collector's TraceService/Export over gRPC (`OTLPExporter`), off the request path, bounded
(MAX_PENDING_SPANS: beyond, spans are dropped and counted).

What the request path pays when a request is sampled: its ids and start time when its headers arrive, the
traceparent string of the answer, and two clock readings around scheduling; the spans' bytes are made after the
answer has gone out (`Director.after_routed`) and at the request's end. A request that is not sampled costs a
random number.
"""

from __future__ import annotations

import functools
import logging
import random
import struct
import threading
from collections import deque
from time import time_ns
from typing import Any

import grpc

from epp.scheduling.types import SchedulingRequest, SchedulingResult
from epp.wireformat import varint
from protocol import tracing

log = logging.getLogger("epp.tracing")

EXPORT_PATH = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
EXPORT_INTERVAL_SECONDS = 0.5  # a batch leaves at least this often (the SDK's batch processor: 5 s)
EXPORT_BATCH_SPANS = 512  # or as soon as this many wait
EXPORT_TIMEOUT_SECONDS = 5.0
MAX_PENDING_SPANS = 8192  # spans waiting for the exporter; beyond, new ones are dropped (a collector that is down)

# -- the OTLP protobuf, written by hand (opentelemetry/proto/trace/v1/trace.proto, common/v1/common.proto) ---------
# Each request's attributes are composed of cached pieces: keys, the endpoints' names, varints (what profiling the
# first version showed: 89 field encodings a request, 140 us; composed of cached pieces, docs/observability.md).
_pack_q = struct.Struct("<Q").pack
_pack_d = struct.Struct("<d").pack


def _field(tag: int, payload: bytes) -> bytes:
    """A length-delimited field: its tag byte (field number << 3 | 2), the length, the payload."""
    return _TAGS[tag] + varint(len(payload)) + payload


_TAGS = [bytes((n,)) for n in range(256)]
_DOUBLE_ITEM = b"\x0a\x09\x21"  # ArrayValue.values: an AnyValue of 9 bytes holding a double (field 4)


def _any(value: Any) -> bytes:
    """An AnyValue: string 1, bool 2, int 3, double 4, array 5 (of strings or doubles)."""
    if isinstance(value, str):
        return _field(0x0A, value.encode())
    if isinstance(value, bool):
        return b"\x10" + (b"\x01" if value else b"\x00")
    if isinstance(value, int):
        return b"\x18" + varint(value & 0xFFFFFFFFFFFFFFFF)
    if isinstance(value, float):
        return b"\x21" + _pack_d(value)
    if value and isinstance(value[0], str):
        return _field(0x2A, b"".join([_string_item(v) for v in value]))
    return _field(0x2A, b"".join([_DOUBLE_ITEM + _pack_d(float(v)) for v in value]))


@functools.lru_cache(maxsize=4096)
def _string_item(text: str) -> bytes:
    """A string in an ArrayValue (endpoint addresses: the same few every request)."""
    return _field(0x0A, _field(0x0A, text.encode()))


@functools.lru_cache(maxsize=1024)
def _key(key: str) -> bytes:
    return _field(0x0A, key.encode())


def attribute(key: str, value: Any) -> bytes:
    """A span's attribute (Span.attributes, field 9: a KeyValue of key 1 and value 2)."""
    return _field(0x4A, _key(key) + _field(0x12, _any(value)))


# The same attribute, made per request from what repeats: a value that comes back (an endpoint, a list of them, a
# model, a status) is encoded once; a list of doubles is its items and three lengths.
_repeated = functools.lru_cache(maxsize=4096)(attribute)


def _doubles(key: str, values: list[float]) -> bytes:
    items = b"".join([_DOUBLE_ITEM + _pack_d(v) for v in values])
    array = b"\x2a" + varint(len(items)) + items
    value = b"\x12" + varint(len(array)) + array
    key_field = _key(key)
    return b"".join((b"\x4a", varint(len(key_field) + len(value)), key_field, value))


_SERVER_KIND = b"\x30\x02"  # Span.kind = SPAN_KIND_SERVER
_INTERNAL_KIND = b"\x30\x01"


def span(
    trace_id: bytes,
    span_id: bytes,
    parent_id: bytes,
    name: bytes,
    start: int,
    end: int,
    attributes: bytes = b"",
    kind: bytes = _INTERNAL_KIND,
    error: str | None = None,
) -> bytes:
    """A Span message, ready to go in ScopeSpans.spans. `name`: its name field (`_name`)."""
    parts = [b"\x0a\x10", trace_id, b"\x12\x08", span_id]
    if parent_id:
        parts += (b"\x22\x08", parent_id)
    parts += (name, kind, b"\x39", _pack_q(start), b"\x41", _pack_q(end), attributes)
    if error is not None:  # Status: message 2, code 3 (STATUS_CODE_ERROR = 2)
        parts.append(_field(0x7A, _field(0x12, error.encode()) + b"\x18\x02"))
    return b"".join(parts)


def _name(text: str) -> bytes:
    return _field(0x2A, text.encode())


_REQUEST_NAME = _name(tracing.EPP_REQUEST_SPAN)
_FLOW_CONTROL_NAME = _name(tracing.EPP_FLOW_CONTROL_SPAN)
_SCHEDULING_NAME = _name(tracing.EPP_SCHEDULING_SPAN)


def export_request(spans: list[bytes], service_name: str) -> bytes:
    """An ExportTraceServiceRequest holding `spans` of one service (Resource service.name) and one scope."""
    resource = _field(0x0A, _field(0x0A, _field(0x0A, b"service.name") + _field(0x12, _any(service_name))))
    scope = _field(0x0A, _field(0x0A, b"epp"))
    scope_spans = _field(0x12, scope + b"".join([_field(0x12, s) for s in spans]))
    return _field(0x0A, resource + scope_spans)


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


@functools.lru_cache(maxsize=256)
def _scores_key(plugin: str) -> str:
    return f"gateway.scorer.{plugin}.scores"


class Trace:
    """A sampled request's span while it lasts."""

    __slots__ = ("attributes", "error", "parent_id", "span_id", "start", "trace_id", "traceparent")

    def __init__(self, trace_id: bytes, span_id: bytes, parent_id: bytes, start: int):
        self.trace_id, self.span_id, self.parent_id, self.start = trace_id, span_id, parent_id, start
        self.traceparent = f"00-{trace_id.hex()}-{span_id.hex()}-01"  # what the upstream request carries
        self.attributes: list[bytes] = []
        self.error: str | None = None


class OTLPExporter:
    """Sends spans to an OpenTelemetry collector (OTLP/gRPC, `endpoint` "host:port" or a URL) in batches from a
    thread of its own. `add` takes a finished span's bytes (never blocks: beyond MAX_PENDING_SPANS it drops)."""

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

    def add(self, span_bytes: bytes) -> None:
        pending = self.pending
        if len(pending) >= MAX_PENDING_SPANS:
            self.dropped += 1
            return
        pending.append(span_bytes)
        if len(pending) >= EXPORT_BATCH_SPANS:
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
            batch = [pending.popleft() for _ in range(min(len(pending), EXPORT_BATCH_SPANS))]
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


class RequestTracing:
    """The director's spans. `exporter` takes each finished span's bytes (`OTLPExporter.add`); `ratio`: the share
    of new traces kept (a continued trace keeps its parent's decision)."""

    def __init__(self, exporter: Any, ratio: float = 1.0):
        self.exporter = exporter
        self.ratio = ratio

    def start(self, headers: dict[str, str], stream_traceparent: str | None) -> Trace | None:
        """The request's span, continuing the client's traceparent, else the ext_proc stream's; None when the
        request is not sampled."""
        parent = parse_traceparent(headers.get(tracing.TRACEPARENT_HEADER)) or parse_traceparent(stream_traceparent)
        bits = random.getrandbits
        if parent is None:
            if self.ratio < 1.0 and random.random() >= self.ratio:
                return None
            return Trace(bits(128).to_bytes(16, "big"), bits(64).to_bytes(8, "big"), b"", time_ns())
        trace_id, parent_id, sampled = parent
        if not sampled:
            return None
        return Trace(trace_id, bits(64).to_bytes(8, "big"), parent_id, time_ns())

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
        trace.attributes += (
            attribute("gateway.request_id", request.request_id),
            attribute("gen_ai.request.model", request.model),
        )
        bits, add = random.getrandbits, self.exporter.add
        if queued is not None:
            add(span(trace.trace_id, bits(64).to_bytes(8, "big"), trace.span_id, _FLOW_CONTROL_NAME, *queued))
        parts = [
            _repeated("gateway.candidates", tuple([e.spec.hostport for e in result.candidates])),
            _doubles("gateway.totals", result.totals),
            _repeated("gateway.pick", result.endpoints[0].spec.hostport),
            _repeated("gateway.fallbacks", tuple([e.spec.hostport for e in result.endpoints[1:]])),
            _repeated("gateway.profile", result.profile),
        ]
        for name, scores in result.raw_scores.items():
            parts.append(_doubles(_scores_key(name.name), scores))
        timings = result.timings
        parts.append(_repeated("gateway.plugins", tuple([name.name for name, _ in timings])))
        parts.append(_doubles("gateway.plugin_seconds", [seconds for _, seconds in timings]))
        add(
            span(
                trace.trace_id,
                bits(64).to_bytes(8, "big"),
                trace.span_id,
                _SCHEDULING_NAME,
                scheduled[0],
                scheduled[1],
                b"".join(parts),
            )
        )

    def failed(self, trace: Trace, status: int, message: str) -> None:
        """The EPP answered the request with an error."""
        trace.attributes += (attribute("http.response.status_code", status), attribute("gateway.error", message))
        if status >= 500:
            trace.error = message

    def finished(self, trace: Trace, status: str) -> None:
        """The request is over (`status`: the response's HTTP status, "" when the proxy has not told it)."""
        attributes = trace.attributes
        if status[:3].isdigit():
            attributes.append(_repeated("http.response.status_code", int(status[:3])))
        self.exporter.add(
            span(
                trace.trace_id,
                trace.span_id,
                trace.parent_id,
                _REQUEST_NAME,
                trace.start,
                time_ns(),
                b"".join(attributes),
                _SERVER_KIND,
                trace.error,
            )
        )
