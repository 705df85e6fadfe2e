"""The Model Server Protocol suite (Gateway API Inference Extension, docs/proposals/003-model-server-protocol):
OpenAI Completions and Chat, the metrics the EPP scrapes, LoRA serving, and prefix caching. Black-box: it only
talks HTTP to the server under test, so it runs against ours, vLLM, SGLang or a simulator alike."""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass, field

import aiohttp

from protocol.conformance.framework import Level, Skip, Suite, expect
from protocol.metrics import (
    LABEL_BLOCK_SIZE,
    LABEL_MAX_LORA,
    LABEL_NUM_GPU_BLOCKS,
    LABEL_RUNNING_LORA_ADAPTERS,
    LABEL_WAITING_LORA_ADAPTERS,
    EndpointMetrics,
    engine_spec,
    parse_metrics,
)

suite = Suite("ModelServerProtocol")
MUST, SHOULD = Level.MUST, Level.SHOULD
LOAD_TOKENS = 256  # output tokens of the long requests that load the server


@dataclass
class Target:
    url: str
    model: str
    engine: str = "vllm"
    lora_adapters: list[str] = field(default_factory=list)
    load_requests: int = 32
    session: aiohttp.ClientSession | None = None

    async def post(self, path: str, body: dict | bytes) -> tuple[int, bytes]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with self.session.post(self.url + path, data=data, headers={"Content-Type": "application/json"}) as r:
            return r.status, await r.read()

    async def json_post(self, path: str, body: dict) -> dict:
        status, payload = await self.post(path, body)
        expect(status == 200, f"POST {path} answered {status}: {payload[:300]!r}")
        return json.loads(payload)

    async def stream(self, path: str, body: dict) -> tuple[list[dict], list[str], float]:
        """SSE events as JSON, the raw event lines, and the time to the first event."""
        started = time.monotonic()
        first = None
        events, raw = [], []
        async with self.session.post(self.url + path, json={**body, "stream": True}) as r:
            expect(r.status == 200, f"streaming POST {path} answered {r.status}")
            expect(r.headers.get("Content-Type", "").startswith("text/event-stream"), "stream is not text/event-stream")
            async for line in r.content:
                text = line.decode().strip()
                if not text:
                    continue
                first = first or time.monotonic() - started
                raw.append(text)
                expect(text.startswith("data: "), f"SSE line without 'data: ': {text[:100]!r}")
                if text != "data: [DONE]":
                    events.append(json.loads(text[6:]))
        return events, raw, first or 0.0

    async def metrics_text(self) -> str:
        async with self.session.get(self.url + "/metrics") as r:
            expect(r.status == 200, f"GET /metrics answered {r.status}")
            return await r.text()

    async def metrics(self) -> EndpointMetrics:
        return parse_metrics(await self.metrics_text(), self.engine)

    def long_request(self, model: str | None = None, prompt: str = "Tell a long story.") -> dict:
        return {"model": model or self.model, "prompt": prompt, "max_tokens": LOAD_TOKENS, "ignore_eos": True,
                "min_tokens": LOAD_TOKENS}  # fmt: skip


def _usage_adds_up(usage: dict) -> None:
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        expect(isinstance(usage.get(key), int), f"usage.{key} is missing or not an integer: {usage}")
    expect(
        usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], f"usage does not add up: {usage}"
    )


def _error_shape(payload: bytes) -> None:
    body = json.loads(payload)
    error = body.get("error") if isinstance(body, dict) else None
    expect(isinstance(error, dict) and isinstance(error.get("message"), str), f"not an OpenAI error body: {body}")
    expect("type" in error, f"error has no `type`: {body}")


@suite.check("completions", MUST, "POST /v1/completions answers a well-formed text_completion with usage")
async def completions(t: Target) -> None:
    body = await t.json_post("/v1/completions", {"model": t.model, "prompt": "Say hello.", "max_tokens": 8})
    expect(body.get("object") == "text_completion", f"object is {body.get('object')!r}")
    choice = body["choices"][0]
    expect(isinstance(choice.get("text"), str), "choices[0].text is not a string")
    expect(choice.get("finish_reason") in ("stop", "length"), f"finish_reason {choice.get('finish_reason')!r}")
    _usage_adds_up(body["usage"])
    expect(body["usage"]["completion_tokens"] <= 8, "more tokens than max_tokens")


