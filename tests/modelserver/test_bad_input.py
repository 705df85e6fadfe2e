"""Bad input never yields a 500 or a crash, and never disturbs other requests."""

import asyncio
import json
import time

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import read_response
from tests.modelserver.conftest import MODEL, start_server

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats() | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=10,
)
FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "n",
    "stream",
    "stop",
    "temperature",
    "top_p",
    "seed",
    "stream_options",
    "logprobs",
    "max_completion_tokens",
    "min_tokens",
    "ignore_eos",
]
bodies = st.fixed_dictionaries(
    {"model": st.sampled_from([MODEL, "sql", "nope", 3])}, optional={f: json_values for f in FIELDS if f != "model"}
)


async def test_generated_bodies_never_500(tmp_path):
    running = await start_server(tmp_path)
    url = running.url
    try:
        async with aiohttp.ClientSession() as session:
            background = asyncio.create_task(
                session.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "steady", "max_tokens": 200})
            )
            statuses = []

            @settings(max_examples=120, suppress_health_check=list(HealthCheck))
            @given(body=bodies, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
            def probe(body, path):
                body = {**body, "max_tokens": 3} if isinstance(body.get("max_tokens"), int) else body
                if body.get("n") and isinstance(body["n"], int) and body["n"] > 4:
                    body["n"] = 4
                statuses.append(asyncio.run_coroutine_threadsafe(post(session, url + path, body), loop).result(30))

            loop = asyncio.get_running_loop()
            await asyncio.to_thread(probe)
            assert 500 not in statuses and all(s in (200, 400, 404) for s in statuses), sorted(set(statuses))
            response = await background
            assert response.status == 200
            assert (await response.json())["usage"]["completion_tokens"] == 200
            async with session.get(f"{url}/health") as r:
                assert r.status == 200
    finally:
        await running.stop()


async def post(session, url, body) -> int:
    async with session.post(url, data=json.dumps(body, allow_nan=True)) as response:
        payload = await response.read()
        if response.status != 200:
            error = json.loads(payload)["error"]
            assert set(error) == {"message", "type", "param", "code"}
        return response.status


async def test_raw_garbage_bodies(model_server):
    url = model_server.url
    cases = [
        b"",
        b"{",
        b"\xff\xfe\xfd",
        b'{"model": "\xff"}',
        b"[]",
        b"null",
        b'{"model": "sim-model", "prompt": "\\ud800"}',
        b'{"model": "sim-model", "prompt": "x", "max_tokens": 1e400}',
        b'{"model": "sim-model", "prompt": "x", "max_tokens": 99999999999999999999999999}',
        b'{"model": "sim-model", "prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
        b'{"messages": [{"role": "user", "content": ' + b'{"a": ' * 10_000 + b"1" + b"}" * 10_000 + b"}]}",
    ]
    async with aiohttp.ClientSession() as session:
        for body in cases:
            for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
                async with session.post(f"{url}{path}", data=body) as r:
                    assert r.status in (200, 400, 404), (body[:80], path, r.status, (await r.text())[:300])
                    if r.status != 200:
                        assert (await r.json())["error"]["message"]
        async with session.post(f"{url}/v1/completions", data=b"x" * (3 * 1024 * 1024)) as r:
            assert r.status == 413
            assert (await r.json())["error"]["message"]
        async with session.get(f"{url}/health") as r:
            assert r.status == 200


async def test_dead_engine_answers_503(tmp_path):
    running = await start_server(tmp_path)
    try:
        running.engine.is_dead = True
        async with aiohttp.ClientSession() as session:
            body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
            async with session.post(f"{running.url}/v1/completions", json=body) as r:
                assert r.status == 503
            async with session.get(f"{running.url}/health") as r:
                assert r.status == 503
    finally:
        await running.stop()


async def test_an_adapter_whose_files_are_gone_fails_its_request_alone(tmp_path):
    running = await start_server(tmp_path)
    executor = running.engine.executor

    def load_lora(slot, name, path):
        raise FileNotFoundError(f"{path}/adapter_model.safetensors")

    executor.load_lora = load_lora
    try:
        async with aiohttp.ClientSession() as session:
            body = {"model": "sql", "prompt": "x", "max_tokens": 2}
            for stream in (False, True):
                async with session.post(f"{running.url}/v1/completions", json={**body, "stream": stream}) as r:
                    assert r.status == 400, await r.text()
                    assert "loading LoRA adapter 'sql' failed" in (await r.json())["error"]["message"]
            async with session.get(f"{running.url}/health") as r:
                assert r.status == 200
            async with session.post(f"{running.url}/v1/completions", json={**body, "model": MODEL}) as r:
                assert r.status == 200
    finally:
        await running.stop()


async def test_bad_lora_paths_are_400(model_server, tmp_path):
    async with aiohttp.ClientSession() as session:
        root = tmp_path / "loras"
        for path, status in [(f"{root}/a\x00b", 400), (f"{root}/" + "x" * 5000, 400), (f"{root}/missing", 404)]:
            body = {"lora_name": "new", "lora_path": path}
            async with session.post(f"{model_server.url}/v1/load_lora_adapter", json=body) as r:
                assert r.status == status, (path[:40], await r.text())
                assert len((await r.json())["error"]["message"]) < 400


@pytest.mark.timing
async def test_oversized_prompts_are_rejected_before_tokenizing_and_metrics_never_wait(tmp_path):
    running = await start_server(tmp_path, max_request_body_bytes=64 * 1024 * 1024)
    url = running.url
    try:
        async with aiohttp.ClientSession() as session:

            async def metrics_latency() -> float:
                started = time.monotonic()
                async with session.get(f"{url}/metrics") as r:
                    assert r.status == 200
                    await r.read()
                return time.monotonic() - started

            huge = {"model": MODEL, "prompt": "word " * 1_000_000, "max_tokens": 2}  # 5 MB
            started = time.monotonic()
            async with session.post(f"{url}/v1/completions", json=huge) as r:
                assert r.status == 400
                assert "maximum context length" in (await r.json())["error"]["message"]
            assert time.monotonic() - started < 1.0  # tokenizing it took seconds

            # within the bound but long: tokenized in worker threads while /metrics keeps answering. One takes
            # 24-40 ms to tokenize here, so 48 of them on the event loop would hold /metrics for over a second; in
            # threads the loop still shares 2 cores with them and a loaded machine (a 0.1 s bound failed at 0.104 s in a
            # CI run, 0.3 s at 0.445 s beside the whole suite): half of what tokenizing on the loop would hold it
            long_prompt = {
                "model": MODEL,
                "prompt": "The quick brown fox jumps over the lazy dog. " * 1100,
                "max_tokens": 2,
            }
            posts = [asyncio.create_task(session.post(f"{url}/tokenize", json=long_prompt)) for _ in range(48)]
            worst = max([await metrics_latency() for _ in range(10)])
            for post in posts:
                async with await post as r:
                    assert r.status in (200, 400)
            assert worst < 0.6, worst
    finally:
        await running.stop()


async def test_sequences_per_request_are_bounded(model_server):
    async with aiohttp.ClientSession() as session:
        body = {"model": MODEL, "prompt": ["a"] * 500, "n": 128, "max_tokens": 2}
        async with session.post(f"{model_server.url}/v1/completions", json=body) as r:
            assert r.status == 400
            error = (await r.json())["error"]
            assert "64000 sequences" in error["message"] and error["param"] == "n"
        body = {"model": MODEL, "prompt": ["a"] * 2, "n": 4, "max_tokens": 2}
        async with session.post(f"{model_server.url}/v1/completions", json=body) as r:
            assert r.status == 200 and len((await r.json())["choices"]) == 8


async def test_request_bodies_are_bounded_in_size_pace_and_all_together(tmp_path, monkeypatch):
    """A body is read within --max-request-body-bytes (413, declared or chunked), within BODY_SECONDS (408), and counted
    as it arrives against --max-buffered-body-bytes, which all connections share (503 to the one that would go over
    it, while a small request goes on); what a body held is let go however it ended."""
    from modelserver.api import server as api

    monkeypatch.setattr(api, "BODY_SECONDS", 0.5)
    running = await start_server(tmp_path, max_request_body_bytes=2 << 20, max_buffered_body_bytes=3 << 20)
    host, port = running.url.removeprefix("http://").split(":")

    async def unfinished(declared: int, sent: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % declared)
        writer.write(b" " * sent)
        await writer.drain()
        return reader, writer

    async def answer(reader: asyncio.StreamReader) -> tuple[bytes, dict]:
        status, headers, body = await read_response(reader)
        return status, {**headers, "error": json.loads(body)["error"]["message"]}

    try:
        first = await unfinished(2 << 20, (2 << 20) - 1)  # holds 2 MiB of the 3
        await asyncio.sleep(0.1)
        assert running.server.bodies.held == (2 << 20) - 1
        second_reader, _second = await unfinished(2 << 20, (2 << 20) - 1)
        status, headers = await answer(second_reader)
        assert status == b"HTTP/1.1 503 Service Unavailable" and headers["retry-after"] == "1", headers
        async with aiohttp.ClientSession() as session:
            body = {"model": MODEL, "prompt": "small", "max_tokens": 2}
            async with session.post(f"{running.url}/v1/completions", json=body) as r:
                assert r.status == 200  # a body that fits goes on beside them
            status, headers = await answer(first[0])  # the first never ended its body: timed out
            assert status == b"HTTP/1.1 408 Request Timeout" and "not received within" in headers["error"]

            async def chunks():
                for _ in range(3):
                    yield b" " * (1 << 20)

            async with session.post(f"{running.url}/v1/completions", data=chunks()) as r:  # chunked, no length
                assert r.status == 413
            async with session.post(f"{running.url}/v1/completions", data=b" " * (3 << 20)) as r:  # declared
                assert r.status == 413
        assert running.server.bodies.held == 0
        assert running.server.bodies_refused.count == running.server.bodies_late.count == 1
    finally:
        await running.stop()
