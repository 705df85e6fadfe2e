"""`epp-bench chaos`: attacks and faults against a local stack, each while a well-behaved client keeps sending
requests through the gateway.

For each attack the table shows what the attacker sent and how much of it was answered as it should be (an
OpenAI-shaped error, a refused stream, a closed connection), whether any well-behaved request was lost (failed,
or answered with a body that is not OpenAI-shaped), the EPP's peak RSS above idle, and the worst latency of a
well-behaved request against its unloaded p50. Goals (issue 11): RSS within 64 MB of idle, worst latency within
3x the unloaded p50 (faults that take a server away are judged on losses, not latency), nothing lost. A missed goal
is named with its numbers in the table, and `epp-bench chaos` then exits 1.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from hpack import Encoder

from epp.transport.h2 import (
    CONTINUATION,
    DATA,
    ENHANCE_YOUR_CALM,
    GOAWAY,
    HEADERS,
    MAX_CONNECTIONS,
    MAX_WINDOW,
    PING,
    PREFACE,
    RST_STREAM,
    SETTINGS,
    SETTINGS_INITIAL_WINDOW_SIZE,
    WINDOW_UPDATE,
    frame,
    grpc_message,
)
from harness.local import LocalStack, StackConfig

MODEL = "sim-llama-8b"
FAST_SIM = ["--sim-decode-base", "0.002", "--sim-prefill-time-per-token", "0.00001", "--sim-prefill-overhead", "0.001"]
PROCESS_PATH = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
REQUEST_HEADERS = [
    (":method", "POST"),
    (":scheme", "http"),
    (":path", PROCESS_PATH),
    (":authority", "epp"),
    ("content-type", "application/grpc"),
    ("te", "trailers"),
]


@dataclass
class ChaosReport:
    unloaded_p50_ms: float
    idle_rss_mb: float
    results: list[AttackResult]


@dataclass
class AttackResult:
    attack: str
    sent: int
    answered_correctly: int
    lost: int  # well-behaved requests that failed or got an unshaped body
    peak_rss_mb: float  # above idle
    worst_ms: float  # of a well-behaved request during the attack
    probes: int
    judged_on_latency: bool = True
    notes: list[str] = field(default_factory=list)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def openai_shaped(body: bytes) -> bool:
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(error, dict) and bool(error.get("message"))


class Prober:
    """A well-behaved client: one small request after another through the gateway."""

    def __init__(self, url: str):
        self.url = url
        self.latencies: list[float] = []
        self.lost = 0
        self.notes: list[str] = []

    async def one(self, session: aiohttp.ClientSession) -> None:
        body = {"model": MODEL, "prompt": "a well-behaved request", "max_tokens": 2}
        started = time.monotonic()
        try:
            async with session.post(self.url, json=body) as r:
                payload = await r.read()
                if r.status != 200 and not openai_shaped(payload):
                    self.lost += 1
                    self.notes.append(f"HTTP {r.status} unshaped: {payload[:80]!r}")
                elif r.status != 200:
                    self.lost += 1
                    self.notes.append(f"HTTP {r.status}: {json.loads(payload)['error']['message'][:80]}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.lost += 1
            self.notes.append(f"{type(exc).__name__}")
        self.latencies.append(time.monotonic() - started)

    async def run(self, stop: asyncio.Event) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            while not stop.is_set():
                await self.one(session)
                await asyncio.sleep(0.02)


# -- attacks: each returns (sent, answered correctly) -------------------------------------------------------------
def _raw_h2(port: int, settings: bytes = b"") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(PREFACE + frame(SETTINGS, 0, 0, settings))
    return s


def _until_goaway(s: socket.socket, seconds: float = 10.0) -> int | None:
    """The server's GOAWAY code; -1 when it closed without one; None when it did neither in time."""
    buffer, end = b"", time.monotonic() + seconds
    s.settimeout(0.5)
    while time.monotonic() < end:
        try:
            data = s.recv(1 << 16)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return -1
        if not data:
            return -1
        buffer += data
        code = goaway_code(buffer)
        if code is not None:
            return code
    return None