@suite.check("completions-streaming", MUST, "streamed completions are SSE chunks ending with data: [DONE]")
async def completions_streaming(t: Target) -> None:
    events, raw, _ = await t.stream("/v1/completions", {"model": t.model, "prompt": "Count to five.", "max_tokens": 8})
    expect(raw and raw[-1] == "data: [DONE]", "the stream does not end with data: [DONE]")
    expect(events and all(e.get("object") == "text_completion" for e in events), "chunks are not text_completion")
    expect(any(c.get("finish_reason") for e in events for c in e.get("choices", [])), "no chunk has a finish_reason")


@suite.check("chat-completions", MUST, "POST /v1/chat/completions answers a well-formed chat.completion")
async def chat(t: Target) -> None:
    body = await t.json_post("/v1/chat/completions", {"model": t.model, "max_tokens": 8,
                                                      "messages": [{"role": "user", "content": "Say hello."}]})  # fmt: skip
    expect(body.get("object") == "chat.completion", f"object is {body.get('object')!r}")
    message = body["choices"][0]["message"]
    expect(message.get("role") == "assistant" and isinstance(message.get("content"), str), f"bad message {message}")
    _usage_adds_up(body["usage"])


@suite.check("chat-completions-streaming", MUST, "streamed chat: chunks, the first delta carries the role, [DONE]")
async def chat_streaming(t: Target) -> None:
    events, raw, _ = await t.stream("/v1/chat/completions", {"model": t.model, "max_tokens": 8,
                                                             "messages": [{"role": "user", "content": "Hi"}]})  # fmt: skip
    expect(raw and raw[-1] == "data: [DONE]", "the stream does not end with data: [DONE]")
    expect(all(e.get("object") == "chat.completion.chunk" for e in events), "chunks are not chat.completion.chunk")
    expect(events[0]["choices"][0]["delta"].get("role") == "assistant", "the first delta does not carry the role")


@suite.check("streaming-usage", SHOULD, "stream_options.include_usage adds a final chunk with usage")
async def streaming_usage(t: Target) -> None:
    events, _, _ = await t.stream("/v1/completions", {"model": t.model, "prompt": "Hi", "max_tokens": 4,
                                                      "stream_options": {"include_usage": True}})  # fmt: skip
    expect(events and events[-1].get("usage"), "no usage chunk at the end")
    expect(events[-1].get("choices") == [], "the usage chunk has choices")
    _usage_adds_up(events[-1]["usage"])


@suite.check("error-shape", MUST, "invalid input answers 400 with an OpenAI error body")
async def error_shape(t: Target) -> None:
    status, payload = await t.post("/v1/completions", {"model": t.model, "prompt": "x", "max_tokens": "many"})
    expect(status == 400, f"wrong type for max_tokens answered {status}")
    _error_shape(payload)
    status, payload = await t.post("/v1/completions", b"{not json")
    expect(status == 400, f"malformed JSON answered {status}")


@suite.check("unknown-model", MUST, "a model the server does not serve answers 404 with an OpenAI error body")
async def unknown_model(t: Target) -> None:
    status, payload = await t.post("/v1/completions", {"model": "no-such-model-xyz", "prompt": "x", "max_tokens": 2})
    expect(status == 404, f"unknown model answered {status}")
    _error_shape(payload)


def _type_of(text: str, family: str) -> str | None:
    match = re.search(rf"^# TYPE {re.escape(family)} (\w+)$", text, re.MULTILINE)
    return match.group(1) if match else None


