"""Memory an attack made the EPP or the model server hold is given back when it ends, whichever port it came through:
400 unfinished 1 MiB request bodies straight to the EPP's ext_proc port (each stream's body buffered, most of them
answered 413 over --max-buffered-body-bytes), thousands of connections to the EPP's metrics and health ports and to
the model server's port that never finish a request head, unfinished request bodies to the model server, a pool
server publishing KV events faster than the EPP applies them. Once the attack ends, the process's RSS is within 64 MB
of idle."""

import contextlib
import json
import os
import resource
import socket
import subprocess
import time
import urllib.request

import msgspec
import zmq
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hpack import Encoder

from epp.transport.h2 import DATA, HEADERS, PREFACE, SETTINGS, frame, grpc_message
from harness.bench.chaos import REQUEST_HEADERS, rss_mb
from harness.local import epp_command, python_module, wait_until_serving
from tests.conftest import flood_batch, free_ports, metric_value


@contextlib.contextmanager
def idle_epp(tmp_path, kv_events_port: int = 0):
    """An EPP on a one-endpoint pool (127.0.0.1:1; its KV-event publisher at `kv_events_port`, 0: none), started and
    idle: (its process, its grpc, health and metrics ports)."""
    grpc, health, metrics = free_ports(3)
    pool = tmp_path / "pool.yaml"
    pool.write_text("endpoints:\n- {name: a, address: 127.0.0.1, port: 1}\n")
    log = tmp_path / "epp.log"
    argv = epp_command(str(pool), "127.0.0.1", grpc, health, metrics, kv_events_port)
    with log.open("wb") as out:
        epp = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONHASHSEED": "0"})
    try:
        wait_until_serving(epp, f"http://127.0.0.1:{metrics}/metrics", log)
        time.sleep(1)
        yield epp, grpc, health, metrics
    finally:
        epp.terminate()
        epp.wait(10)


@contextlib.contextmanager
def idle_model_server(tmp_path, *flags: str):
    """A sim model server, started and idle: (its process, its port)."""
    (port,) = free_ports(1)
    log = tmp_path / "modelserver.log"
    argv = [*python_module("modelserver"), "--port", str(port), "--disable-log-stats", *flags]
    with log.open("wb") as out:
        server = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until_serving(server, f"http://127.0.0.1:{port}/health", log)
        complete(port)  # the first request's imports and caches are part of idle
        time.sleep(1)
        yield server, port
    finally:
        server.terminate()
        server.wait(10)


