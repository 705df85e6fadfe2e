"""The Model Server Protocol suite: all checks pass against our server's sim backend (console script, report YAML,
pytest plugin; the torch backend's run is in tests/modelserver/torch/test_server.py), a server that breaks the
protocol fails the right MUST checks, and a KV event publisher with gaps and broken parent chains fails the KV event
checks."""

import json
import subprocess
import sys
import time

import msgspec
import pytest
import zmq
from aiohttp import web

from protocol.kv_events import BlockStored, KVEventBatch
from tests.conformance.helpers import FAST, model_server, run_the_whole_suite
from tests.conftest import free_ports

SIM = ["--lora-modules", "sql=/adapters/sql", "chat=/adapters/chat", "--num-gpu-blocks", "1024", *FAST]


@pytest.fixture
def sim_server():
    with model_server(*SIM) as served:
        yield served


def test_our_server_conforms(sim_server, tmp_path):
    run_the_whole_suite(sim_server, tmp_path / "report.yaml")


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
            "harness.conformance.pytest_plugin",
            "--msp-url",
            sim_server.url,
            *sim_server.plugin_options(),
            "--msp-load-requests",
            "8",
            "--pyargs",
            "harness.conformance.test_msp",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "26 passed" in result.stdout and "skipped" not in result.stdout, result.stdout
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

    from harness.conformance.framework import Outcome
    from harness.conformance.msp import Target, suite

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


GAUGES = "vllm:num_requests_waiting 0\nvllm:num_requests_running 0\nvllm:kv_cache_usage_perc 0.5\n"


@pytest.mark.parametrize(
    "answer, outcome, message",
    [
        (web.Response(text=GAUGES), "PASS", ""),
        (web.Response(text=GAUGES + "vllm:prompt_tokens_total 9\n"), "FAIL", "name[] is ignored"),
        (web.Response(status=400), "FAIL", "answered 400: the EPP falls back to whole pages"),
        (web.Response(text="# nothing\n"), "FAIL", "the filtered page does not read"),
    ],
    ids=["filters", "ignores", "refuses", "misreads"],
)
async def test_the_sample_filter_check_tells_what_the_epps_scrapes_will_get(answer, outcome, message):
    import aiohttp

    from harness.conformance.msp import Target, suite

    async def metrics(request):
        return answer if "name[]" in request.query else web.Response(text=GAUGES + "vllm:prompt_tokens_total 9\n")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    (port,) = free_ports(1)
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with aiohttp.ClientSession() as session:
            (result,) = await suite.run(
                Target(f"http://127.0.0.1:{port}", "m", session=session), {"metrics-sample-filter"}
            )
    finally:
        await runner.cleanup()
    assert result.outcome.name == outcome and message in (result.message or ""), result


async def broken_kv_publisher() -> tuple[web.AppRunner, zmq.Socket, str, str]:
    """A server whose KV events break vLLM's protocol two ways: each block's parent is not the block before it, and
    every batch skips a sequence number. Tokens are the prompt's bytes, blocks of 16."""
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind("tcp://127.0.0.1:*")
    seq = 0

    async def tokenize(request):
        return web.json_response({"tokens": list((await request.json())["prompt"].encode())})

    async def completions(request):
        nonlocal seq
        tokens = list((await request.json())["prompt"].encode())
        blocks = len(tokens) // 16
        hashes = [hash((seq, i)) & (2**64 - 1) for i in range(blocks)]
        events = [
            BlockStored([h], 12345 if i else None, tokens[i * 16 : (i + 1) * 16], 16, None, "GPU")
            for i, h in enumerate(hashes)
        ]
        pub.send_multipart([b"kv@broken@m", seq.to_bytes(8, "big"), msgspec.msgpack.encode(KVEventBatch(0.0, events))])
        seq += 2
        usage = {"prompt_tokens": len(tokens), "completion_tokens": 1, "total_tokens": len(tokens) + 1}
        choice = {"text": "x", "finish_reason": "length"}
        return web.json_response(
            {"id": "c", "created": 1, "model": "m", "object": "text_completion", "choices": [choice], "usage": usage}
        )

    async def metrics(request):
        return web.Response(text="")

    app = web.Application()
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    (port,) = free_ports(1)
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, pub, f"http://127.0.0.1:{port}", pub.getsockopt_string(zmq.LAST_ENDPOINT)


async def test_a_broken_kv_event_publisher_fails_the_kv_event_checks():
    import aiohttp

    from harness.conformance.framework import Outcome
    from harness.conformance.msp import KVEventsTarget, Target, suite

    runner, pub, url, endpoint = await broken_kv_publisher()
    checks = {c.name for c in suite.checks if c.name.startswith("kv-events")}
    try:
        async with aiohttp.ClientSession() as session:
            results = await suite.run(Target(url, "m", session=session, kv=KVEventsTarget(endpoint)), checks)
            unconfigured = await suite.run(Target(url, "m", session=session), checks)
    finally:
        await runner.cleanup()
        pub.close(linger=0)
    outcomes = {r.check.name: (r.outcome, r.message) for r in results}
    stored, gapless = outcomes["kv-events-stored"], outcomes["kv-events-gapless"]
    assert stored[0] is Outcome.FAIL and stored[1].startswith("block 1 of the prompt was stored with parent 12345,")
    assert gapless[0] is Outcome.FAIL and gapless[1].startswith("sequence numbers jump: kv@broken@m:")
    assert outcomes["kv-events-block-hashes"][0] is Outcome.SKIP  # no PYTHONHASHSEED given
    assert outcomes["kv-events-replay"][0] is Outcome.SKIP  # no replay endpoint
    assert outcomes["kv-events-removed"][0] is Outcome.SKIP  # no cache_config_info
    assert outcomes["kv-events-cleared"][0] is Outcome.SKIP  # no /reset_prefix_cache
    assert {r.outcome for r in unconfigured} == {Outcome.SKIP}
