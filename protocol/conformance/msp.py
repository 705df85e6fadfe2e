"""The Model Server Protocol suite (Gateway API Inference Extension, docs/proposals/003-model-server-protocol):
OpenAI Completions and Chat, the metrics the EPP scrapes, LoRA serving, and prefix caching. Black-box: it only
talks HTTP to the server under test, so it runs against ours, vLLM, SGLang or a simulator alike."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import openai
from prometheus_client.parser import text_string_to_metric_families

from protocol.conformance.framework import CheckFailed, Level, Skip, Suite, expect
from protocol.metrics import (
    LABEL_BLOCK_SIZE,
    LABEL_MAX_LORA,
    LABEL_NUM_GPU_BLOCKS,
    LABEL_RUNNING_LORA_ADAPTERS,
    LABEL_WAITING_LORA_ADAPTERS,
    EndpointMetrics,
    MetricsParseError,
    MetricSpec,
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
        """SSE events as JSON, the raw `data:` payloads, and the time to the first byte of the stream. Checks the
        framing: every event is `data: ...` lines ended by a blank line (comment lines `:` allowed)."""
        started = time.monotonic()
        first = 0.0
        chunks = []
        async with self.session.post(self.url + path, json={**body, "stream": True}) as r:
            expect(r.status == 200, f"streaming POST {path} answered {r.status}")
            expect(r.headers.get("Content-Type", "").startswith("text/event-stream"), "stream is not text/event-stream")
            async for chunk in r.content.iter_any():
                first = first or time.monotonic() - started
                chunks.append(chunk)
        text = b"".join(chunks).decode().replace("\r\n", "\n")
        expect(text.endswith("\n\n"), f"the stream does not end with a blank line: {text[-80:]!r}")
        events, raw = [], []
        for block in text[:-2].split("\n\n"):
            lines = [line for line in block.split("\n") if not line.startswith(":")]
            expect(lines and all(line.startswith("data:") for line in lines), f"not an SSE data event: {block[:100]!r}")
            payload = "\n".join(line[5:].removeprefix(" ") for line in lines)
            raw.append(payload)
            if payload != "[DONE]":
                try:
                    events.append(json.loads(payload))
                except json.JSONDecodeError:
                    raise CheckFailed(f"an SSE event's data is not one JSON object: {payload[:120]!r}") from None
        return events, raw, first

    async def metrics_text(self) -> str:
        async with self.session.get(self.url + "/metrics") as r:
            expect(r.status == 200, f"GET /metrics answered {r.status}")
            return await r.text()

    async def metrics(self) -> EndpointMetrics:
        return parse_metrics(await self.metrics_text(), self.engine)

    def long_request(self, model: str | None = None, prompt: str = "Tell a long story.") -> dict:
        return {
            "model": model or self.model,
            "prompt": prompt,
            "max_tokens": LOAD_TOKENS,
            "ignore_eos": True,
            "min_tokens": LOAD_TOKENS,
        }


def open_session() -> aiohttp.ClientSession:
    """The suite's HTTP session: no connection limit, since the load checks need hundreds of requests at once."""
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300), connector=aiohttp.TCPConnector(limit=0))


async def default_model(session: aiohttp.ClientSession, url: str) -> str:
    """The first base model (not a LoRA adapter) of GET /v1/models."""
    async with session.get(f"{url}/v1/models") as r:
        expect(r.status == 200, f"GET /v1/models answered {r.status}")
        data = (await r.json())["data"]
    base = [m["id"] for m in data if not m.get("parent")]
    return (base or [data[0]["id"]])[0]


async def served_adapters(session: aiohttp.ClientSession, url: str, model: str) -> list[str]:
    """The LoRA adapters GET /v1/models lists on top of `model` (vLLM: entries whose `parent` is the base model),
    so the LoRA checks run without naming adapters by hand."""
    async with session.get(f"{url}/v1/models") as r:
        data = (await r.json())["data"] if r.status == 200 else []
    return [m["id"] for m in data if m.get("parent") == model]


