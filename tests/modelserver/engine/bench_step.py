"""Engine step overhead with N running sequences on the zero-delay sim (no modelled GPU time at all).

    .venv/bin/python -m tests.modelserver.engine.bench_step [--seqs 256] [--seconds 3] [--kv-events]

Reports two figures per step, averaged over every step in the window:
* core: the engine's own work, schedule() plus the post-step update (tokens, stop checks, KV bookkeeping, metrics),
  as wall time and as this thread's CPU time (the latter holds up on a machine shared with other work);
* whole: wall time per step of the running event loop, which adds waking each sequence's consumer coroutine
  (what a server's streaming handlers would do) and asyncio's own scheduling.
With --kv-events the engine also records vLLM KV events and publishes them (ZMQ PUB, nobody subscribed).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass

from modelserver.engine.config import EngineConfig
from modelserver.engine.engine import AsyncEngine
from modelserver.engine.kv_events import ZmqEventPublisher
from modelserver.engine.request import SamplingParams
from modelserver.engine.sim import SimExecutor, SimTiming
from modelserver.metrics import PrometheusStatLogger
from protocol.kv_events import KVEventsConfig


@dataclass
class StepOverhead:
    seqs: int
    steps: int
    core_ms: float
    core_cpu_ms: float
    whole_ms: float


async def _consume(engine: AsyncEngine, request_id: str, prompt: list[int]) -> None:
    async for _ in engine.generate(request_id, prompt, SamplingParams(max_tokens=1_000_000, ignore_eos=True)):
        pass


async def measure(seqs: int = 256, seconds: float = 2.0, prompt_len: int = 32, kv_events: bool = False) -> StepOverhead:
    config = EngineConfig(num_gpu_blocks=65536, max_num_seqs=seqs, max_model_len=1_100_000)
    executor = SimExecutor(SimTiming.zero(), config.block_size, config.num_gpu_blocks, list(range(100, 164)))
    metrics = PrometheusStatLogger(config, "bench")
    publisher = None
    if kv_events:
        events_config = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*")
        publisher = ZmqEventPublisher(events_config, "kv@bench@bench")
    engine = AsyncEngine(config, executor, model_name="bench", stat_loggers=[metrics], kv_events=publisher)
    await engine.start()
    tasks = [asyncio.create_task(_consume(engine, f"r{i}", list(range(i, i + prompt_len)))) for i in range(seqs)]
    try:
        running = engine.scheduler.running
        while len(running) < seqs or min(r.num_output_tokens for r in running) < 2:  # all prefilled, decoding
            await asyncio.sleep(0.01)
        core = core_cpu = 0.0
        schedule, process = engine.scheduler.schedule, engine._process

        def timed(fn):
            def wrapper(*args):
                nonlocal core, core_cpu
                t0, c0 = time.perf_counter(), time.thread_time()
                try:
                    return fn(*args)
                finally:
                    core += time.perf_counter() - t0
                    core_cpu += time.thread_time() - c0

            return wrapper

        engine.scheduler.schedule, engine._process = timed(schedule), timed(process)
        steps = metrics.iteration_tokens
        steps_before, started = sum(steps.counts), time.perf_counter()
        await asyncio.sleep(seconds)
        elapsed, num_steps = time.perf_counter() - started, sum(steps.counts) - steps_before
        if len(running) != seqs:
            raise RuntimeError(f"expected {seqs} running sequences, found {len(running)}")
        return StepOverhead(
            seqs, num_steps, core / num_steps * 1e3, core_cpu / num_steps * 1e3, elapsed / num_steps * 1e3
        )
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await engine.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--kv-events", action="store_true", help="record and publish vLLM KV events")
    args = parser.parse_args()
    result = asyncio.run(measure(args.seqs, args.seconds, kv_events=args.kv_events))
    print(
        f"{result.seqs} running sequences, {result.steps} steps: engine core {result.core_ms:.3f} ms/step "
        f"({result.core_cpu_ms:.3f} ms CPU), whole step incl. {result.seqs} consumer wake-ups {result.whole_ms:.3f} ms/step"
    )


if __name__ == "__main__":
    main()