def _send_all(s: socket.socket, payload: bytes) -> None:
    with contextlib.suppress(BrokenPipeError, ConnectionResetError, TimeoutError):
        s.sendall(payload)


def h2_attack(port: int, payload: bytes, repeat: int = 1) -> tuple[int, int]:
    """One connection sends `payload` `repeat` times; answered correctly = the server ended that connection."""
    with _raw_h2(port) as s:
        for _ in range(repeat):
            _send_all(s, payload)
        code = _until_goaway(s)
    return 1, int(code is not None)


def stream_flood(port: int, count: int) -> tuple[int, int]:
    """`count` streams opened and left idle on one connection, far over the advertised limit; answered correctly:
    all of them when the server refuses the excess and then ends the connection of a peer that ignores its limit."""
    encoder = Encoder()
    with _raw_h2(port) as s:
        _send_all(s, b"".join(frame(HEADERS, 0x4, 2 * i + 1, encoder.encode(REQUEST_HEADERS)) for i in range(count)))
        code = _until_goaway(s)
    return count, count if code is not None else 0


def connection_flood(port: int, count: int, hold: float) -> tuple[int, int]:
    """`count` connections opened and held for `hold` seconds, beyond the EPP's connection limit; answered
    correctly: each one accepted while under the limit, or refused with GOAWAY ENHANCE_YOUR_CALM once over it."""
    sockets, refused = [], 0
    try:
        for _ in range(count):
            sockets.append(_raw_h2(port))
        time.sleep(0.5)
        for s in sockets:
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError, ConnectionResetError):
                refused += goaway_code(s.recv(1 << 16)) == ENHANCE_YOUR_CALM
        time.sleep(hold)
    finally:
        for s in sockets:
            s.close()
    accepted = count - refused
    return count, count if accepted <= MAX_CONNECTIONS else 0


def goaway_code(received: bytes) -> int | None:
    """The code of the first GOAWAY among the whole frames of `received` (a server's bytes); None without one."""
    position = 0
    while position + 9 <= len(received):
        length = int.from_bytes(received[position : position + 3], "big")
        if received[position + 3] == GOAWAY:
            return struct.unpack(">L", received[position + 13 : position + 17])[0]
        position += 9 + length
    return None


def grpc_body_flood(port: int, megabytes: int) -> tuple[int, int]:
    """request_body messages without end of stream, straight to the ext_proc port: the EPP answers 413 once over
    its body limit (an immediate response), then drops the rest."""
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    encoder = Encoder()
    headers = pb.ProcessingRequest()
    headers.request_headers.headers.headers.add(key=":path", raw_value=b"/v1/completions")
    chunk = pb.ProcessingRequest(request_body=pb.HttpBody(body=b"x" * (1 << 20))).SerializeToString()
    answered = 0
    with _raw_h2(port) as s:
        _send_all(s, frame(HEADERS, 0x4, 1, encoder.encode(REQUEST_HEADERS)))
        _send_all(s, frame(DATA, 0, 1, grpc_message(headers.SerializeToString())))
        for _ in range(megabytes):
            data = grpc_message(chunk)
            for start in range(0, len(data), 1 << 16):
                _send_all(s, frame(DATA, 0, 1, data[start : start + (1 << 16)]))
        s.settimeout(1)
        received, end = b"", time.monotonic() + 5
        while b"larger than" not in received and time.monotonic() < end:
            with contextlib.suppress(TimeoutError):
                data = s.recv(1 << 16)
                if not data:
                    break
                received += data
        answered = int(b"larger than" in received)  # the 413's OpenAI error message
    return 1, answered


