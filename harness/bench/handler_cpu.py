"""What the EPP's own Python costs per request, without Envoy, sockets or other processes on the CPU.

One request is what Envoy sends for it with our default bootstrap (modelled on a capture of the overhead bench's
client): over ext_proc, a HEADERS frame and three DATA frames (request headers, the body, the end of the body) in one
read, the stream's END_STREAM and RST_STREAM in a second (the response headers are not sent: the access log brings
status and endpoint; Envoy resets the stream as it ends it, without waiting for trailers); then
its access-log record, in an OpenTelemetry Export call on a connection of its own that carries a read's worth of
records, as Envoy batches them. Those frames go to the h2 transport (`epp.transport.h2.ExtProcConnection`) with the EPP's
handler, director, default scheduler and flow control over four endpoints, and the access-log handler; the answers
go to a transport that only counts them. With `--streamed` the records' times train the latency predictor, so
after the first round its plugins predict for every request and each record costs what learning from it costs, as
in a live EPP. The figure is CPU time per request, the least of several rounds: on a shared machine noise only
adds, and the overhead bench's whole-process figures spread by +-10 % between identical runs, which hides any
single change worth a few microseconds. `batch` hands that many requests' frames over in each read,
as at concurrency 32.

`kv_events`: the endpoints publish KV events, as vLLM with --kv-events-config and our sims do (the index knows them
as publishers; none is sent, so no block is held): precise-prefix-cache-scorer then tokenizes each prompt and hashes
its blocks as in a live EPP, where without it the scheduler does not call the scorer (no endpoint publishes).

`tracing`: "on", every request traced (`--otlp-traces-endpoint`, ratio 1.0), each batch of spans encoded into its
Export request as the exporter's thread does (`EncodingSink`: all but the send); "bare", tracing's floor: a sampled
request's ids, its traceparent sent upstream and one span without attributes or children (`BareSpans`); "off".

`evict_mb` writes to that many MiB of memory before each read, untimed: the caches as a live EPP finds them when it
wakes, after Envoy, the client and the model servers ran on its core. A live EPP behind Envoy on a 2-core host
(a wake-up every ~5 requests) costs what this costs at 16 to 24 MiB (README, "The compiled request path").

    epp-bench handler-cpu [--requests 4000] [--batch 16] [--rounds 9] [--streamed] [--kv-events]
                          [--config-file FILE] [--evict-mb N] [--tracing off|bare|on] [--instructions]
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hpack import Encoder

from epp.config.loader import DEFAULT_CONFIG, load
from epp.datalayer.datastore import Datastore
from epp.datalayer.endpoint import EndpointSpec, PoolState
from epp.datalayer.kv_events import KVBlockIndex
from epp.flowcontrol import FlowControlConfig, FlowController
from epp.handlers import accesslog
from epp.handlers.extproc import RequestStream
from epp.handlers.wire import ExtProcRequest
from epp.metrics import EPPMetrics
from epp.requestcontrol import tracing as request_tracing
from epp.requestcontrol.director import Director
from epp.scheduling.scheduler import Scheduler
from epp.transport.h2 import (
    DATA,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    MAX_WINDOW,
    PREFACE,
    RST_STREAM,
    SETTINGS,
    U32,
    WINDOW_UPDATE,
    ExtProcConnection,
    ExtProcServer,
    UnaryMethod,
    frame,
    grpc_message,
)
from harness.bench import build
from protocol import extproc
from protocol.limits import ByteBudget
from protocol.metrics import EndpointMetrics

ENDPOINTS = 4
REQUEST = {"model": "sim-llama-8b", "prompt": "Say hello to the benchmark.", "max_tokens": 1}
GRPC_REQUEST_HEADERS = [
    (":method", "POST"),
    (":path", "/envoy.service.ext_proc.v3.ExternalProcessor/Process"),
    (":authority", "epp"),
    (":scheme", "http"),
    ("te", "trailers"),
    ("content-type", "application/grpc"),
    ("x-envoy-internal", "true"),
    ("x-forwarded-for", "192.0.2.2"),
]
CANCEL = 0x8
EXPORT_HEADERS = [(k, accesslog.EXPORT_PATH.decode() if k == ":path" else v) for k, v in GRPC_REQUEST_HEADERS]
TTFT_US = (1800, 2100, 2500, 1900, 2300)  # what the records report: any positive times train the predictor
CACHE_LINE = 64  # bytes


def _headers(pairs: list[tuple[str, str]]) -> pb.HttpHeaders:
    return pb.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs])
    )


def _request_messages(request_id: str, body: bytes) -> list[bytes]:
    """The request's three messages, as Envoy sends them (each with the empty metadata_context Envoy adds when the
    filter forwards metadata namespaces, as our bootstrap's does)."""
    request_headers = pb.ProcessingRequest(
        request_headers=_headers(
            [
                (":authority", "127.0.0.1:8081"),
                (":path", "/v1/completions"),
                (":method", "POST"),
                (":scheme", "http"),
                ("accept", "*/*"),
                ("accept-encoding", "gzip, deflate"),
                ("user-agent", "Python/3.11 aiohttp/3.14.5"),
                ("content-length", str(len(body))),
                ("content-type", "application/json"),
                ("x-forwarded-proto", "http"),
                (extproc.REQUEST_ID_HEADER, request_id),
            ]
        ),
        protocol_config=pb.ProtocolConfiguration(
            request_body_mode=processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
        ),
    )
    chunk = pb.ProcessingRequest(request_body=pb.HttpBody(body=body))
    end = pb.ProcessingRequest(request_body=pb.HttpBody(end_of_stream=True))
    messages = (request_headers, chunk, end)
    for message in messages:
        message.metadata_context.SetInParent()
    return [m.SerializeToString() for m in messages]