@suite.check("metrics-gauges", MUST, "the three MUST gauges (queued, running, KV usage) exist as gauges and parse")
async def metrics_gauges(t: Target) -> None:
    text = await t.metrics_text()
    snapshot = parse_metrics(text, t.engine)
    spec = engine_spec(t.engine)
    for alternatives in (spec.waiting, spec.running, spec.kv_usage):
        kinds = {_type_of(text, a.name) for a in alternatives} - {None}
        expect(kinds <= {"gauge"}, f"{alternatives[0].name} has TYPE {kinds}, not gauge")
    expect(0.0 <= snapshot.kv_usage <= 1.0, f"KV usage {snapshot.kv_usage} is not a fraction")


@suite.check("metrics-under-load", MUST, "running rises under concurrent long requests, KV usage stays in [0, 1]")
async def metrics_under_load(t: Target) -> None:
    peak = await _peak_under_load(t, [t.model] * t.load_requests)
    expect(peak["running"] > 0, "num running never rose above 0 under load")
    expect(peak["kv_min"] >= 0.0 and peak["kv"] <= 1.0, "KV usage left [0, 1]")


@suite.check("metrics-waiting-and-kv", SHOULD, "waiting rises past the batch limit; KV usage rises under load")
async def metrics_waiting(t: Target) -> None:
    idle = await t.metrics()
    peak = await _peak_under_load(t, [t.model] * (t.load_requests * 8))
    expect(peak["waiting"] > 0, f"num waiting never rose with {t.load_requests * 8} concurrent requests")
    expect(peak["kv"] > idle.kv_usage, "KV usage did not rise under load")


async def _peak_under_load(t: Target, models: list[str], prompt: str = "Tell a long story.") -> dict:
    peak = {"running": 0, "waiting": 0, "kv": 0.0, "kv_min": 1.0, "running_adapters": set(), "waiting_adapters": set()}
    load = [asyncio.create_task(t.post("/v1/completions", t.long_request(m, prompt))) for m in models]
    try:
        deadline = time.monotonic() + 60
        while not all(task.done() for task in load) and time.monotonic() < deadline:
            m = await t.metrics()
            peak["running"] = max(peak["running"], m.running)
            peak["waiting"] = max(peak["waiting"], m.waiting)
            peak["kv"] = max(peak["kv"], m.kv_usage)
            peak["kv_min"] = min(peak["kv_min"], m.kv_usage)
            peak["running_adapters"] |= m.running_adapters
            peak["waiting_adapters"] |= m.waiting_adapters
            await asyncio.sleep(0.02)
        statuses = [status for status, _ in await asyncio.gather(*load)]
        expect(all(s == 200 for s in statuses), f"load requests failed: {sorted(set(statuses))}")
    finally:
        for task in load:
            task.cancel()
    return peak


@suite.check("cache-config-info", SHOULD, "cache_config_info publishes integer block_size and num_gpu_blocks")
async def cache_config(t: Target) -> None:
    spec = engine_spec(t.engine)
    if spec.cache_info is None:
        raise Skip(f"engine {t.engine} defines no cache info metric")
    text = await t.metrics_text()
    match = re.search(rf"^{re.escape(spec.cache_info.name)}\{{([^}}]*)\}}", text, re.MULTILINE)
    if match is None:
        raise Skip(f"{spec.cache_info.name} is not published (optional)")
    labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
    for key in (LABEL_BLOCK_SIZE, LABEL_NUM_GPU_BLOCKS):
        expect(labels.get(key, "").isdigit(), f"{key}={labels.get(key)!r} is not an integer")


def _lora_series(text: str, family: str) -> list[tuple[dict, float]]:
    out = []
    for labels, value in re.findall(rf"^{re.escape(family)}\{{([^}}]*)\}} (\S+)$", text, re.MULTILINE):
        out.append((dict(re.findall(r'(\w+)="([^"]*)"', labels)), float(value)))
    return out


def _need_lora(t: Target, count: int = 1) -> None:
    if len(t.lora_adapters) < count:
        raise Skip(f"needs {count} --lora-adapter name(s)")
    if engine_spec(t.engine).lora_info is None:
        raise Skip(f"engine {t.engine} defines no LoRA info metric")


