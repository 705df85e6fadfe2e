"""`epp --pool-name` end to end: two EPP replicas discover a sim model server through the (local) Kubernetes API,
scrape it, and only the Lease holder reports ready."""

import asyncio
import contextlib
import subprocess
import sys
import time

import aiohttp
import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.conftest import free_ports
from tests.kubernetes.test_discovery import NS, pod, pool


async def readiness(port: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="readiness"))
        return response.status


def write_kubeconfig(tmp_path, api):
    """A kubeconfig for the `epp` process that points at the local API server."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "local",
                "clusters": [{"name": "local", "cluster": {"server": api.configuration.host}}],
                "contexts": [{"name": "local", "context": {"cluster": "local", "user": "u", "namespace": NS}}],
                "users": [{"name": "u", "user": {"token": "test"}}],
            }
        )
    )
    return kubeconfig


async def test_epp_replicas_discover_and_elect(apiserver, tmp_path):
    server, api = apiserver
    kubeconfig = write_kubeconfig(tmp_path, api)
    (model_port,) = free_ports(1)
    model = subprocess.Popen(
        [sys.executable, "-m", "modelserver", "--port", str(model_port), "--disable-log-stats"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    server.apply("inferencepools", pool(ports=(model_port,)))
    server.apply("pods", pod("ms-0", "127.0.0.1"))
    replicas = []
    try:
        for index in range(2):
            grpc_port, health_port, metrics_port = free_ports(3)
            log = (tmp_path / f"epp-{index}.log").open("wb")
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "epp",
                    "--pool-name",
                    "pool",
                    "--pool-namespace",
                    NS,
                    "--kubeconfig",
                    str(kubeconfig),
                    "--ha-enable-leader-election",
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
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
            log.close()  # the child holds its own descriptor
            replicas.append((process, health_port, metrics_port))
        async with aiohttp.ClientSession() as session:
            deadline = time.monotonic() + 60  # the replicas start side by side: slow on a loaded 2-core machine
            for _, _, metrics_port in replicas:
                while time.monotonic() < deadline:
                    try:
                        async with session.get(f"http://127.0.0.1:{metrics_port}/metrics") as r:
                            if 'inference_pool_ready_pods{name="pool"} 1.0' in await r.text():
                                break
                    except aiohttp.ClientError:
                        pass
                    await asyncio.sleep(0.1)
                else:
                    raise AssertionError("the EPP never saw the model server as a ready endpoint")
        statuses = []
        for _ in range(50):
            statuses = [await readiness(health) for _, health, _ in replicas]
            if statuses.count(health_pb2.HealthCheckResponse.SERVING) == 1:
                break
            await asyncio.sleep(0.1)
        assert sorted(statuses) == sorted(
            [health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING]
        )
        assert server.objects["leases"]["pool-epp"]["spec"]["holderIdentity"]
    finally:
        for process, _, _ in replicas:
            process.terminate()
        for process, _, _ in replicas:  # waited for off the loop: the leader releases its Lease through our server
            try:
                await asyncio.to_thread(process.wait, 10)
            except subprocess.TimeoutExpired:
                process.kill()
                raise
        logs = "\n".join(path.read_text() for path in sorted(tmp_path.glob("epp-*.log")))
        assert not server.objects["leases"]["pool-epp"]["spec"].get("holderIdentity"), (
            f"the leader kept the Lease:\n{logs}"
        )
        model.terminate()
        model.wait(10)


async def test_readiness_waits_for_the_pool_to_be_listed(apiserver, tmp_path):
    server, api = apiserver
    kubeconfig = write_kubeconfig(tmp_path, api)
    server.apply("inferencepools", pool())
    server.fail_requests = 10**9  # nothing can be listed yet
    grpc_port, health_port, metrics_port = free_ports(3)
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "epp",
            "--pool-name",
            "pool",
            "--pool-namespace",
            NS,
            "--kubeconfig",
            str(kubeconfig),
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
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        statuses = []
        started = time.monotonic()
        # up, answering probes (its start took over 4 s on 2 cores busy with the suite's other workers), but not
        # ready: its pool is unknown
        while len(statuses) < 20:
            assert time.monotonic() - started < 60, "the EPP never answered its readiness probe"
            with contextlib.suppress(grpc.aio.AioRpcError):  # (not listening yet)
                statuses.append(await readiness(health_port))
            await asyncio.sleep(0.1)
        assert set(statuses) == {health_pb2.HealthCheckResponse.NOT_SERVING}
        server.fail_requests = 0
        for _ in range(50):
            if await readiness(health_port) == health_pb2.HealthCheckResponse.SERVING:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("not ready after the pool was listed")
    finally:
        process.terminate()
        await asyncio.to_thread(process.wait, 10)