class _NoScraper:
    """Endpoints with a fixed empty page: what is measured is the request path, not scraping."""

    name = "no-scraper"

    def start(self, endpoint) -> None:
        endpoint.metrics = EndpointMetrics(block_size=16, num_gpu_blocks=100)
        endpoint.stale = False

    def stop(self, endpoint) -> None:
        endpoint.stale = True

    def wake(self) -> None:
        pass

    async def close(self) -> None:
        return None


class CountingTransport:
    """An asyncio transport that takes every write and only counts it: always writable, never closing."""

    def __init__(self) -> None:
        self.writes = 0

    def write(self, data: bytes) -> None:
        self.writes += 1

    def get_write_buffer_size(self) -> int:
        return 0

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass


class EncodingSink:
    """The OTLP exporter's work but the send: each batch of requests' spans encoded into its Export request."""

    def __init__(self) -> None:
        self.pending: list[bytes] = []

    def add(self, spans: bytes) -> None:
        self.pending.append(spans)
        if len(self.pending) == request_tracing.EXPORT_BATCH_REQUESTS:
            request_tracing.export_request(self.pending, "epp")
            self.pending = []


class BareSpans(request_tracing.RequestTracing):
    """Tracing's floor: a sampled request's ids and the traceparent it sends upstream, and one span without
    attributes or children."""

    def decided(self, trace, request, result, queued, scheduled) -> None:
        pass

    def finished(self, trace: request_tracing.Trace, status: str) -> None:
        self.exporter.add(
            request_tracing.span(
                trace.trace_id,
                trace.span_id,
                trace.parent_id,
                request_tracing.REQUEST_NAME,
                trace.start,
                time.time_ns(),
                b"",
            )
        )


TRACING = {"off": None, "bare": BareSpans, "on": request_tracing.RequestTracing}


@dataclass
class HandlerCpuResult:
    requests: int
    batch: int
    rounds: list[float]  # us of CPU per request, each round
    writes_per_request: float
    routed: int
    open_streams: int
    streamed: bool
    evict_mb: int  # MiB written before each read (0: the caches stay warm)
    kv_events: bool  # the endpoints publish KV events (precise-prefix-cache-scorer tokenizes)
    learnt: int  # access-log records the latency predictor learnt from
    tracing: str = "off"  # every request traced ("on"), tracing's floor ("bare") or not
    build: str = field(default_factory=build.summary)  # compiled or pure Python

    @property
    def us_per_request(self) -> float:
        return min(self.rounds)

    def markdown(self) -> str:
        ordered = sorted(self.rounds)
        return (
            f"EPP handler path, {self.requests} {'streamed ' if self.streamed else ''}requests per round, "
            f"{self.batch} per read{f' after {self.evict_mb} MiB written' if self.evict_mb else ''}"
            f"{', endpoints publishing KV events' if self.kv_events else ''}"
            f"{f', tracing {self.tracing}' if self.tracing != 'off' else ''}: "
            f"{self.us_per_request:.1f} us of CPU per request (least of {len(ordered)} rounds; median "
            f"{ordered[len(ordered) // 2]:.1f}), {self.writes_per_request:.2f} writes per request; the latency "
            f"predictor learnt from {self.learnt} access-log records; request path {self.build}"
        )


