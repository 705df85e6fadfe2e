"""Throughput and latency of the torch executor on this machine: `python -m modelserver.torch.measure [MODEL_DIR]`.

Reports, for batch sizes 1 and 32 (greedy, 128-token prompts, 64 new tokens): output tokens/s, TTFT, and the
per-step Python overhead (the step's wall time minus the time inside the model's forward pass)."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

import torch

from modelserver.engine.config import EngineConfig
from modelserver.engine.engine import AsyncEngine
from modelserver.engine.request import SamplingParams
from modelserver.metrics import PrometheusStatLogger
from modelserver.torch.executor import TorchExecutor, resolve_device, resolve_dtype
from modelserver.torch.loader import load_model
from modelserver.torch.tiny import make_tiny_model


async def measure(model_dir: str, batch: int, device: torch.device, dtype: torch.dtype, prompt_len=128, new=64) -> dict:
    cfg = EngineConfig(num_gpu_blocks=4096, max_num_batched_tokens=8192, max_num_seqs=256)
    model = load_model(model_dir, 1, 16, device, dtype)
    executor = TorchExecutor(model, cfg.block_size, cfg.num_gpu_blocks, eos_token_id=None)
    forward_seconds = [0.0]
    forward = model.forward

    def timed_forward(*args):
        started = time.perf_counter()
        out = forward(*args)
        if device.type == "cuda":
            torch.cuda.synchronize()
        forward_seconds[0] += time.perf_counter() - started
        return out

    model.forward = timed_forward
    metrics = PrometheusStatLogger(cfg, "measure")
    engine = AsyncEngine(cfg, executor, model_name="measure", stat_loggers=[metrics])
    await engine.start()
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)

    async def one(i: int) -> float:
        started, ttft = time.perf_counter(), None
        async for _ in engine.generate(f"r{i}", [(i * 7 + j) % 900 + 1 for j in range(prompt_len)], params):
            ttft = ttft or time.perf_counter() - started
        return ttft

    try:
        await one(-1)  # warm up
        steps_before = sum(metrics.iteration_tokens.counts)  # one observation per engine step
        forward_seconds[0] = 0.0
        started = time.perf_counter()
        ttfts = await asyncio.gather(*(one(i) for i in range(batch)))
        elapsed = time.perf_counter() - started
        steps = sum(metrics.iteration_tokens.counts) - steps_before
    finally:
        await engine.stop()
    return {
        "batch": batch,
        "tokens_per_s": batch * new / elapsed,
        "ttft_ms": statistics.median(ttfts) * 1e3,
        "step_ms": elapsed / steps * 1e3,
        "python_overhead_ms": (elapsed - forward_seconds[0]) / steps * 1e3,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("model", nargs="?", help="model directory (default: a fresh tiny model)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    args = p.parse_args()
    model_dir = args.model or str(make_tiny_model(tempfile.mkdtemp(prefix="tiny-")))
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    print(f"model {model_dir} on {device} ({dtype})")
    print("| batch | output tokens/s | TTFT p50 ms | step ms | Python overhead per step ms |")
    print("| --- | --- | --- | --- | --- |")
    for batch in (1, 32):
        r = asyncio.run(measure(model_dir, batch, device, dtype))
        print(
            f"| {r['batch']} | {r['tokens_per_s']:.0f} | {r['ttft_ms']:.1f} | {r['step_ms']:.2f} | "
            f"{r['python_overhead_ms']:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
