"""AsyncEngine on the sim: replicas sharing one event loop, idle cost, cancellation, LoRA load latency."""

import asyncio
import random
import time

import pytest

from modelserver.engine.config import EngineConfig
from modelserver.engine.engine import AsyncEngine
from modelserver.engine.request import SamplingParams
from modelserver.engine.sim import SimExecutor, SimTiming
from modelserver.metrics import PrometheusStatLogger, prometheus_logger

FILLER = list(range(100, 164))


def make_engine(timing: SimTiming, index: int = 0, **config) -> AsyncEngine:
    cfg = EngineConfig(**{"num_gpu_blocks": 256, **config})
    return AsyncEngine(
        cfg,
        SimExecutor(timing, cfg.block_size, cfg.num_gpu_blocks, FILLER),
        model_name="m",
        engine_index=index,
        stat_loggers=[PrometheusStatLogger(cfg, "m", index)],
        lora_modules={n: f"/{n}" for n in "abc"} if cfg.enable_lora else None,
    )


async def ttft(engine: AsyncEngine, rid: str, prompt: list[int], lora: str | None = None) -> float:
    started = time.monotonic()
    stream = engine.generate(rid, prompt, SamplingParams(max_tokens=1), lora)
    async for _ in stream:
        return time.monotonic() - started
    raise AssertionError("no output")


async def test_idle_replicas_block_instead_of_spinning():
    engines = [make_engine(SimTiming.zero(), i) for i in range(16)]
    for engine in engines:
        await engine.start()
    try:
        await asyncio.gather(*(ttft(e, "warm", [1, 2, 3]) for e in engines))
        cpu = time.process_time()
        await asyncio.sleep(0.5)
        assert time.process_time() - cpu < 0.05  # 16 idle engines cost (almost) nothing
    finally:
        for engine in engines:
            await engine.stop()


@pytest.mark.timing
async def test_replicas_on_one_loop_serve_concurrently():
    timing = SimTiming(prefill_overhead=0.05, prefill_time_per_token=0.0, decode_base=0.0, decode_per_seq=0.0)
    engines = [make_engine(timing, i) for i in range(8)]
    for engine in engines:
        await engine.start()
    try:
        started = time.monotonic()
        await asyncio.gather(*(ttft(e, "r", [1, 2, 3]) for e in engines))
        assert time.monotonic() - started < 0.05 * 4  # overlapped, not 8 x 50 ms in a row
    finally:
        for engine in engines:
            await engine.stop()


async def test_random_cancellations_free_everything_and_count_every_request():
    engine = make_engine(SimTiming(decode_base=0.001, prefill_overhead=0.0005), num_gpu_blocks=64, block_size=4)
    await engine.start()
    rng = random.Random(1)

    async def client(i: int) -> None:
        prompt = [rng.randrange(4) for _ in range(rng.randrange(1, 60))]
        async for _ in engine.generate(f"r{i}", prompt, SamplingParams(max_tokens=rng.randrange(1, 30))):
            pass

    try:
        tasks = [asyncio.create_task(client(i)) for i in range(60)]
        await asyncio.sleep(0.02)
        for task in rng.sample(tasks, 20):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert engine.num_unfinished == 0
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
        labels = {"model_name": "m", "engine": "0"}
        counts = [
            prometheus_logger(engine.stat_loggers).registry.get_sample_value(
                "vllm:request_success_total", {**labels, "finished_reason": reason}
            )
            for reason in ("stop", "length", "abort")
        ]
        assert sum(counts) == 60
        assert counts[2] >= 1
    finally:
        await engine.stop()


@pytest.mark.timing
async def test_lora_load_latency_only_when_the_adapter_enters_a_slot():
    timing = SimTiming(
        prefill_overhead=0.0,
        prefill_time_per_token=0.0,
        decode_base=0.0,
        decode_per_seq=0.0,
        lora_load_time=0.03,
        lora_cold_load_time=0.06,
    )
    engine = make_engine(timing, enable_lora=True, max_loras=1, max_cpu_loras=2)
    await engine.start()
    try:
        cold = await ttft(engine, "1", [1, 2, 3], "a")  # from storage into host memory, then into the slot
        resident = await ttft(engine, "2", [1, 2, 3], "a")  # already in the slot
        await ttft(engine, "3", [1, 2, 3], "b")  # b takes the only slot; a stays in host memory
        warm = await ttft(engine, "4", [1, 2, 3], "a")  # from host memory into the slot
        assert cold == pytest.approx(0.09, abs=0.025)
        assert resident < 0.02
        assert warm == pytest.approx(0.03, abs=0.02)
    finally:
        await engine.stop()


@pytest.mark.parametrize(
    ("prompt", "params", "lora", "error"),
    [
        ([], SamplingParams(), None, ValueError),
        (list(range(100)), SamplingParams(), None, ValueError),  # no room for output within max_model_len = 100
        ([1] * 70, SamplingParams(), None, ValueError),  # more than the whole KV cache (4 blocks of 16)
        ([1, 2], SamplingParams(max_tokens=0), None, ValueError),
        ([1, 2], SamplingParams(min_tokens=-1), None, ValueError),
        ([1, 2], SamplingParams(), "unknown", KeyError),
    ],
)
async def test_bad_requests_are_rejected_and_the_engine_keeps_serving(prompt, params, lora, error):
    engine = make_engine(SimTiming.zero(), num_gpu_blocks=4, max_model_len=100)
    await engine.start()
    try:
        with pytest.raises(error):
            async for _ in engine.generate("bad", prompt, params, lora):
                pass
        assert await ttft(engine, "good", [1, 2, 3]) >= 0
        assert engine.num_unfinished == 0 and not engine.is_dead
    finally:
        await engine.stop()


async def test_an_adapter_that_fails_to_load_fails_its_requests_alone():
    engine = make_engine(SimTiming.zero(), enable_lora=True, max_loras=2)
    real_load = engine.executor.load_lora
    broken = {"b"}

    def load_lora(slot, name, path):
        if name in broken:
            raise FileNotFoundError(f"{path}/adapter_config.json")
        real_load(slot, name, path)

    engine.executor.load_lora = load_lora
    await engine.start()

    async def run(rid, lora):
        tokens = []
        async for output in engine.generate(rid, [1, 2, 3, 4], SamplingParams(max_tokens=5), lora):
            tokens += output.new_token_ids
        return tokens

    try:
        results = await asyncio.gather(
            run("base", None), run("a", "a"), run("b1", "b"), run("b2", "b"), return_exceptions=True
        )
        assert len(results[0]) == 5 and len(results[1]) == 5
        for failed in results[2:]:
            assert isinstance(failed, ValueError) and "loading LoRA adapter 'b' failed" in str(failed)
            assert "adapter_config.json" in str(failed)
        assert not engine.is_dead and engine.num_unfinished == 0
        assert "b" in engine.lora_adapters  # still registered: fixing the files makes it work without a restart
        broken.clear()
        assert len(await run("b3", "b")) == 5
        assert engine.kv.usage == 0.0
    finally:
        await engine.stop()
