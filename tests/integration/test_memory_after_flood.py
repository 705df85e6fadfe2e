"""Memory an attack made the EPP hold is given back when it ends, whichever port it came through: 400 unfinished 1 MiB
request bodies straight to the ext_proc port (each stream's body buffered, most of them answered 413 over
--max-buffered-body-bytes), thousands of connections to the metrics and health ports that never finish a request
head. Once the attackers' connections close, the EPP's RSS is within 64 MB of idle."""

import contextlib
import os
import resource
import socket
import subprocess
import time
import urllib.request

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hpack import Encoder

from epp.transport.h2 import DATA, HEADERS, PREFACE, SETTINGS, frame, grpc_message
from harness.bench.chaos import REQUEST_HEADERS, rss_mb
from harness.local import epp_command, wait_until_serving
from tests.conftest import free_ports


@contextlib.contextmanager
def idle_epp(tmp_path):
    """An EPP on a one-endpoint pool, started and idle: (its process, its grpc, health and metrics ports)."""
    grpc, health, metrics = free_ports(3)
    pool = tmp_path / "pool.yaml"
    pool.write_text("endpoints:\n- {name: a, address: 127.0.0.1, port: 1}\n")
    log = tmp_path / "epp.log"
    argv = epp_command(str(pool), "127.0.0.1", grpc, health, metrics, 0)
    with log.open("wb") as out:
        epp = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONHASHSEED": "0"})
    try:
        wait_until_serving(epp, f"http://127.0.0.1:{metrics}/metrics", log)
        time.sleep(1)
        yield epp, grpc, health, metrics
    finally:
        epp.terminate()
        epp.wait(10)


def attack_ends(epp: subprocess.Popen, attackers: list[socket.socket], idle: float) -> tuple[float, float]:
    """The EPP's RSS with the `attackers`' connections open (a second after they were made), and after they closed:
    once it is within 64 MB of `idle`, or 10 s after."""
    time.sleep(1)
    during = rss_mb(epp.pid)
    for s in attackers:
        s.close()
    deadline = time.monotonic() + 10
    while rss_mb(epp.pid) > idle + 64 and time.monotonic() < deadline:
        time.sleep(0.2)
    return during, rss_mb(epp.pid)


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
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    connections = 3000 if hard == resource.RLIM_INFINITY else min(3000, hard - 256)  # well over the ports' 128
    if soft != resource.RLIM_INFINITY and soft < connections + 256:
        resource.setrlimit(resource.RLIMIT_NOFILE, (connections + 256, hard))  # the EPP inherits it
    try:
        with idle_epp(tmp_path) as (epp, _, health, metrics):
            idle = rss_mb(epp.pid)
            heads = {
                metrics: b"GET /metrics HTTP/1.1\r\nHost: x\r\n"
                + b"".join(b"X-%d: %s\r\n" % (i, b"b" * 100) for i in range(60)),
                health: PREFACE + frame(SETTINGS, 0, 0, b"") + b"x" * 16384,
            }
            for port, head in heads.items():
                attackers = []
                for _ in range(connections):
                    s = socket.create_connection(("127.0.0.1", port), timeout=2)
                    with contextlib.suppress(OSError):  # refused (over the limit) as it sent
                        s.sendall(head)
                    attackers.append(s)
                during, after = attack_ends(epp, attackers, idle)
                assert after <= idle + 64, (port, idle, during, after)
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5) as page:  # still serving
                assert b"inference_extension" in page.read()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