def _usage_adds_up(usage: dict) -> None:
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        expect(isinstance(usage.get(key), int), f"usage.{key} is missing or not an integer: {usage}")
    expect(
        usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], f"usage does not add up: {usage}"
    )


def _envelope(body: dict, t: Target, model: str | None = None) -> None:
    expect(isinstance(body.get("id"), str) and body["id"], f"no string id: {str(body)[:200]}")
    expect(isinstance(body.get("created"), int), f"created is not an integer: {body.get('created')!r}")
    expect(body.get("model") == (model or t.model), f"model is {body.get('model')!r}, not {model or t.model!r}")


def _error_shape(payload: bytes) -> None:
    body = json.loads(payload)
    error = body.get("error") if isinstance(body, dict) else None
    expect(isinstance(error, dict) and isinstance(error.get("message"), str), f"not an OpenAI error body: {body}")
    expect("type" in error, f"error has no `type`: {body}")


@suite.check("completions", MUST, "POST /v1/completions answers a well-formed text_completion with usage")
async def completions(t: Target) -> None:
    body = await t.json_post("/v1/completions", {"model": t.model, "prompt": "Say hello.", "max_tokens": 8})
    expect(body.get("object") == "text_completion", f"object is {body.get('object')!r}")
    _envelope(body, t)
    choice = body["choices"][0]
    expect(isinstance(choice.get("text"), str), "choices[0].text is not a string")
    expect(choice.get("finish_reason") in ("stop", "length"), f"finish_reason {choice.get('finish_reason')!r}")
    _usage_adds_up(body["usage"])
    expect(body["usage"]["completion_tokens"] <= 8, "more tokens than max_tokens")


@suite.check("completions-streaming", MUST, "streamed completions are SSE chunks ending with data: [DONE]")
async def completions_streaming(t: Target) -> None:
    events, raw, _ = await t.stream("/v1/completions", {"model": t.model, "prompt": "Count to five.", "max_tokens": 8})
    expect(raw and raw[-1] == "[DONE]", "the stream does not end with data: [DONE]")
    expect(events and all(e.get("object") == "text_completion" for e in events), "chunks are not text_completion")
    expect(any(c.get("finish_reason") for e in events for c in e.get("choices", [])), "no chunk has a finish_reason")
    expect(len({e.get("id") for e in events}) == 1, "the chunks of one stream carry different ids")


@suite.check("chat-completions", MUST, "POST /v1/chat/completions answers a well-formed chat.completion")
async def chat(t: Target) -> None:
    body = await t.json_post(
        "/v1/chat/completions",
        {"model": t.model, "max_tokens": 8, "messages": [{"role": "user", "content": "Say hello."}]},
    )
    expect(body.get("object") == "chat.completion", f"object is {body.get('object')!r}")
    _envelope(body, t)
    message = body["choices"][0]["message"]
    expect(message.get("role") == "assistant" and isinstance(message.get("content"), str), f"bad message {message}")
    _usage_adds_up(body["usage"])