def unread_answers(port: int, streams: int, body_bytes: int, wait: float) -> tuple[int, int]:
    """One connection that opens the largest flow-control windows and then reads nothing, while each of its
    `streams` sends a valid request whose body the EPP echoes (FULL_DUPLEX_STREAMED, as our Envoy bootstrap asks):
    the answers pile up in the EPP's socket buffer. Answered correctly: the connection was cut within `wait`
    seconds (a send on it then fails), instead of the EPP holding what it does not read."""
    from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    body = json.dumps({"model": MODEL, "prompt": "x" * body_bytes, "max_tokens": 1}).encode()
    headers = pb.ProcessingRequest(
        protocol_config=pb.ProtocolConfiguration(
            request_body_mode=processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
        )
    )
    for key, value in ((":path", "/v1/completions"), (":method", "POST"), ("content-type", "application/json")):
        headers.request_headers.headers.headers.add(key=key, raw_value=value.encode())
    messages = grpc_message(headers.SerializeToString()) + grpc_message(
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)).SerializeToString()
    )
    encoder = Encoder()
    with _raw_h2(port, struct.pack(">HL", SETTINGS_INITIAL_WINDOW_SIZE, MAX_WINDOW)) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        _send_all(s, frame(WINDOW_UPDATE, 0, 0, struct.pack(">L", MAX_WINDOW - 65_535)))
        for i in range(streams):
            stream_id = 2 * i + 1
            wire = frame(HEADERS, 0x4, stream_id, encoder.encode(REQUEST_HEADERS))
            for start in range(0, len(messages), 16_384):
                wire += frame(DATA, 0, stream_id, messages[start : start + 16_384])
            _send_all(s, wire)
        time.sleep(wait)
        try:
            for _ in range(3):  # a reset socket fails a send, if not the first then the next
                s.sendall(frame(PING, 0, 0, b"12345678"))
                time.sleep(0.1)
        except OSError:
            return streams, streams
    return streams, 0


def gateway_body_flood(url: str, megabytes: int) -> tuple[int, int]:
    """A body over the EPP's limit through the gateway; answered correctly = an OpenAI-shaped 413 (or the
    gateway closing the upload after sending it)."""
    host, port = url.removeprefix("http://").split("/", 1)[0].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        size = megabytes << 20
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % size
        )
        chunk = b"x" * (1 << 20)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for _ in range(megabytes):
                s.sendall(chunk)
        answer = b""
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while b"\r\n\r\n" not in answer or len(answer) < answer.index(b"\r\n\r\n") + 30:
                data = s.recv(1 << 16)
                if not data:
                    break
                answer += data
    head, _, body = answer.partition(b"\r\n\r\n")
    return 1, int(head.startswith(b"HTTP/1.1 413") and b'"error"' in body)


def metrics_flood(metrics_url: str, seconds: float, loops: int = 4) -> tuple[int, int]:
    """`loops` clients reading the EPP's /metrics back to back for `seconds` (a scraper gone wrong, or an attacker:
    a page render holds the GIL against the event loop); answered correctly = a page of metrics."""
    import urllib.request

    end = time.monotonic() + seconds

    def scrape() -> tuple[int, int]:
        sent = good = 0
        while time.monotonic() < end:
            sent += 1
            with contextlib.suppress(OSError), urllib.request.urlopen(metrics_url, timeout=5) as response:
                good += response.status == 200 and b"inference_pool_ready_pods" in response.read()
        return sent, good

    with concurrent.futures.ThreadPoolExecutor(loops) as pool:
        counts = list(pool.map(lambda _: scrape(), range(loops)))
    return sum(s for s, _ in counts), sum(g for _, g in counts)


async def model_name_flood(url: str, metrics_url: str, count: int) -> tuple[int, int]:
    correct = 0
    async with aiohttp.ClientSession() as session:
        for i in range(count):
            body = {"model": f"random-{random.getrandbits(64):x}-{i}", "prompt": "x", "max_tokens": 1}
            async with session.post(url, json=body) as r:
                correct += r.status == 404 and openai_shaped(await r.read())
        async with session.get(metrics_url) as r:
            page = await r.text()
    bounded = "random-" not in page and len(page) < 200_000
    return count, correct if bounded else 0


