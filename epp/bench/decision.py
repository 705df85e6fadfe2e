"""The scheduler's decision time per request (default profile: filters, four scorers, picker) against pool size
and prompt length, with a warm prefix index (every endpoint has served 200 earlier prompts)."""

from __future__ import annotations

import random
import time

from epp.datalayer.endpoint import Endpoint, EndpointSpec
from epp.scheduling.scheduler import Scheduler
from epp.scheduling.types import SchedulingRequest
from protocol.metrics import EndpointMetrics


def _pool(size: int, rng: random.Random) -> list[Endpoint]:
    return [Endpoint(EndpointSpec(f"e{i}", f"10.0.{i // 250}.{i % 250}", 8000),
                     EndpointMetrics(waiting=rng.randrange(5), running=rng.randrange(20), kv_usage=rng.random(),
                                     block_size=16, num_gpu_blocks=8192, max_lora=4,
                                     running_adapters=frozenset({f"lora-{rng.randrange(8)}"})), stale=False)
            for i in range(size)]  # fmt: skip


def measure(size: int, prompt_bytes: int, repeats: int = 300, seed: int = 0) -> float:
    """Median microseconds per schedule() + on_routed()."""
    rng = random.Random(seed)
    endpoints = _pool(size, rng)
    scheduler = Scheduler.from_config(None)
    system = "".join(rng.choice("abcdefghij ") for _ in range(prompt_bytes))
    for i in range(200):  # warm the prefix index
        request = SchedulingRequest(f"w{i}", "m", system[: prompt_bytes // 2] + str(i))
        scheduler.on_routed(request, scheduler.schedule(request, endpoints))
    samples = []
    for i in range(repeats):
        request = SchedulingRequest(f"r{i}", "m", system + str(i))
        started = time.perf_counter()
        result = scheduler.schedule(request, endpoints)
        scheduler.on_routed(request, result)
        samples.append(time.perf_counter() - started)
        del result  # its cycle state (up to 256 prefix hashes) is freed here, outside the timed decision
    samples.sort()
    return samples[len(samples) // 2] * 1e6


def main(sizes=(8, 32, 128), prompts=(1_000, 16_000, 220_000)) -> None:
    print("| endpoints | " + " | ".join(f"{p // 1000} KB prompt (us)" for p in prompts) + " |")
    print("| --- |" + " --- |" * len(prompts))
    for size in sizes:
        print(f"| {size} | " + " | ".join(f"{measure(size, p):.0f}" for p in prompts) + " |", flush=True)