@suite.check("chat-completions-streaming", MUST, "streamed chat: chunks, the first delta carries the role, [DONE]")
async def chat_streaming(t: Target) -> None:
    events, raw, _ = await t.stream(
        "/v1/chat/completions", {"model": t.model, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
    )
    expect(raw and raw[-1] == "[DONE]", "the stream does not end with data: [DONE]")
    expect(all(e.get("object") == "chat.completion.chunk" for e in events), "chunks are not chat.completion.chunk")
    expect(events[0]["choices"][0]["delta"].get("role") == "assistant", "the first delta does not carry the role")


@suite.check("streaming-usage", SHOULD, "stream_options.include_usage adds a final chunk with usage")
async def streaming_usage(t: Target) -> None:
    events, _, _ = await t.stream(
        "/v1/completions",
        {"model": t.model, "prompt": "Hi", "max_tokens": 4, "stream_options": {"include_usage": True}},
    )
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


@suite.check(
    "openai-sdk",
    MUST,
    "the official OpenAI Python SDK reads completions and chat, streamed and not, "
    "and maps errors to its exception types",
)
async def openai_sdk(t: Target) -> None:
    async with openai.AsyncOpenAI(base_url=t.url + "/v1", api_key="conformance", max_retries=0) as client:
        completion = await client.completions.create(model=t.model, prompt="Say hello.", max_tokens=4)
        expect(isinstance(completion.choices[0].text, str), "SDK: completion text is not a string")
        expect(completion.usage and completion.usage.total_tokens > 0, "SDK: completion usage missing")
        stream = await client.completions.create(model=t.model, prompt="Hi", max_tokens=4, stream=True)
        chunks = [chunk async for chunk in stream]
        expect(chunks and any(c.choices and c.choices[0].finish_reason for c in chunks), "SDK: no finish_reason")
        messages = [{"role": "user", "content": "Say hello."}]
        chat = await client.chat.completions.create(model=t.model, messages=messages, max_tokens=4)
        expect(chat.choices[0].message.role == "assistant", "SDK: chat message role is not assistant")
        stream = await client.chat.completions.create(model=t.model, messages=messages, max_tokens=4, stream=True)
        deltas = [c.choices[0].delta for c in [chunk async for chunk in stream] if c.choices]
        expect(deltas and deltas[0].role == "assistant", "SDK: the first chat delta has no assistant role")
        try:
            await client.completions.create(model="no-such-model-xyz", prompt="x", max_tokens=2)
            raise CheckFailed("SDK: an unknown model raised no error")
        except openai.NotFoundError:
            pass
        try:
            await client.completions.create(model=t.model, prompt="x", max_tokens=-1)
            raise CheckFailed("SDK: max_tokens=-1 raised no error")
        except openai.BadRequestError:
            pass


def _families(text: str) -> dict[str, str]:
    """Metric family name -> TYPE, from the Prometheus text parser (which also proves the page well-formed)."""
    try:
        return {f.name: f.type for f in text_string_to_metric_families(text)}
    except ValueError as exc:
        raise CheckFailed(f"the metrics page is not valid Prometheus text: {exc}") from None


def _samples(text: str, spec: MetricSpec) -> list[tuple[dict, float]]:
    """Raw (labels, value) of one metric, unclamped (parse_metrics clamps KV usage, which would hide a bad one)."""
    out = []
    for line in text.splitlines():
        if line.startswith(spec.name) and (match := _SAMPLE.match(line)) and match.group(1) == spec.name:
            labels = dict(_LABEL.findall(match.group(2) or ""))
            if spec.matches(labels):
                out.append((labels, float(match.group(3))))
    return out


_SAMPLE = re.compile(r"^([^\s{]+)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@suite.check("metrics-gauges", MUST, "/metrics parses; the three MUST gauges (queued, running, KV usage) are gauges")
async def metrics_gauges(t: Target) -> None:
    text = await t.metrics_text()
    families = _families(text)
    try:
        parse_metrics(text, t.engine)
    except MetricsParseError as exc:
        raise CheckFailed(f"protocol.metrics cannot read the page for engine {t.engine}: {exc}") from None
    spec = engine_spec(t.engine)
    for alternatives in (spec.waiting, spec.running, spec.kv_usage):
        present = [a for a in alternatives if _samples(text, a)]
        kind = families.get(present[0].name)
        expect(kind == "gauge", f"{present[0].name} has TYPE {kind}, not gauge")
    kv = [v for _, v in _samples(text, present[0])]
    expect(all(0.0 <= v <= 1.0 for v in kv), f"KV usage {kv} is not a fraction in [0, 1]")


@suite.check(
    "metrics-under-load",
    MUST,
    "waiting and running rise under concurrent long requests and fall back after; KV usage stays in [0, 1] and rises",
)
async def metrics_under_load(t: Target) -> None:
    idle = await t.metrics()
    peak = await _escalate(t, lambda i: t.model, lambda p: p.running > 0 and p.waiting > 0 and p.kv_max > idle.kv_usage)
    expect(peak.running > 0, "num running never rose above 0 under load")
    expect(peak.waiting > 0, f"num waiting never rose with up to {peak.requests} concurrent requests")
    expect(peak.kv_min >= 0.0 and peak.kv_max <= 1.0, f"KV usage left [0, 1]: {peak.kv_min}..{peak.kv_max}")
    expect(peak.kv_max > idle.kv_usage, f"KV usage did not rise under load (idle {idle.kv_usage}, peak {peak.kv_max})")
    await _back_to_idle(t, idle)


@dataclass
class Peak:
    """The extremes the metrics reached while a load ran."""

    requests: int = 0
    running: int = 0
    waiting: int = 0
    kv_max: float = 0.0
    kv_min: float = 1.0
    running_adapters: set[str] = field(default_factory=set)
    waiting_adapters: set[str] = field(default_factory=set)


async def _load(t: Target, models: list[str], goal: Callable[[Peak], bool]) -> Peak:
    """Send one long request per entry of `models` at once and sample /metrics until `goal` holds (then the load
    is cancelled: the server sees client disconnects) or every request finished."""
    peak = Peak(requests=len(models))
    kv_specs = engine_spec(t.engine).kv_usage
    load = [asyncio.create_task(t.post("/v1/completions", t.long_request(m))) for m in models]
    try:
        deadline = time.monotonic() + 60
        while not all(task.done() for task in load) and time.monotonic() < deadline:
            text = await t.metrics_text()
            m = parse_metrics(text, t.engine)
            kv = [v for spec in kv_specs for _, v in _samples(text, spec)]
            peak.running = max(peak.running, m.running)
            peak.waiting = max(peak.waiting, m.waiting)
            peak.kv_max = max([peak.kv_max, *kv])
            peak.kv_min = min([peak.kv_min, *kv])
            peak.running_adapters |= m.running_adapters
            peak.waiting_adapters |= m.waiting_adapters
            if goal(peak):
                return peak
            await asyncio.sleep(0.02)
        failed = [task.result()[0] for task in load if task.done() and task.result()[0] != 200]
        expect(not failed, f"load requests failed: {sorted(set(failed))}")
    finally:
        for task in load:
            task.cancel()
        await asyncio.gather(*load, return_exceptions=True)
    return peak


async def _escalate(t: Target, model_of: Callable[[int], str], goal: Callable[[Peak], bool]) -> Peak:
    """Load the server with --load-requests concurrent long requests, then 4x as many, up to 64x, until `goal`
    holds: enough to pass any batch limit (max_num_seqs) so requests must queue."""
    count = t.load_requests
    while True:
        peak = await _load(t, [model_of(i) for i in range(count)], goal)
        if goal(peak) or count >= t.load_requests * 64:
            return peak
        count *= 4


async def _back_to_idle(t: Target, idle: EndpointMetrics, seconds: float = 15.0) -> None:
    deadline = time.monotonic() + seconds
    while True:
        m = await t.metrics()
        if m.running <= idle.running and m.waiting <= idle.waiting:
            return
        expect(
            time.monotonic() < deadline,
            f"{seconds:.0f}s after the load ended: running {m.running}, "
            f"waiting {m.waiting} (idle: {idle.running}, {idle.waiting})",
        )
        await asyncio.sleep(0.05)


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


def _need_lora(t: Target) -> MetricSpec:
    if not t.lora_adapters:
        raise Skip("the server lists no LoRA adapter in /v1/models and none was given (--lora-adapter)")
    spec = engine_spec(t.engine).lora_info
    if spec is None:
        raise Skip(f"engine {t.engine} defines no LoRA info metric")
    return spec


@suite.check("lora-served", MUST, "a request naming a LoRA adapter in `model` is served")
async def lora_served(t: Target) -> None:
    _need_lora(t)
    for adapter in t.lora_adapters:
        body = await t.json_post("/v1/completions", {"model": adapter, "prompt": "Hi", "max_tokens": 4})
        _usage_adds_up(body["usage"])


@suite.check("lora-info-metric", MUST, "lora_requests_info is a gauge valued with a recent timestamp; integer max_lora")
async def lora_info(t: Target) -> None:
    spec = _need_lora(t)
    await t.post("/v1/completions", {"model": t.lora_adapters[0], "prompt": "Hi", "max_tokens": 2})
    text = await t.metrics_text()
    kind = _families(text).get(spec.name)
    expect(kind == "gauge", f"{spec.name} has TYPE {kind}, not gauge")
    series = _samples(text, spec)
    expect(series, f"{spec.name} has no series")
    labels, newest = max(series, key=lambda s: s[1])
    expect(abs(newest - time.time()) < 600, f"{spec.name} value {newest} is not a recent Unix timestamp")
    expect(labels.get(LABEL_MAX_LORA, "").isdigit(), f"max_lora={labels.get(LABEL_MAX_LORA)!r} is not an integer")


@suite.check("lora-running-adapters", MUST, "an adapter is listed in running_lora_adapters while its requests run")
async def lora_running(t: Target) -> None:
    _need_lora(t)
    adapter = t.lora_adapters[0]
    peak = await _load(t, [adapter] * 4, lambda p: adapter in p.running_adapters)
    expect(adapter in peak.running_adapters, f"{adapter} never appeared in running_lora_adapters")


@suite.check("lora-waiting-adapters", MUST, "an adapter whose requests cannot run yet shows in waiting_lora_adapters")
async def lora_waiting(t: Target) -> None:
    # Two ways to make adapter requests wait, used together: requests for all the given adapters at once (more
    # adapters than max_lora cannot share a batch), and more concurrent requests than the batch holds.
    _need_lora(t)
    adapters = t.lora_adapters
    peak = await _escalate(t, lambda i: adapters[i % len(adapters)], lambda p: p.waiting_adapters & set(adapters))
    expect(
        peak.waiting_adapters & set(adapters),
        f"no adapter appeared in waiting_lora_adapters with up to {peak.requests} concurrent requests",
    )


@suite.check("lora-names-clean", MUST, "adapter lists are comma-separated names, none empty or with inner spaces")
async def lora_names(t: Target) -> None:
    spec = _need_lora(t)
    seen: list[dict] = []  # raw labels: the parsed snapshot already strips what this check looks at
    load = asyncio.create_task(t.post("/v1/completions", t.long_request(t.lora_adapters[0])))
    try:
        while not load.done() and not any(labels.get(LABEL_RUNNING_LORA_ADAPTERS) for labels in seen):
            seen += [labels for labels, _ in _samples(await t.metrics_text(), spec)]
            await asyncio.sleep(0.02)
    finally:
        load.cancel()
        await asyncio.gather(load, return_exceptions=True)
    expect(any(labels.get(LABEL_RUNNING_LORA_ADAPTERS) for labels in seen), "running_lora_adapters stayed empty")
    for labels in seen:
        for key in (LABEL_RUNNING_LORA_ADAPTERS, LABEL_WAITING_LORA_ADAPTERS):
            value = labels.get(key, "")
            # the protocol's own example is "adapter1, adapter2": a space after the comma is a separator
            names = [n.strip() for n in value.split(",")] if value else []
            expect(all(n and not any(c.isspace() for c in n) for n in names), f"{key}={value!r}: bad adapter names")
            expect(value == value.strip(), f"{key}={value!r} has leading or trailing spaces")


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
