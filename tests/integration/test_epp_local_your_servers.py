"""`epp-local --model-server-url URL ...` (or `--pool-file`): the EPP and Envoy in front of model servers the user
already runs, starting none of its own; and the local Envoy bootstrap printed from the command line."""

import asyncio
import json
import signal
import subprocess
import sys
import time
import urllib.request

import aiohttp
import yaml
from aiohttp import web

from harness.local import LocalStack, StackConfig, main
from tests.conftest import free_port_block, free_ports


def wait_for(process: subprocess.Popen, text: str, timeout: float = 60) -> str:
    """The process's output up to the line holding `text`."""
    deadline, seen = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            raise AssertionError(f"exited with {process.wait()} before {text!r}:\n{''.join(seen)}")
        seen.append(line)
        if text in line:
            return "".join(seen)
    raise AssertionError(f"no {text!r} within {timeout} s:\n{''.join(seen)}")


def served(url: str) -> float:
    """Requests a model server answered with success (its vllm:request_success_total)."""
    page = urllib.request.urlopen(f"{url}/metrics", timeout=5).read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in page.splitlines() if line.startswith("vllm:request_success_total")
    )


def epp_local_ports() -> list[str]:
    grpc, health, metrics, listener, admin, kv_events = free_ports(6)
    return [
        *("--grpc-port", str(grpc), "--grpc-health-port", str(health), "--metrics-port", str(metrics)),
        *("--listener-port", str(listener), "--admin-port", str(admin), "--kv-events-port", str(kv_events)),
    ]


def test_epp_local_fronts_model_servers_it_did_not_start(tmp_path):
    base = free_port_block(2)
    urls = [f"http://127.0.0.1:{base + i}" for i in range(2)]
    servers = subprocess.Popen(
        [sys.executable, "-m", "modelserver", "--port", str(base), "--replicas", "2", "--served-model-name", "mine"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    stack = None
    try:
        wait_for(servers, f"ready on {urls[1]}")
        ports = epp_local_ports()
        listener = ports[ports.index("--listener-port") + 1]
        down = f"http://127.0.0.1:{free_ports(1)[0]}"  # one that is not running: named, and never routed to
        stack = subprocess.Popen(
            [
                *(sys.executable, "-m", "harness.local", *ports),
                *(a for u in [*urls, down] for a in ("--model-server-url", u)),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        started = wait_for(stack, "gateway ready")
        assert f"epp-local: warning: nothing answers at {down}" in started
        assert "starting the EPP and Envoy in front of 3 model servers" in started
        assert "model 'mine', no adapters" in started
        assert "the EPP reads the metrics of 2 of the 3 model servers; the others are not routed to" in wait_for(
            stack, "the EPP reads"
        )
        body = json.dumps({"model": "mine", "prompt": "hello", "max_tokens": 2}).encode()
        for _ in range(8):
            request = urllib.request.Request(
                f"http://127.0.0.1:{listener}/v1/completions", body, {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=30) as response:
                assert response.status == 200 and json.loads(response.read())["model"] == "mine"
        assert sum(served(u) for u in urls) == 8  # through the gateway, to the servers the test started
        stack.send_signal(signal.SIGINT)
        assert stack.wait(30) == 0
        assert servers.poll() is None  # epp-local stopped only what it started
    finally:
        for process in (stack, servers):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()


def test_the_local_envoy_bootstrap_is_printed(tmp_path, capsys):
    pool = tmp_path / "pool.yaml"
    pool.write_text(yaml.safe_dump({"endpoints": [{"address": "127.0.0.1", "port": 8123}]}))
    main(["--pool-file", str(pool), "--listener-port", "18081", "--grpc-port", "19002", "--print-envoy-config"])
    bootstrap = yaml.safe_load(capsys.readouterr().out)
    text = json.dumps(bootstrap)
    assert '"port_value": 18081' in text and '"port_value": 19002' in text  # the gateway, and the EPP it asks
    assert '"port_value": 8123' in text  # the pool (where FailOpen would route)
    main(["--print-envoy-config"])  # epp-local's own servers: their default ports
    assert '"port_value": 8003' in json.dumps(yaml.safe_load(capsys.readouterr().out))


def test_shadow_replicas_are_outside_envoys_epp_cluster_and_still_share():
    """With epp_shadows, Envoy sends ext_proc streams to the first replica only (and health-checks only it); the
    shadows still get their own ports and a place on the replica channel."""
    routed, shadowed = (
        LocalStack(StackConfig.on_free_ports(4, epp_replicas=3, epp_shadows=shadows)) for shadows in (False, True)
    )
    for stack in (routed, shadowed):
        assert len(stack.epp_ports) == 3 and len(stack.replica_ports) == 3
    grpc_ports = [grpc for grpc, _, _ in shadowed.epp_ports]
    everyone = json.dumps(yaml.safe_load(routed.envoy_bootstrap()))
    first_only = json.dumps(yaml.safe_load(shadowed.envoy_bootstrap()))
    assert all(f'"port_value": {port}' in everyone for port in [grpc for grpc, _, _ in routed.epp_ports])
    assert f'"port_value": {grpc_ports[0]}' in first_only
    assert not any(f'"port_value": {port}' in first_only for port in grpc_ports[1:])
    assert not any(f'"port_value": {health}' in first_only for _, health, _ in shadowed.epp_ports[1:])


async def test_a_pool_of_no_model_server_answers_503_not_the_servers_page(tmp_path):
    """A wrong port in the pool (a web server: 404 on /metrics, an HTML 501 for the request) is never routed to: the
    client gets the EPP's 503, not that server's page."""
    app = web.Application()

    async def page(request):
        return web.Response(status=404 if request.method == "GET" else 501, text="<html>no</html>")

    app.router.add_route("*", "/{tail:.*}", page)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_ports(1)[0]
    await web.TCPSite(runner, "127.0.0.1", port).start()
    pool = tmp_path / "pool.yaml"
    pool.write_text(yaml.safe_dump({"endpoints": [{"name": "web", "address": "127.0.0.1", "port": port}]}))
    grpc, health, metrics, listener, admin = free_ports(5)
    stack = LocalStack(
        StackConfig(
            model_server_pool=pool,
            grpc_port=grpc,
            grpc_health_port=health,
            metrics_port=metrics,
            listener_port=listener,
            admin_port=admin,
            kv_events_port=0,
            workdir=tmp_path,
        )
    )
    try:
        await stack.start()
        async with aiohttp.ClientSession() as session:
            await asyncio.sleep(0.3)  # a few scrapes
            body = {"model": "m", "prompt": "hello", "max_tokens": 2}
            async with session.post(f"{stack.gateway_url}/v1/completions", json=body) as response:
                assert response.status == 503, await response.text()
                assert "html" not in await response.text()
    finally:
        stack.stop()
        await runner.cleanup()
    # once per change of what it answered: a loaded machine can time the first scrape out before the 404s
    warnings = [
        line for line in (tmp_path / "epp.log").read_text().splitlines() if "has served no valid metrics" in line
    ]
    assert sum("HTTP 404" in line for line in warnings) == 1, warnings
