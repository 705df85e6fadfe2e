"""The OpenAI API over HTTP, with the real OpenAI SDK as the client."""

import asyncio
import json

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI

from modelserver.metrics import prometheus_logger
from protocol.metrics import ENGINES, parse_metrics, sample_filter_query
from tests.modelserver.conftest import MODEL


def client(server) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


async def metric(server, name: str, **labels) -> float:
    return (
        prometheus_logger(server.engine.stat_loggers).registry.get_sample_value(
            name, {"model_name": MODEL, "engine": "0", **labels}
        )
        or 0.0
    )


async def test_completion_and_usage(model_server):
    result = await client(model_server).completions.create(model=MODEL, prompt="Hello there, my friend", max_tokens=7)
    assert result.object == "text_completion"
    assert result.choices[0].finish_reason == "length"
    assert result.usage.completion_tokens == 7
    assert result.usage.total_tokens == result.usage.prompt_tokens + 7
    assert result.choices[0].text


async def test_chat_streaming_with_usage_chunk(model_server):
    stream = await client(model_server).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text


async def test_sse_framing_ends_with_done(model_server):
    async with aiohttp.ClientSession() as session:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True}
        async with session.post(f"{model_server.url}/v1/completions", json=body) as response:
            assert response.headers["Content-Type"].startswith("text/event-stream")
            raw = (await response.read()).decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert all(json.loads(e[6:])["object"] == "text_completion" for e in events[:-1])


async def test_n_choices_and_stop_string(model_server):
    c = client(model_server)
    result = await c.completions.create(model=MODEL, prompt="count", max_tokens=4, n=3)
    assert sorted(ch.index for ch in result.choices) == [0, 1, 2]
    assert result.usage.completion_tokens == 12
    full = (await c.completions.create(model=MODEL, prompt="abc", max_tokens=12)).choices[0].text
    stop = full.split()[2]
    stopped = await c.completions.create(model=MODEL, prompt="abc", max_tokens=12, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == full[: full.find(stop)]  # cut before the earliest match
    assert stopped.choices[0].model_extra["stop_reason"] == stop  # vLLM reports the matched stop string
    unstopped = await c.completions.create(model=MODEL, prompt="abc", max_tokens=3)
    assert unstopped.choices[0].model_extra["stop_reason"] is None
    chunks = [
        chunk.choices[0]
        async for chunk in await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "abc"}], max_tokens=12, stop=[stop], stream=True
        )
        if chunk.choices
    ]
    chat = await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "abc"}], max_tokens=12)
    chat_text = chat.choices[0].message.content
    if stop in chat_text:
        assert chunks[-1].finish_reason == "stop" and chunks[-1].model_extra["stop_reason"] == stop
        assert "".join(ch.delta.content or "" for ch in chunks) == chat_text[: chat_text.find(stop)]
    assert await metric(model_server, "vllm:request_success_total", finished_reason="stop") >= 1