def complete(port: int) -> None:
    body = json.dumps({"model": "sim-llama-8b", "prompt": "hello", "max_tokens": 2}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        assert answer.status == 200


@contextlib.contextmanager
def open_files_for(connections: int):
    """The soft limit on open files raised for this many connections and the servers this test starts (which inherit
    it): the number that fits, at most `connections`."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    fits = connections if hard == resource.RLIM_INFINITY else min(connections, hard - 256)
    if soft != resource.RLIM_INFINITY and soft < fits + 256:
        resource.setrlimit(resource.RLIMIT_NOFILE, (fits + 256, hard))
    try:
        yield fits
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def unfinished(port: int, head: bytes, count: int) -> list[socket.socket]:
    """`count` connections to `port`, each having sent `head` and nothing after."""
    attackers = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", port), timeout=2)
        with contextlib.suppress(OSError):  # refused (over the limit) as it sent, or it stopped reading
            s.sendall(head)
        attackers.append(s)
    return attackers


LONG_HEAD = b"".join(b"X-%d: %s\r\n" % (i, b"b" * 100) for i in range(60))  # 60 header lines, never the blank one


def attack_ends(process: subprocess.Popen, attackers: list[socket.socket], idle: float) -> tuple[float, float]:
    """The process's RSS with the `attackers`' connections open (a second after they were made), and after they
    closed: once it is within 64 MB of `idle`, or 10 s after."""
    time.sleep(1)
    during = rss_mb(process.pid)
    for s in attackers:
        s.close()
    deadline = time.monotonic() + 10
    while rss_mb(process.pid) > idle + 64 and time.monotonic() < deadline:
        time.sleep(0.2)
    return during, rss_mb(process.pid)


def test_rss_returns_to_idle_after_400_unfinished_1_mib_bodies(tmp_path):
    with idle_epp(tmp_path) as (epp, grpc, _, _):
        idle = rss_mb(epp.pid)
        body = grpc_message(pb.ProcessingRequest(request_body=pb.HttpBody(body=b"x" * (1 << 20))).SerializeToString())
        start = grpc_message(pb.ProcessingRequest(request_headers=pb.HttpHeaders()).SerializeToString())
        attackers = []
        for _ in range(40):  # 40 connections x 10 streams, none ever ending its body
            s = socket.create_connection(("127.0.0.1", grpc), timeout=2)
            s.sendall(PREFACE + frame(SETTINGS, 0, 0, b""))
            encoder = Encoder()
            try:
                for stream in range(1, 21, 2):
                    s.sendall(
                        frame(HEADERS, 0x4, stream, encoder.encode(REQUEST_HEADERS)) + frame(DATA, 0, stream, start)
                    )
                    for offset in range(0, len(body), 1 << 14):
                        s.sendall(frame(DATA, 0, stream, body[offset : offset + (1 << 14)]))
            except (TimeoutError, ConnectionError):
                pass  # the EPP stopped reading this connection (its limits): what it holds is what counts
            attackers.append(s)
        during, after = attack_ends(epp, attackers, idle)
        assert during > idle + 100, (idle, during)  # the attack did make it hold memory
        assert after <= idle + 64, (idle, during, after)


def test_rss_stays_near_idle_through_thousands_of_unfinished_heads_on_the_metrics_and_health_ports(tmp_path):
    """Before the ports had limits, 3,000 such connections to the metrics port left RSS 89 MB above idle after they
    closed (101 MB during), and 3,000 to the health port 56 MB; and every one held a file descriptor."""
    with open_files_for(3000) as connections, idle_epp(tmp_path) as (epp, _, health, metrics):  # well over 128
        idle = rss_mb(epp.pid)
        heads = {
            metrics: b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + LONG_HEAD,
            health: PREFACE + frame(SETTINGS, 0, 0, b"") + b"x" * 16384,
        }
        for port, head in heads.items():
            during, after = attack_ends(epp, unfinished(port, head, connections), idle)
            assert after <= idle + 64, (port, idle, during, after)
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5) as page:  # still serving
            assert b"inference_extension" in page.read()


def test_the_model_servers_rss_returns_near_idle_after_unfinished_heads_and_bodies(tmp_path):
    """Before its port had limits, 3,000 connections that never finished a request head left the model server 78 MB
    above idle after they closed, and 375 connections each sending 8 MiB of a body and never the rest took it from 55
    MB to 5.5 GB (265 MB after)."""
    budget = 64 << 20
    with (
        open_files_for(3000) as connections,
        idle_model_server(tmp_path, "--max-buffered-body-bytes", str(budget)) as (server, port),
    ):
        idle = rss_mb(server.pid)
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + LONG_HEAD
        during, after = attack_ends(server, unfinished(port, head, connections), idle)
        assert after <= idle + 64, ("heads", idle, during, after)
        body = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (8 << 20)
        during, after = attack_ends(server, unfinished(port, body + b" " * (1 << 20), 160), idle)
        assert idle + 40 < during < idle + budget / (1 << 20) + 64, ("bodies", idle, during)  # held, within budget
        assert after <= idle + 64, ("bodies", idle, during, after)
        complete(port)


def test_rss_stays_near_idle_while_a_server_publishes_kv_events_faster_than_they_are_applied(tmp_path):
    """The pool's server publishes batches of 24,000 blocks (2 MB each, under the message limit) as fast as it can
    for 4 s: the EPP queues only a few of them (TCP and the publisher hold the rest) and applies them as it can.
    With zmq's default queue (1,000 messages a socket) the EPP went from 84 to 1,679 MB."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 64)  # this process's own queue: what does not fit is dropped here (a gap there)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    message = msgspec.msgpack.encode(flood_batch(24_000))
    try:
        with idle_epp(tmp_path, kv_events_port=port) as (epp, _, _, metrics):
            idle = rss_mb(epp.pid)
            peak, seq, end = idle, 0, time.monotonic() + 4
            while time.monotonic() < end:
                pub.send_multipart([b"kv@127.0.0.1:1@m", seq.to_bytes(8, "big"), message])
                seq += 1
                if seq % 16 == 0:
                    peak = max(peak, rss_mb(epp.pid))
                    time.sleep(0.005)
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5) as page:
                applied = metric_value(page.read().decode(), "inference_extension_kv_events_batches_total")
            assert applied > 0, "no batch was applied: the flood tested nothing"
            assert peak <= idle + 96, (idle, peak, seq, applied)
            pub.close(linger=0)
            time.sleep(1)
            assert rss_mb(epp.pid) <= idle + 64, (idle, peak, rss_mb(epp.pid))
    finally:
        pub.close(linger=0)
        ctx.term()