async def run(
    servers: int = 4, seconds: float = 4.0, workdir: Path | None = None, progress=print, only: tuple[str, ...] = ()
) -> ChaosReport:
    """Every attack in turn on one stack (`only`: the attacks whose names start with one of these)."""
    stack = LocalStack(
        StackConfig.on_free_ports(
            servers,
            workdir=workdir,
            separate_model_server_processes=True,
            modelserver_args=[*FAST_SIM, "--disable-log-stats"],
        )
    )
    await stack.start()
    grpc = stack.config.grpc_port
    # the attacker runs in a process of its own, so that its work does not slow the prober that measures latency
    pool = concurrent.futures.ProcessPoolExecutor(1)
    results: list[AttackResult] = []
    url = f"{stack.gateway_url}/v1/completions"
    try:
        epp_pid = stack.processes["epp"].pid
        baseline = Prober(url)
        async with aiohttp.ClientSession() as session:
            for _ in range(40):
                await baseline.one(session)
        unloaded_p50 = statistics.median(baseline.latencies[10:])
        idle_rss = rss_mb(epp_pid)
        progress(f"unloaded p50 {unloaded_p50 * 1e3:.1f} ms, EPP idle RSS {idle_rss:.0f} MB")

        async def under(name: str, attack: Callable[[], Awaitable[tuple[int, int]]], latency: bool = True) -> None:
            if only and not name.startswith(only):
                return
            prober, stop, peak = Prober(url), asyncio.Event(), [idle_rss]

            async def sample() -> None:
                while not stop.is_set():
                    with contextlib.suppress(OSError):
                        peak[0] = max(peak[0], rss_mb(epp_pid))
                    await asyncio.sleep(0.05)

            tasks = [asyncio.create_task(prober.run(stop)), asyncio.create_task(sample())]
            started = time.monotonic()
            sent, correct = await attack()
            await asyncio.sleep(max(0.5, seconds - (time.monotonic() - started)))
            stop.set()
            await asyncio.gather(*tasks)
            result = AttackResult(
                name,
                sent,
                correct,
                prober.lost,
                peak[0] - idle_rss,
                max(prober.latencies, default=0.0) * 1e3,
                len(prober.latencies),
                latency,
                prober.notes[:3],
            )
            results.append(result)
            progress(
                f"{name}: {correct}/{sent} answered correctly, {result.lost} lost of {result.probes}, "
                f"peak RSS +{result.peak_rss_mb:.0f} MB, worst {result.worst_ms:.0f} ms"
            )

        loop = asyncio.get_running_loop()

        def thread(function, *args):
            return loop.run_in_executor(pool, function, *args)

        await under("body flood via gateway (40 MB)", lambda: thread(gateway_body_flood, url, 40))
        await under("body flood to ext_proc port (200 MB)", lambda: thread(grpc_body_flood, grpc, 200))
        await under("HTTP/2: 5,000 idle streams", lambda: thread(stream_flood, grpc, 5000))
        cont = (
            frame(HEADERS, 0, 1, Encoder().encode(REQUEST_HEADERS)) + frame(CONTINUATION, 0, 1, bytes(16_000)) * 2_000
        )
        await under("HTTP/2: 32 MB of CONTINUATION", lambda: thread(h2_attack, grpc, cont))
        pings = frame(PING, 0, 0, b"12345678") * 65_536
        await under("HTTP/2: PING flood (1.3 M), ACKs unread", lambda: thread(h2_attack, grpc, pings, 20))
        reset_encoder = Encoder()
        resets = b"".join(
            frame(HEADERS, 0x4, 2 * i + 1, reset_encoder.encode(REQUEST_HEADERS))
            + frame(RST_STREAM, 0, 2 * i + 1, b"\0\0\0\x08")
            for i in range(2000)
        )
        await under("HTTP/2: rapid reset (2,000)", lambda: thread(h2_attack, grpc, resets))
        await under("answers left unread (10 x 2.5 MB echoed)", lambda: thread(unread_answers, grpc, 10, 5 << 19, 2.0))
        flood = MAX_CONNECTIONS + 100
        await under(f"connection flood ({flood:,})", lambda: thread(connection_flood, grpc, flood, seconds / 2))
        await under("HTTP/2: 1-byte WINDOW_UPDATE", lambda: thread(h2_attack, grpc, frame(WINDOW_UPDATE, 0, 0, b"\1")))
        await under("model-name flood (2,000 names)", lambda: model_name_flood(url, stack.epp_metrics_url, 2000))
        await under("/metrics flood (4 loops)", lambda: thread(metrics_flood, stack.epp_metrics_url, seconds))

        async def stop_server() -> tuple[int, int]:
            os.kill(stack.processes["modelserver-1"].pid, signal.SIGSTOP)
            await asyncio.sleep(seconds)
            os.kill(stack.processes["modelserver-1"].pid, signal.SIGCONT)
            return 1, 1

        await under("model server stopped (SIGSTOP) for 4 s", stop_server, latency=False)

        async def kill_server() -> tuple[int, int]:
            stack.processes["modelserver-0"].send_signal(signal.SIGKILL)
            return 1, 1

        await under("model server killed", kill_server, latency=False)

        async def overload() -> tuple[int, int]:
            body = {"model": MODEL, "prompt": "long", "max_tokens": 300}
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

                async def one() -> bool:
                    async with session.post(url, json=body) as r:
                        return r.status == 200 or openai_shaped(await r.read())

                answers = await asyncio.gather(*(one() for _ in range(300)), return_exceptions=True)
            return 300, sum(a is True for a in answers)

        await under("overload (300 concurrent)", overload, latency=False)
    finally:
        pool.shutdown(cancel_futures=True)
        stack.stop()
    return ChaosReport(unloaded_p50 * 1e3, idle_rss, results)


