"""Memory an attack made the EPP hold is given back when it ends: 400 unfinished 1 MiB request bodies straight to
the ext_proc port (each stream's body buffered, most of them answered 413 over --max-buffered-body-bytes), then the
attacker's connections close: the EPP's RSS returns to within 64 MB of idle."""

import os
import socket
import subprocess
import time

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hpack import Encoder

from epp.transport.h2 import DATA, HEADERS, PREFACE, SETTINGS, frame, grpc_message
from harness.bench.chaos import REQUEST_HEADERS, rss_mb
from harness.local import epp_command, wait_until_serving
from tests.conftest import free_ports


def test_rss_returns_to_idle_after_400_unfinished_1_mib_bodies(tmp_path):
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
        time.sleep(1)
        during = rss_mb(epp.pid)
        for s in attackers:
            s.close()
        deadline = time.monotonic() + 10
        while rss_mb(epp.pid) > idle + 64 and time.monotonic() < deadline:
            time.sleep(0.2)
        after = rss_mb(epp.pid)
        assert during > idle + 100, (idle, during)  # the attack did make it hold memory
        assert after <= idle + 64, (idle, during, after)
    finally:
        epp.terminate()
        epp.wait(10)
