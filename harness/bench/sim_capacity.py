"""How many sim model servers one core carries: `--replicas N` in one process under Poisson load, with the
process's CPU use and whether latencies stay at their modelled values (if the core saturates, modelled 12 ms
steps stretch and the simulated GPUs stop being the bottleneck)."""

from __future__ import annotations

import asyncio
import random
import statistics
import subprocess
import time
from dataclasses import dataclass

import aiohttp

from harness.bench.overhead import cpu_seconds, percentile
from harness.bench.ports import free_port_block
from harness.local import python_module

PROMPT = "You are a helpful assistant. Summarize the following paragraph in one sentence. " * 10  # ~200 tokens
OUTPUT_TOKENS = 64


@dataclass
class CapacityPoint:
    replicas: int
    rate: float  # requests per second over the whole pool
    completed: int
    cpu_percent_of_one_core: float
    ttft_p50_ms: float
    itl_mean_ms: float
    e2e_p50_ms: float


async def _request(session: aiohttp.ClientSession, url: str) -> tuple[float, float, float]:
    body = {"model": "sim-llama-8b", "prompt": PROMPT, "max_tokens": OUTPUT_TOKENS, "stream": True}
    started = time.monotonic()
    first = last = None
    chunks = 0
    async with session.post(f"{url}/v1/completions", json=body) as response:
        async for line in response.content:
            if line.startswith(b"data: {"):
                now = time.monotonic()
                first = first or now
                last = now
                chunks += 1
    ttft = first - started
    itl = (last - first) / max(1, chunks - 1)
    return ttft, itl, last - started


async def measure_point(replicas: int, rate: float, duration: float, seed: int = 0) -> CapacityPoint:
    base = free_port_block(replicas)
    server = subprocess.Popen(
        [*python_module("modelserver"), "--port", str(base), "--replicas", str(replicas), "--disable-log-stats"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(replicas):
            server.stdout.readline()
        urls = [f"http://127.0.0.1:{base + i}" for i in range(replicas)]
        rng = random.Random(seed)
        results: list[tuple[float, float, float]] = []
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            await asyncio.gather(*(_request(session, u) for u in urls))  # warm up
            cpu_before, started = cpu_seconds(server.pid), time.monotonic()
            tasks, i = [], 0
            next_at = started
            while next_at < started + duration:
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
                tasks.append(asyncio.create_task(_request(session, urls[i % replicas])))
                i += 1
                next_at += rng.expovariate(rate)
            results = await asyncio.gather(*tasks)
            elapsed = time.monotonic() - started
            cpu = cpu_seconds(server.pid) - cpu_before
    finally:
        server.terminate()
        server.wait(10)
    ttfts, itls, e2es = zip(*results, strict=True)
    return CapacityPoint(
        replicas,
        rate,
        len(results),
        100 * cpu / elapsed,
        percentile(list(ttfts), 0.5) * 1e3,
        statistics.fmean(itls) * 1e3,
        percentile(list(e2es), 0.5) * 1e3,
    )


def main(replicas: int, rates: list[float], duration: float) -> list[CapacityPoint]:
    points = []
    print("modelled for a lone request: TTFT ~24 ms (4 ms + 200 tokens x 0.1 ms), ITL 12.05 ms")
    print("| replicas | pool req/s | completed | CPU % of one core | TTFT p50 ms | ITL mean ms | e2e p50 ms |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for rate in rates:
        p = asyncio.run(measure_point(replicas, rate, duration))
        points.append(p)
        print(
            f"| {p.replicas} | {p.rate:g} | {p.completed} | {p.cpu_percent_of_one_core:.0f} | {p.ttft_p50_ms:.1f} | "
            f"{p.itl_mean_ms:.2f} | {p.e2e_p50_ms:.0f} |",
            flush=True,
        )
    return points
