"""The Model Server Protocol suite: all checks pass against our server, sim and torch backends (console script,
report YAML, pytest plugin), and a server that breaks the protocol fails the right MUST checks."""

import contextlib
import json
import subprocess
import sys
import time

import pytest
import yaml
from aiohttp import web

from tests.conftest import free_ports

FAST = ["--sim-decode-base", "0.002", "--sim-prefill-time-per-token", "0.00001", "--sim-prefill-overhead", "0.001"]
SERVER = ["--disable-log-stats", "--enable-lora", "--max-loras", "1", "--max-num-seqs", "8"]


@contextlib.contextmanager
def model_server(*args: str):
    (port,) = free_ports(1)
    process = subprocess.Popen(
        [sys.executable, "-m", "modelserver", "--port", str(port), *SERVER, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        lines = []
        while not (line := process.stdout.readline().decode()).startswith("ready on"):
            assert line, "the server exited: " + "".join(lines)
            lines.append(line)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(10)


@pytest.fixture
def sim_server():
    with model_server("--lora-modules", "sql=/adapters/sql", "chat=/adapters/chat", *FAST) as url:
        yield url


@pytest.fixture(params=["sim", "torch"])
def our_server(request, tmp_path):
    if request.param == "sim":
        with model_server("--lora-modules", "sql=/adapters/sql", "chat=/adapters/chat", *FAST) as url:
            yield url
        return
    pytest.importorskip("torch")
    from modelserver.torch.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny", lora_names=["sql", "chat"])
    with model_server(
        "--backend",
        "torch",
        "--model",
        str(model),
        "--served-model-name",
        "tiny",
        "--device",
        "cpu",
        "--num-gpu-blocks",
        "512",
        "--lora-modules",
        f"sql={model}/loras/sql",
        f"chat={model}/loras/chat",
    ) as url:
        yield url


def test_our_server_conforms(our_server, tmp_path):
    report = tmp_path / "report.yaml"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "protocol.conformance",
            "--url",
            our_server,
            "--lora-adapter",
            "sql",
            "--lora-adapter",
            "chat",
            "--load-requests",
            "8",
            "--report",
            str(report),
            "--project",
            "llm-routing-reference",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith(("PASS", "FAIL", "SKIP"))]
    assert len(lines) == 17 and all(line.startswith("PASS") for line in lines), result.stdout
    parsed = yaml.safe_load(report.read_text())
    assert parsed["kind"] == "ConformanceReport" and parsed["GatewayAPIInferenceExtensionVersion"].startswith("v")
    assert parsed["implementation"]["project"] == "llm-routing-reference"
    profile = parsed["profiles"][0]
    assert profile["name"] == "ModelServerProtocol"
    assert profile["core"] == {"result": "success", "statistics": {"Failed": 0, "Passed": 14, "Skipped": 0}}
    assert profile["extended"]["statistics"]["Passed"] == 3


def test_pytest_plugin_runs_every_check_with_the_servers_adapters(sim_server):
    # no --msp-lora-adapter: the adapters the server lists in /v1/models are used, so no LoRA check is skipped;
    # and the load checks get an unlimited connection pool, like the CLI (with aiohttp's default of 100 the
    # waiting-queue checks crawled: 103 s against 11 s)
    started = time.monotonic()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "protocol.conformance.pytest_plugin",
            "--msp-url",
            sim_server,
            "--msp-load-requests",
            "8",
            "--pyargs",
            "protocol.conformance.test_msp",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "17 passed" in result.stdout and "skipped" not in result.stdout, result.stdout
    assert time.monotonic() - started < 60


async def broken_server() -> tuple[web.AppRunner, str]:
    """Answers completions, but breaks the protocol four ways: 500 for an unknown model, KV usage in percent,
    no blank line between SSE events, and a `model` field that is not the requested one."""

    async def completions(request):
        body = await request.json()
        if body.get("model") != "m":
            return web.Response(status=500, text="boom")
        choice = {"text": "x", "finish_reason": "length"}
        if body.get("stream"):
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(f"data: {json.dumps({'object': 'text_completion', 'choices': [choice]})}\n".encode())
            await response.write(b"data: [DONE]\n\n")
            return response
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        return web.json_response(
            {
                "id": "c",
                "created": 1,
                "model": "other",
                "object": "text_completion",
                "choices": [choice],
                "usage": usage,
            }
        )

    async def metrics(request):
        return web.Response(
            text="# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0\n"
            "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 55\n"
        )

    async def models(request):
        return web.json_response({"data": [{"id": "m"}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    (port,) = free_ports(1)
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def test_a_broken_server_fails_must_checks():
    import aiohttp

    from protocol.conformance.framework import Outcome
    from protocol.conformance.msp import Target, suite

    runner, url = await broken_server()
    checks = {"completions", "completions-streaming", "unknown-model", "metrics-gauges", "lora-served"}
    try:
        async with aiohttp.ClientSession() as session:
            results = await suite.run(Target(url, "m", session=session), checks)
    finally:
        await runner.cleanup()
    outcomes = {r.check.name: (r.outcome, r.message) for r in results}
    assert outcomes["completions"] == (Outcome.FAIL, "model is 'other', not 'm'")
    assert outcomes["completions-streaming"][0] is Outcome.FAIL
    assert "not one JSON object" in outcomes["completions-streaming"][1]
    assert outcomes["unknown-model"] == (Outcome.FAIL, "unknown model answered 500")
    assert outcomes["metrics-gauges"] == (Outcome.FAIL, "KV usage [55.0] is not a fraction in [0, 1]")
    assert outcomes["lora-served"] == (
        Outcome.SKIP,
        "the server lists no LoRA adapter in /v1/models and none was given (--lora-adapter)",
    )