RSS_GOAL_MB = 64  # the EPP's peak RSS above idle during an attack
LATENCY_GOAL = 3.0  # a well-behaved request's worst latency / its unloaded p50


def missed_goals(report: ChaosReport, r: AttackResult) -> list[str]:
    """The goals (the module's docstring) attack `r` missed, each with its numbers; empty when all are met."""
    missed = []
    if r.lost:
        missed.append(f"{r.lost} well-behaved request(s) lost")
    if r.peak_rss_mb > RSS_GOAL_MB:
        missed.append(f"RSS +{r.peak_rss_mb:.0f} MB > {RSS_GOAL_MB} MB")
    if r.answered_correctly != r.sent:
        missed.append(f"{r.sent - r.answered_correctly} of {r.sent} attacks not answered as they should be")
    limit = LATENCY_GOAL * report.unloaded_p50_ms
    if r.judged_on_latency and r.worst_ms > limit:
        missed.append(f"worst latency {r.worst_ms:.0f} ms > {LATENCY_GOAL:g}x unloaded p50 ({limit:.1f} ms)")
    return missed


def markdown(report: ChaosReport) -> str:
    limit = LATENCY_GOAL * report.unloaded_p50_ms
    lines = [
        f"host load (1/5/15 min): {' '.join(f'{v:.2f}' for v in os.getloadavg())}; well-behaved request "
        f"unloaded p50 {report.unloaded_p50_ms:.1f} ms (3x: {limit:.1f} ms); EPP idle RSS "
        f"{report.idle_rss_mb:.0f} MB",
        "",
        "| attack | sent | answered correctly | well-behaved lost / sent | EPP peak RSS above idle | worst latency "
        "| goals met |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report.results:
        missed = missed_goals(report, r)
        lines.append(
            f"| {r.attack} | {r.sent} | {r.answered_correctly} | {r.lost} / {r.probes} | "
            f"+{r.peak_rss_mb:.0f} MB | {r.worst_ms:.0f} ms | {'NO: ' + '; '.join(missed) if missed else 'yes'} |"
        )
    return "\n".join(lines)
