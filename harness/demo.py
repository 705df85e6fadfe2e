"""The `make demo` workload: shared system prompts, two LoRA adapters, streaming and not, sent with the OpenAI SDK
through the gateway while a live table shows what each model server is doing and how the EPP spread the load."""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import time

import aiohttp
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.live import Live
from rich.table import Table

from protocol.metrics import MetricsParseError, parse_metrics

SYSTEM_PROMPTS = [
    "You are a support agent for an online bookshop. Be friendly and precise. " * 25,
    "You are a senior SQL engineer. Answer with a single query and one sentence of explanation. " * 25,
    "You are a travel planner. Suggest an itinerary with times and places, keep it short. " * 25,
]
QUESTIONS = [
    "Where is my order?",
    "How do I join two tables?",
    "Plan a day in Lisbon.",
    "What is a refund policy?",
    "Count users per country.",
    "Three days in Kyoto?",
    "Can I change my address?",
]
_SUCCESS = re.compile(r"^vllm:request_success_total\{[^}]*\} ([0-9.e+]+)$", re.MULTILINE)
_PREFIX = re.compile(r"^vllm:prefix_cache_(hits|queries)_total\{[^}]*\} ([0-9.e+]+)$", re.MULTILINE)


async def _snapshot(session: aiohttp.ClientSession, url: str, engine: str) -> dict:
    """One server's row, read from its metrics in its engine's names (requests served and prefix hits: vLLM's only)."""
    try:
        async with session.get(f"{url}/metrics") as response:
            text = await response.text()
        m = parse_metrics(text, engine=engine)
    except (TimeoutError, aiohttp.ClientError, OSError, MetricsParseError):
        return {"down": True}
    prefix = {k: float(v) for k, v in _PREFIX.findall(text)}
    served = _SUCCESS.findall(text)
    return {
        "waiting": m.waiting,
        "running": m.running,
        "kv": m.kv_usage,
        "adapters": ",".join(sorted(m.running_adapters))
        + "".join(f" ({a} waiting)" for a in sorted(m.waiting_adapters - m.running_adapters)),
        "served": str(int(sum(float(v) for v in served))) if served else "-",
        "hit": f"{prefix.get('hits', 0) / prefix['queries']:.0%}" if prefix.get("queries") else "-",
    }


async def _epp_request_counts(session: aiohttp.ClientSession, url: str) -> dict[str, int]:
    """The EPP's requests per model name (inference_objective_request_total, summed over target models)."""
    try:
        async with session.get(url) as response:
            text = await response.text()
    except (TimeoutError, aiohttp.ClientError, OSError):
        return {}
    counts: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "inference_objective_request":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    model = sample.labels.get("model_name", "")
                    counts[model] = counts.get(model, 0) + int(sample.value)
    return counts


def _table(urls: list[str], rows: list[dict], done: int, total: int, failures: int) -> Table:
    title = f"EPP demo: {done}/{total} requests done, {failures} failed" if total else "the pool behind the gateway"
    table = Table(title=title)
    # vLLM's lora_requests_info names the adapters of running and waiting requests (not every adapter loaded)
    for column in ("endpoint", "queue", "running", "KV", "LoRA in use", "served", "hit rate"):
        table.add_column(
            column,
            justify="right" if column in ("queue", "running", "KV", "served", "hit rate") else "left",
            no_wrap=True,
        )
    for url, row in zip(urls, rows, strict=True):
        url = url.removeprefix("http://")
        if row.get("down"):
            table.add_row(url, "-", "-", "-", "down", "-", "-")
            continue
        table.add_row(
            url,
            str(row["waiting"]),
            str(row["running"]),
            f"{row['kv']:.1%}",
            row["adapters"] or "-",
            row["served"],
            row["hit"],
        )
    return table


async def run_demo(stack, model: str, adapters: tuple[str, ...], total: int, stop: asyncio.Event, once: bool) -> bool:
    """Send `total` requests (none: only the table) and show the table until they are done (`once`) or `stop`."""
    console = Console()
    client = AsyncOpenAI(base_url=f"{stack.gateway_url}/v1", api_key="demo", max_retries=0, timeout=120)
    rng = random.Random(7)
    done = failures = 0
    ttfts: list[float] = []

    async def one(i: int) -> None:
        nonlocal done, failures
        target = rng.choice([model, model, *adapters])
        messages = [
            {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)},
            {"role": "user", "content": f"{rng.choice(QUESTIONS)} (#{i})"},
        ]
        started = time.monotonic()
        try:
            if i % 2:
                stream = await client.chat.completions.create(
                    model=target, messages=messages, max_tokens=48, stream=True, stream_options={"include_usage": True}
                )
                first = None
                async for _ in stream:
                    first = first or time.monotonic()
                ttfts.append((first or time.monotonic()) - started)
            else:
                await client.chat.completions.create(model=target, messages=messages, max_tokens=48)
        except Exception as exc:  # a failed request is counted and shown, never fatal to the demo
            failures += 1
            console.print(f"[red]request {i} failed: {exc}")
        done += 1

    semaphore = asyncio.Semaphore(8)

    async def limited(i: int) -> None:
        async with semaphore:
            await one(i)

    urls, engines = stack.model_server_urls, stack.model_server_engines
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1)) as session:

        async def rows() -> list[dict]:
            return list(await asyncio.gather(*(_snapshot(session, u, e) for u, e in zip(urls, engines, strict=True))))

        with Live(_table(urls, await rows(), 0, total, 0), console=console, refresh_per_second=4) as live:
            workload = asyncio.gather(*(limited(i) for i in range(total)))
            while not workload.done() and not stop.is_set():
                live.update(_table(urls, await rows(), done, total, failures))
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(workload), 0.25)
            if not workload.done():  # stopped (Ctrl-C, a child exited): the rest of the workload is not sent
                workload.cancel()
                await asyncio.gather(workload, return_exceptions=True)
                return False
            live.update(_table(urls, await rows(), done, total, failures))
            if ttfts:
                console.print(f"streaming requests: median TTFT {sorted(ttfts)[len(ttfts) // 2] * 1000:.0f} ms")
            if total:
                counts = await _epp_request_counts(session, stack.epp_metrics_url)
                counted = ", ".join(f"{model} {count}" for model, count in sorted(counts.items()))
                console.print(f"the EPP counted requests per model: {counted or 'none (its metrics did not answer)'}")
            if not once:
                console.print("workload done; the stack stays up (Ctrl-C to stop)" if total else "Ctrl-C to stop")
                while not stop.is_set():
                    live.update(_table(urls, await rows(), done, total, failures))
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(stop.wait(), 1.0)
    await client.close()
    return failures == 0
