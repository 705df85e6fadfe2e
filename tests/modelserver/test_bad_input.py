"""Bad input never yields a 500 or a crash, and never disturbs other requests."""

import asyncio
import json

import aiohttp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.modelserver.conftest import MODEL, start_server

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats() | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=10,
)
FIELDS = ["model", "prompt", "messages", "max_tokens", "n", "stream", "stop", "temperature", "top_p", "seed",
          "stream_options", "logprobs", "max_completion_tokens", "min_tokens", "ignore_eos"]  # fmt: skip
bodies = st.fixed_dictionaries({"model": st.sampled_from([MODEL, "sql", "nope", 3])}, optional={
    f: json_values for f in FIELDS if f != "model"})  # fmt: skip


async def test_generated_bodies_never_500(tmp_path):
    running, runner = await start_server(tmp_path)
    url = running.url
    try:
        async with aiohttp.ClientSession() as session:
            background = asyncio.create_task(
                session.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "steady", "max_tokens": 200})
            )
            statuses = []

            @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
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
        await runner.cleanup()
        await running.engine.stop()


async def post(session, url, body) -> int:
    async with session.post(url, data=json.dumps(body, allow_nan=True)) as response:
        payload = await response.read()
        if response.status != 200:
            error = json.loads(payload)["error"]
            assert set(error) == {"message", "type", "param", "code"}
        return response.status


async def test_raw_garbage_bodies(model_server):
    url = model_server.url
    cases = [b"", b"{", b"\xff\xfe\xfd", b'{"model": "\xff"}', b"[]", b"null", b'{"model": "sim-model", "prompt": "\\ud800"}',
             b'{"model": "sim-model", "prompt": "x", "max_tokens": 1e400}',
             b'{"model": "sim-model", "prompt": "x", "max_tokens": 99999999999999999999999999}',
             b'{"model": "sim-model", "prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
             b'{"messages": [{"role": "user", "content": ' + b"{\"a\": " * 10_000 + b"1" + b"}" * 10_000 + b"}]}"]  # fmt: skip
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
    running, runner = await start_server(tmp_path)
    try:
        running.engine.is_dead = True
        async with aiohttp.ClientSession() as session:
            body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
            async with session.post(f"{running.url}/v1/completions", json=body) as r:
                assert r.status == 503
            async with session.get(f"{running.url}/health") as r:
                assert r.status == 503
    finally:
        await runner.cleanup()
        await running.engine.stop()
