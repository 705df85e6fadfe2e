"""The EPP's gRPC health service reports SERVING for liveness, readiness and the ext_proc service."""

import asyncio
import subprocess
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.conftest import free_ports


async def test_health_services(tmp_path):
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
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        while b"epp ready" not in process.stdout.readline():
            assert process.poll() is None
        async with grpc.aio.insecure_channel(f"127.0.0.1:{health_port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
                response = await asyncio.wait_for(stub.Check(health_pb2.HealthCheckRequest(service=service)), 5)
                assert response.status == health_pb2.HealthCheckResponse.SERVING, service
    finally:
        process.terminate()
        assert process.wait(10) == 0


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