def _director(config: str = DEFAULT_CONFIG, kv_events: bool = False, tracing: str = "off") -> Director:
    """A fresh EPP's director with `config` (an EndpointPickerConfig): its latency predictor has learnt nothing;
    with `kv_events` the endpoints are known as KV-event publishers (holding no block yet); `tracing` (TRACING)."""
    sections = load(config)
    scheduler = Scheduler.from_sections(sections)
    datastore = Datastore([_NoScraper()], scheduler.on_pool_changed)
    datastore.apply(
        PoolState(endpoints=tuple(EndpointSpec(f"sim-{i}", "127.0.0.1", 8000 + i) for i in range(ENDPOINTS)))
    )
    if kv_events:
        index = KVBlockIndex()
        for endpoint in datastore.endpoints:
            index.saw(endpoint.hostport, REQUEST["model"])
        scheduler.use_kv_index(index)
    detector = scheduler.detector
    metrics = EPPMetrics("pool")
    flow_control = FlowController(
        FlowControlConfig.from_sections(sections),
        lambda in_flight: detector.has_room(datastore.endpoints, in_flight),
        observer=metrics.flow_control_outcome,
        poll_interval=0.05,
    )
    traced = TRACING[tracing]
    return Director(datastore, scheduler, metrics, flow_control, tracing=traced and traced(EncodingSink()))


WARM_UP_REQUESTS = 160
# callgrind's caches for `instructions(evict_mb=...)`: 32 KiB L1s and a 1 MiB last level, as one core of the hosts
# here (AMD EPYC: its L3 is shared with the other processes and the other tenants, so it is left out)
CACHE_SIMULATION = ["--cache-sim=yes", "--I1=32768,8,64", "--D1=32768,8,64", "--LL=1048576,16,64"]


def instructions(
    requests: int = 1600,
    batch: int = 16,
    streamed: bool = False,
    config_file: Path | None = None,
    kv_events: bool = False,
    evict_mb: int = 0,
    tracing: str = "off",
) -> dict[str, float]:
    """Instructions per request of the same path, counted by valgrind's callgrind: exact and repeatable, where CPU
    time on a shared host spreads by several µs between identical runs, so that a change worth 1 % shows (two runs
    of one build, 1,600 requests: 306.9 and 304.3 thousand). Processes run it for WARM_UP_REQUESTS and for as many
    more as `requests`; the difference over `requests` leaves out start-up and the first requests' one-off work
    (caches filling). Two more do the same without delivering the requests (`measure(deliver=False)`), and their
    difference is taken off: what the harness itself spends building each request's frames, messages and records
    (about 377 thousand a request in batches of 16, more than the EPP's own; counted in before 2026-11-28, so
    figures from before are higher by that much, their differences between builds as they were). Returns callgrind's
    events per request: "Ir", the instructions; with `evict_mb`, its simulated caches too (CACHE_SIMULATION: one
    core's L1s and a last level as large as its L2), "ILmr" the lines of code and "DLmr" and "DLmw" the lines of data
    read and written that came from beyond that last level, after `evict_mb` MiB written before each read: the
    memory a request touches that a live EPP must fetch again when other processes have run on its core. Needs
    valgrind on PATH; about two minutes (three with the caches simulated)."""
    if shutil.which("valgrind") is None:
        raise RuntimeError("valgrind is not on PATH (Debian: apt-get install valgrind)")
    first, more = WARM_UP_REQUESTS // batch * batch, requests // batch * batch  # (whole reads, as `measure` sends)
    config = config_file.read_text() if config_file else DEFAULT_CONFIG
    counts = {}
    for deliver in (True, False):
        for count in (first, first + more):
            # the same hashes and random choices (ties between endpoints) in every run; start-up frozen out of the
            # collector's full collections, as the EPP does once it is ready (epp/cli.py)
            script = (
                "import gc, random; random.seed(0); from harness.bench import handler_cpu; gc.collect(); gc.freeze(); "
                f"handler_cpu.measure({count}, {batch}, 1, {streamed!r}, {config!r}, {evict_mb}, {kv_events!r}, "
                f"{deliver!r}, {tracing!r})"
            )
            simulation = CACHE_SIMULATION if evict_mb else []
            command = ["valgrind", "--tool=callgrind", *simulation, "--callgrind-out-file=/dev/null", sys.executable]
            command += ["-c", script]
            # one thread each for numpy's BLAS and the tokenizers' pool: idle worker threads spin, and their
            # spinning counted as many instructions as the difference between two identical runs (20 M)
            environment = {**os.environ, "PYTHONHASHSEED": "0", "OPENBLAS_NUM_THREADS": "1", "RAYON_NUM_THREADS": "1"}
            run = subprocess.run(command, capture_output=True, text=True, check=True, env=environment)
            events = re.search(r"Events\s*: ([\w ]+)", run.stderr).group(1).split()
            collected = map(int, re.search(r"Collected : ([\d ]+)", run.stderr).group(1).split())
            counts[deliver, count] = dict(zip(events, collected, strict=True))

    def added(deliver: bool, event: str) -> int:  # by the `more` requests past the warm-up
        return counts[deliver, first + more][event] - counts[deliver, first][event]

    reported = [event for event in ("Ir", "ILmr", "DLmr", "DLmw") if event in counts[True, first]]
    return {event: (added(True, event) - added(False, event)) / more for event in reported}