@suite.check("lora-served", MUST, "a request naming a LoRA adapter in `model` is served")
async def lora_served(t: Target) -> None:
    _need_lora(t)
    body = await t.json_post("/v1/completions", {"model": t.lora_adapters[0], "prompt": "Hi", "max_tokens": 4})
    _usage_adds_up(body["usage"])


@suite.check("lora-info-metric", MUST, "lora_requests_info is a gauge valued with a recent timestamp; integer max_lora")
async def lora_info(t: Target) -> None:
    _need_lora(t)
    family = engine_spec(t.engine).lora_info.name
    await t.post("/v1/completions", {"model": t.lora_adapters[0], "prompt": "Hi", "max_tokens": 2})
    text = await t.metrics_text()
    expect(_type_of(text, family) == "gauge", f"{family} is not a gauge")
    series = _lora_series(text, family)
    expect(series, f"{family} has no series")
    labels, newest = max(series, key=lambda s: s[1])
    expect(abs(newest - time.time()) < 600, f"{family} value {newest} is not a recent timestamp")
    expect(labels.get(LABEL_MAX_LORA, "").isdigit(), f"max_lora={labels.get(LABEL_MAX_LORA)!r} is not an integer")


@suite.check("lora-running-adapters", MUST, "an adapter is listed in running_lora_adapters while its requests run")
async def lora_running(t: Target) -> None:
    _need_lora(t)
    adapter = t.lora_adapters[0]
    peak = await _peak_under_load(t, [adapter] * 4)
    expect(adapter in peak["running_adapters"], f"{adapter} never appeared in running_lora_adapters")


@suite.check("lora-waiting-adapters", SHOULD, "adapters beyond max_lora show in waiting_lora_adapters")
async def lora_waiting(t: Target) -> None:
    _need_lora(t, 2)
    m = await t.metrics()
    if m.max_lora is None or m.max_lora >= len(t.lora_adapters):
        raise Skip(f"needs more --lora-adapter names than max_lora ({m.max_lora})")
    peak = await _peak_under_load(t, [a for a in t.lora_adapters for _ in range(4)])
    expect(peak["waiting_adapters"], "no adapter appeared in waiting_lora_adapters")


@suite.check("lora-names-clean", MUST, "adapter lists are comma-separated names without stray spaces")
async def lora_names(t: Target) -> None:
    _need_lora(t)
    family = engine_spec(t.engine).lora_info.name
    load = asyncio.create_task(t.post("/v1/completions", t.long_request(t.lora_adapters[0])))
    try:
        await asyncio.sleep(0.2)
        series = _lora_series(await t.metrics_text(), family)
    finally:
        await load
    for labels, _ in series:
        for key in (LABEL_RUNNING_LORA_ADAPTERS, LABEL_WAITING_LORA_ADAPTERS):
            value = labels.get(key, "")
            names = value.split(",") if value else []
            expect(all(n and n == n.strip() for n in names), f"{key}={value!r} has stray spaces or empty names")


@suite.check("prefix-cache", SHOULD, "a repeated long prompt raises prefix-cache hits and lowers TTFT")
async def prefix_cache(t: Target) -> None:
    prompt = f"Conformance run {time.time()}: " + "You are a careful assistant who answers precisely. " * 60
    body = {"model": t.model, "prompt": prompt, "max_tokens": 2}
    hits_before = _counter(await t.metrics_text(), "vllm:prefix_cache_hits_total")
    _, _, cold = await t.stream("/v1/completions", body)
    warm = min([(await t.stream("/v1/completions", body))[2] for _ in range(3)])
    hits_after = _counter(await t.metrics_text(), "vllm:prefix_cache_hits_total")
    if hits_before is not None:
        expect(hits_after > hits_before, "vllm:prefix_cache_hits_total did not rise")
    expect(
        warm < cold, f"TTFT with a cached prefix ({warm * 1e3:.1f} ms) is not below the cold one ({cold * 1e3:.1f} ms)"
    )


def _counter(text: str, name: str) -> float | None:
    values = re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE)
    return sum(float(v) for v in values) if values else None
