"""The EPP's gRPC health service reports SERVING for liveness, readiness and the ext_proc service; on SIGTERM the
EPP drains: not ready, no new connection, the streams in flight finish, and it exits within --drain-timeout."""

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.conftest import free_ports
from tests.epp.test_transports import headers

DRAIN_TIMEOUT = 3.0


def refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False


@pytest.mark.timing  # it exits within --drain-timeout (plus the rest of its stop)
async def test_health_services_then_a_drain_on_sigterm(tmp_path):
    pool = tmp_path / "pool.yaml"
    pool.write_text("endpoints: [{address: 127.0.0.1, port: 1}]\n")
    grpc_port, health_port, metrics_port = free_ports(3)
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "epp",
            "--pool-file",
            str(pool),
            "--bind-address",
            "127.0.0.1",
            "--grpc-port",
            str(grpc_port),
            "--grpc-health-port",
            str(health_port),
            "--metrics-port",
            str(metrics_port),
            "--kv-events-port",
            "0",
            "--drain-timeout",
            f"{DRAIN_TIMEOUT}s",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        while b"epp ready" not in process.stdout.readline():
            assert process.poll() is None
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{health_port}") as channel,
            grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as ext_proc,
        ):
            stub = health_pb2_grpc.HealthStub(channel)

            async def status(service: str) -> int:
                response = await asyncio.wait_for(stub.Check(health_pb2.HealthCheckRequest(service=service)), 5)
                return response.status

            for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
                assert await status(service) == health_pb2.HealthCheckResponse.SERVING, service
            # two requests in flight: one finishes during the drain, the other never does
            finishing, hanging = pb_grpc.ExternalProcessorStub(ext_proc).Process(), None
            await finishing.write(headers())
            hanging = pb_grpc.ExternalProcessorStub(ext_proc).Process()
            await hanging.write(headers())
            await asyncio.sleep(0.2)  # both reached the EPP
            process.send_signal(signal.SIGTERM)
            began = time.monotonic()
            while await status("readiness") != health_pb2.HealthCheckResponse.NOT_SERVING:
                await asyncio.sleep(0.05)
            assert (
                await status("envoy.service.ext_proc.v3.ExternalProcessor")
                == health_pb2.HealthCheckResponse.NOT_SERVING
            )
            assert await status("liveness") == health_pb2.HealthCheckResponse.SERVING  # draining, not dead
            while not refused(grpc_port):  # a new connection goes to another replica (the listener closes next)
                assert time.monotonic() - began < DRAIN_TIMEOUT
                await asyncio.sleep(0.05)
            body = json.dumps({"model": "m", "prompt": "hello"}).encode()
            await finishing.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
            answers = [(await asyncio.wait_for(finishing.read(), 5)).WhichOneof("response") for _ in range(2)]
            assert answers == ["request_headers", "immediate_response"]  # answered (503: port 1 serves nothing)
            await finishing.done_writing()
            assert await finishing.code() == grpc.StatusCode.OK
            assert process.poll() is None  # the other stream is still open
            returncode = await asyncio.to_thread(process.wait, DRAIN_TIMEOUT + 10)
            took = time.monotonic() - began
        assert returncode == 0 and DRAIN_TIMEOUT - 0.5 < took < DRAIN_TIMEOUT + 5, took
    finally:
        process.terminate()
        process.wait(10)


def test_bad_flags_and_config_fail_clearly(tmp_path):
    result = subprocess.run([sys.executable, "-m", "epp"], capture_output=True, text=True, timeout=30)
    assert result.returncode != 0 and "--pool-file" in result.stderr
    pool = tmp_path / "pool.yaml"
    pool.write_text("endpoints: []\n")
    result = subprocess.run(
        [sys.executable, "-m", "epp", "--pool-file", str(pool), "--config-text", "plugins: [{type: nope}]"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode != 0 and "unsupported plugin type(s) nope" in result.stderr