def measure(
    requests: int = 4000,
    batch: int = 16,
    rounds: int = 9,
    streamed: bool = False,
    config: str = DEFAULT_CONFIG,
    evict_mb: int = 0,
    kv_events: bool = False,
    deliver: bool = True,
    tracing: str = "off",
) -> HandlerCpuResult:
    """Runs on the caller's thread; needs no event loop (no request waits in flow control: the pool has room).
    `streamed`: the requests ask for a streamed response (`"stream": true`, as chat clients do), whose access-log
    records teach the latency predictor (a whole response's time to its first byte is not a TTFT: not learnt).
    `kv_events`: the endpoints publish KV events (see the module's docstring). `deliver` False: every request is
    built as usual and none is delivered (`instructions` takes that work off). `tracing`: the module's docstring."""
    body = json.dumps({**REQUEST, "stream": True} if streamed else REQUEST).encode()
    director = _director(config, kv_events, tracing)
    budget = ByteBudget(1 << 30)
    transport, log_transport = CountingTransport(), CountingTransport()

    def new_stream(reply):
        return RequestStream(director, reply, budget)

    connection = ExtProcConnection(ExtProcServer(new_stream, request_type=ExtProcRequest))
    export = UnaryMethod(
        accesslog.ExportRecords, accesslog.ExportHandler(director.on_access_log), accesslog.MAX_EXPORT_BYTES
    )
    log_connection = ExtProcConnection(
        ExtProcServer(new_stream, {accesslog.EXPORT_PATH: export}, request_type=ExtProcRequest)
    )
    for conn, sink in ((connection, transport), (log_connection, log_transport)):
        conn.connection_made(sink)
        # the client's preface, and a connection window no round uses up (Envoy returns it with WINDOW_UPDATEs)
        conn.data_received(PREFACE + frame(SETTINGS, 0, 0) + frame(WINDOW_UPDATE, 0, 0, U32.pack(MAX_WINDOW - 65_535)))
    encoder, log_encoder = Encoder(), Encoder()
    served = director.datastore.endpoints[0].hostport  # Envoy's upstream host: a pick or not, as it comes
    stream_id = log_stream_id = 1
    per_round = requests // batch * batch
    evictions = bytearray(evict_mb << 20) if evict_mb else None
    evicted_lines = bytes(len(evictions) // CACHE_LINE) if evictions is not None else b""
    times = []
    writes = 0
    for _ in range(rounds):
        reads = []
        for _ in range(per_round // batch):
            opened, ended, records = [], [], []
            for _ in range(batch):
                request_id = f"request-{stream_id}"
                block = encoder.encode(GRPC_REQUEST_HEADERS)
                opened.append(
                    frame(HEADERS, END_HEADERS, stream_id, block)
                    + b"".join(frame(DATA, 0, stream_id, grpc_message(m)) for m in _request_messages(request_id, body))
                )
                ended.append(frame(DATA, END_STREAM, stream_id) + frame(RST_STREAM, 0, stream_id, U32.pack(CANCEL)))
                records.append((request_id, str(TTFT_US[stream_id % len(TTFT_US)]), "200", served))
                stream_id += 2
            export_message = accesslog.export_request(records).SerializeToString()
            reads.append((connection, b"".join(opened)))
            reads.append((connection, b"".join(ended)))
            reads.append(
                (
                    log_connection,
                    frame(HEADERS, END_HEADERS, log_stream_id, log_encoder.encode(EXPORT_HEADERS))
                    + frame(DATA, END_STREAM, log_stream_id, grpc_message(export_message)),
                )
            )
            log_stream_id += 2
        writes_before = transport.writes
        spent = 0.0
        for conn, data in reads:
            if evictions is not None:
                evictions[::CACHE_LINE] = evicted_lines  # a byte in every line: evicts what the caches held
            started = time.process_time()
            if deliver:
                conn.data_received(data)
            spent += time.process_time() - started
        times.append(1e6 * spent / per_round)
        writes = transport.writes - writes_before
    result = HandlerCpuResult(
        requests=per_round,
        batch=batch,
        rounds=times,
        writes_per_request=writes / per_round,
        routed=sum(e.routed_total for e in director.datastore.endpoints),
        open_streams=len(connection.streams),
        streamed=streamed,
        evict_mb=evict_mb,
        kv_events=kv_events,
        tracing=tracing,
        learnt=predictor.observations if (predictor := director.scheduler.latency_predictor) is not None else 0,
    )
    return result
