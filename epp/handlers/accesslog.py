"""The access-log handler: Envoy's OpenTelemetry access logger (`envoy.access_loggers.open_telemetry`) sends the EPP
a record of every finished request (the share `harness.envoy.render_bootstrap(access_log_percent=...)` samples), batched
into OTLP LogsService/Export calls on the EPP's gRPC port; the records' timings teach the latency predictor
(`epp.requestcontrol.director.Director.on_access_log`).

Why from the access log: Envoy times the upstream exchange itself, so the EPP learns a response's time to first
token without its body passing through the EPP, which costs an ext_proc round trip per token (a streamed response's
first body byte is its first token). What it costs instead: one record per request, formatted by Envoy and sent in
batches (one Export per flush interval or buffer size per Envoy worker), and parsed here; measured by `epp-bench
overhead` beside a target without it. What it cannot give: time per output token (the record has no usage); the
director reads that off the endpoint's scraped inter-token latency instead (`Endpoint.inter_token_latency`).

The record, as our bootstrap formats it (harness/templates/envoy.yaml.tmpl; another gateway can send the same):
* body: the request's x-request-id, which the EPP set on the routed request (`RoutingDecision.request_id`);
* attribute `ttft_us`: microseconds from the first byte sent upstream to the first byte of the response body
  (`%COMMON_DURATION(US_TX_BEG:US_RX_BODY_BEG:us)%`; "-" when no body came);
* attribute `status`: the response's HTTP status (`%RESPONSE_CODE%`; 0 when none was sent);
* attribute `upstream`: the endpoint that served it, ip:port (`%UPSTREAM_HOST%`, the last try's; "-" when none).
Status and endpoint are what the EPP learns at the response headers when the gateway sends them to it (ext_proc
response_header_mode SEND); our bootstrap skips that round trip when every request's record comes here.
A record without a request id (or with one longer than the EPP keeps, `MAX_REQUEST_ID_CHARS`) is skipped; so is a
time that is not a positive whole number of microseconds under an hour (the record's status and endpoint still
count), and a status outside 100-599.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Iterable

from opentelemetry.proto.collector.logs.v1 import logs_service_pb2
from opentelemetry.proto.logs.v1 import logs_pb2

from epp.handlers import wire
from protocol.extproc import MAX_REQUEST_ID_CHARS

log = logging.getLogger("epp.handlers.accesslog")

SERVICE, METHOD = "opentelemetry.proto.collector.logs.v1.LogsService", "Export"
EXPORT_PATH = f"/{SERVICE}/{METHOD}".encode()
TTFT_ATTRIBUTE = "ttft_us"
STATUS_ATTRIBUTE = "status"
UPSTREAM_ATTRIBUTE = "upstream"
MAX_MICROSECONDS = 3_600_000_000
# The largest Export taken, as serialized: ~12,000 of our records, which take the event loop ~14 ms to parse (then
# they are applied in slices, ExportHandler; before, a 64 MiB one, 795,000 records, held it 3.2 s while every ext_proc
# stream waited). Envoy's OpenTelemetry logger flushes once its buffer passes buffer_size_bytes (16 KiB by default and
# in our bootstrap), so a gateway's Exports are a few tens of KB; a larger one is refused (RESOURCE_EXHAUSTED) before
# it is parsed, and its records are lost.
MAX_EXPORT_BYTES = 1 << 20
# Records applied per turn of the event loop (ExportHandler): ~50-150 µs of the loop's time each turn.
RECORDS_PER_TURN = 16
# Records waiting for their turn at most: about four of the largest Exports taken.
MAX_PENDING_RECORDS = 50_000
MAX_HOSTPORT_CHARS = 262  # a bracketed IPv6 address and a port, with room to spare: longer is not an endpoint
# The field names of OTLP's nesting by number: older copies of the protos (the one xds-protos ships) call them
# instrumentation_library_logs / logs, current ones scope_logs / log_records; the wire format is the same.
_SCOPES = logs_pb2.ResourceLogs.DESCRIPTOR.fields_by_number[2].name
_RECORDS = logs_pb2.ResourceLogs.DESCRIPTOR.fields_by_number[2].message_type.fields_by_number[2].name

ExportRequest = logs_service_pb2.ExportLogsServiceRequest
_ANSWER = logs_service_pb2.ExportLogsServiceResponse()


class ExportRecords:
    """What the transports read an Export call's request into (its `FromString`, as a message type's): the records'
    bodies and string attributes, read from the wire bytes (`epp.handlers.wire.log_records`). Through the message
    classes, reading them cost a Python object per message and per field read; from the bytes, the handler path
    takes 5.6 thousand instructions a request fewer (`epp-bench handler-cpu --instructions`, a record a request).
    Malformed bytes raise DecodeError, as the message classes do."""

    @staticmethod
    def FromString(data: bytes | memoryview) -> list[tuple[str, dict[str, str]]]:
        return wire.log_records(data if isinstance(data, bytes) else bytes(data))


ExportRecords.__name__ = ExportRequest.__name__  # the transports' refusals name the message the gateway sent


class ExportHandler:
    """The Export method, over `ExportRecords`: each record with a request id becomes `on_record(request_id,
    ttft_seconds or None, status ("" when the record has none), served endpoint or None)`.

    The records are applied `per_turn` at a time, a slice per turn of the running event loop, in the order they came
    (without a running loop, all at once). The Export is answered at once. Why: Envoy's logger batches up to 16 KiB of
    records (~130 of ours) and sends them in one Export, often in the same read as a request's messages; applied in
    one go they held the loop 1-2 ms, and the request waited behind them (a 1 MiB Export, ~45 ms). In slices, a request
    read beside an Export waits for none of it (the transport handles the read's frames first) and one read after it
    for one slice. Over `max_pending` records waiting, the oldest are applied at once: a loop that cannot keep up
    holds a bounded backlog, as before, rather than an unbounded one."""

    def __init__(
        self,
        on_record: Callable[[str, float | None, str, str | None], None],
        per_turn: int = RECORDS_PER_TURN,
        max_pending: int = MAX_PENDING_RECORDS,
    ):
        self.on_record = on_record
        self.per_turn = per_turn
        self.max_pending = max_pending
        self.pending: deque[tuple[str, dict[str, str]]] = deque()
        self.loop: asyncio.AbstractEventLoop | None = None  # set while a slice is scheduled on it

    def __call__(self, records: list[tuple[str, dict[str, str]]]) -> logs_service_pb2.ExportLogsServiceResponse:
        self.pending.extend(records)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._apply(len(self.pending))
            return _ANSWER
        if len(self.pending) > self.max_pending:
            self._apply(len(self.pending) - self.max_pending)
        if self.loop is None and self.pending:
            self.loop = loop
            loop.call_soon(self._drain)
        return _ANSWER

    def _drain(self) -> None:
        try:
            self._apply(min(self.per_turn, len(self.pending)))
        finally:  # a record whose handling raised (logged by the loop) does not strand the ones after it
            if self.pending:
                self.loop.call_soon(self._drain)
            else:
                self.loop = None

    def _apply(self, count: int) -> None:
        skipped = 0
        pending, on_record = self.pending, self.on_record
        for _ in range(count):
            request_id, attributes = pending.popleft()
            if not request_id or len(request_id) > MAX_REQUEST_ID_CHARS:  # not an id the EPP gave
                skipped += 1
                continue
            ttft_us = attributes.get(TTFT_ATTRIBUTE, "")
            status = attributes.get(STATUS_ATTRIBUTE, "")
            upstream = attributes.get(UPSTREAM_ATTRIBUTE, "")
            ttft = (
                int(ttft_us) / 1e6
                if ttft_us.isdecimal() and len(ttft_us) < 12 and 0 < int(ttft_us) < MAX_MICROSECONDS
                else None
            )
            if not (len(status) == 3 and status.isascii() and status.isdecimal() and "100" <= status <= "599"):
                status = ""  # 0 (no response), or not a status: bounds the error metric's labels too
            served = upstream if upstream and upstream != "-" and len(upstream) <= MAX_HOSTPORT_CHARS else None
            if ttft is None and not status:
                skipped += 1
                continue
            on_record(request_id, ttft, status, served)
        if skipped:
            log.debug("skipped %d access-log records without a request id, a first-byte time or a status", skipped)


def export_request(records: Iterable[tuple[str, ...]]) -> ExportRequest:
    """An Export call's request as our bootstrap's logger formats it: one record per (request id, ttft_us[, status[,
    upstream]]), the attributes as strings (what `ExportHandler` reads; the benchmarks and tests send it)."""
    request = ExportRequest()
    scope = getattr(request.resource_logs.add(), _SCOPES).add()
    keys = (TTFT_ATTRIBUTE, STATUS_ATTRIBUTE, UPSTREAM_ATTRIBUTE)
    for request_id, *values in records:
        record = getattr(scope, _RECORDS).add()
        record.body.string_value = request_id
        for key, value in zip(keys, values, strict=False):
            attribute = record.attributes.add()
            attribute.key = key
            attribute.value.string_value = value
    return request