async def test_repeated_prompt_reports_cached_tokens(model_server):
    c = client(model_server)
    prompt = "You are a helpful assistant. " * 40
    first = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    second = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 16 * ((first.usage.prompt_tokens - 1) // 16)


async def test_models_lists_base_and_adapters(model_server):
    models = (await client(model_server).models.list()).data
    by_id = {m.id: m for m in models}
    assert by_id[MODEL].model_extra["parent"] is None
    assert by_id["sql"].model_extra["parent"] == MODEL
    assert by_id["sql"].model_extra["root"].endswith("sql")


async def test_errors_have_openai_shape_and_status(model_server):
    c = client(model_server)
    with pytest.raises(openai.NotFoundError) as info:
        await c.completions.create(model="nope", prompt="x")
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        await c.completions.create(model=MODEL, prompt="word " * 5000)  # longer than max_model_len
    with pytest.raises(openai.BadRequestError):
        await c.completions.create(model=MODEL, prompt="x", max_tokens=10**6)


async def test_tokenize_detokenize_and_info_endpoints(model_server):
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{model_server.url}/tokenize", json={"prompt": "hello world"}) as r:
            tokens = (await r.json())["tokens"]
        async with session.post(f"{model_server.url}/detokenize", json={"tokens": tokens}) as r:
            assert (await r.json())["prompt"] == "hello world"
        async with session.post(f"{model_server.url}/detokenize", json={"tokens": [-1]}) as r:
            assert r.status == 400
        for path in ("/health", "/version", "/server_info", "/model_info", "/get_model_info"):
            async with session.get(f"{model_server.url}{path}") as r:
                assert r.status == 200, path


async def test_lora_load_unload_and_path_traversal(model_server, tmp_path):
    (tmp_path / "loras" / "new").mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    url = model_server.url
    async with aiohttp.ClientSession() as session:

        async def post(path, body):
            async with session.post(f"{url}{path}", json=body) as r:
                return r.status, await r.text()

        assert (await post("/v1/load_lora_adapter", {"lora_name": "new", "lora_path": str(tmp_path / "loras/new")}))[
            0
        ] == 200
        assert (await post("/v1/load_lora_adapter", {"lora_name": "new", "lora_path": str(tmp_path / "loras/new")}))[
            0
        ] == 400
        traversal = str(tmp_path / "loras" / ".." / "outside")
        status, body = await post("/v1/load_lora_adapter", {"lora_name": "evil", "lora_path": traversal})
        assert status == 400 and "outside" in body
        (tmp_path / "loras" / "link").symlink_to(outside)
        assert (await post("/v1/load_lora_adapter", {"lora_name": "evil", "lora_path": str(tmp_path / "loras/link")}))[
            0
        ] == 400
        assert (await post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path / "loras/missing")}))[
            0
        ] == 404
        result = await client(model_server).completions.create(model="new", prompt="hi", max_tokens=2)
        assert result.usage.completion_tokens == 2
        assert (await post("/v1/unload_lora_adapter", {"lora_name": "new"}))[0] == 200
        assert (await post("/v1/unload_lora_adapter", {"lora_name": "new"}))[0] == 404


async def test_client_disconnect_aborts_and_frees_blocks(model_server):
    engine = model_server.engine
    async with aiohttp.ClientSession() as session:
        body = {"model": MODEL, "prompt": "long " * 50, "max_tokens": 3000, "stream": True}
        response = await session.post(f"{model_server.url}/v1/completions", json=body)
        await response.content.readline()
        response.close()
    for _ in range(100):
        if engine.num_unfinished == 0:
            break
        await asyncio.sleep(0.02)
    assert engine.num_unfinished == 0
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert await metric(model_server, "vllm:request_success_total", finished_reason="abort") == 1


async def test_non_streaming_disconnect_aborts_too(model_server):
    engine = model_server.engine
    async with aiohttp.ClientSession() as session:
        body = {"model": MODEL, "prompt": "long", "max_tokens": 3000}
        with pytest.raises(asyncio.TimeoutError):
            async with session.post(
                f"{model_server.url}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=0.2)
            ):
                pass
    for _ in range(100):
        if engine.num_unfinished == 0:
            break
        await asyncio.sleep(0.02)
    assert engine.num_unfinished == 0
    assert await metric(model_server, "vllm:request_success_total", finished_reason="abort") == 1


async def test_metrics_page_serves_only_the_samples_named_in_the_query(model_server):
    """`?name[]=...` as prometheus_client's exposition (vLLM's /metrics) reads it: what the EPP's scraper sends."""
    names = ENGINES["vllm"].sample_names()
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{model_server.url}/metrics?{sample_filter_query(names)}") as response:
            assert response.status == 200
            page = await response.text()
        async with session.get(f"{model_server.url}/metrics") as response:
            whole = await response.text()
    read = {line.split("{")[0].split(" ")[0] for line in page.splitlines() if line and not line.startswith("#")}
    assert read and read <= set(names)
    assert len(page) < len(whole) / 10
    assert parse_metrics(page, scraped_at=0.0) == parse_metrics(whole, scraped_at=0.0)
