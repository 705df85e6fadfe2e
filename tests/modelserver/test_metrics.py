"""Metric semantics under load, in-process: the engine with the sim executor and short modelled times."""

import asyncio
import time

import pytest
from prometheus_client import generate_latest

from modelserver.engine.config import EngineConfig
from modelserver.engine.engine import AsyncEngine
from modelserver.engine.request import SamplingParams
from modelserver.engine.sim import SimExecutor, SimTiming
from protocol.metrics import parse_metrics

FILLER = list(range(100, 164))


def engine(timing=None, **config):
    cfg = EngineConfig(**{"num_gpu_blocks": 512, "block_size": 16, **config})
    timing = timing or SimTiming(prefill_overhead=0.001, prefill_time_per_token=0.0001, decode_base=0.005)
    return AsyncEngine(cfg, SimExecutor(timing, cfg.block_size, cfg.num_gpu_blocks, FILLER), model_name="m",
                       log_stats=False, lora_modules={"a": "/a", "b": "/b"} if cfg.enable_lora else None)  # fmt: skip


async def run(eng, rid, prompt, max_tokens=4, lora=None):
    tokens, last, started, first = [], None, time.monotonic(), None
    async for out in eng.generate(rid, prompt, SamplingParams(max_tokens=max_tokens), lora):
        first = first or time.monotonic()
        tokens += out.new_token_ids
        last = out
    return tokens, last, first - started


def sample(eng, name, **labels):
    return eng.registry.get_sample_value(name, {"model_name": "m", "engine": "0", **labels})


def snapshot(eng):
    return parse_metrics(generate_latest(eng.registry).decode())


async def test_generates_exact_lengths_and_finish_reasons():
    eng = engine()
    await eng.start()
    try:
        tokens, last, _ = await run(eng, "a", list(range(1, 40)), max_tokens=7)
        assert len(tokens) == 7
        assert last.finish_reason == "length" and last.finished
        assert sample(eng, "vllm:generation_tokens_total") == 7
        assert sample(eng, "vllm:prompt_tokens_total") == 39
        assert sample(eng, "vllm:request_success_total", finished_reason="length") == 1
        assert sample(eng, "vllm:e2e_request_latency_seconds_count") == 1
        assert sample(eng, "vllm:inter_token_latency_seconds_count") == 6
    finally:
        await eng.stop()


async def test_waiting_rises_when_max_num_seqs_is_reached():
    eng = engine(max_num_seqs=2)
    await eng.start()
    try:
        tasks = [asyncio.create_task(run(eng, f"r{i}", list(range(1, 20)), max_tokens=30)) for i in range(6)]
        await asyncio.sleep(0.05)
        snap = snapshot(eng)
        assert snap.running == 2
        assert snap.waiting == 4
        await asyncio.gather(*tasks)
        snap = snapshot(eng)
        assert (snap.running, snap.waiting) == (0, 0)
    finally:
        await eng.stop()


async def test_kv_usage_rises_with_long_prompts():
    eng = engine(num_gpu_blocks=256)
    await eng.start()
    try:
        assert snapshot(eng).kv_usage == 0.0
        tasks = [asyncio.create_task(run(eng, f"r{i}", list(range(i * 1000, i * 1000 + 800)), 40)) for i in range(3)]
        await asyncio.sleep(0.1)
        assert snapshot(eng).kv_usage >= 0.4  # the first step alone allocates 128 of 256 blocks
        await asyncio.gather(*tasks)
        assert snapshot(eng).kv_usage == 0.0
    finally:
        await eng.stop()


async def test_repeated_prompt_hits_the_prefix_cache_and_ttft_drops_by_the_modelled_amount():
    timing = SimTiming(prefill_overhead=0.002, prefill_time_per_token=0.0002, decode_base=0.002)
    eng = engine(timing)
    await eng.start()
    try:
        prompt = list(range(1, 641))  # 40 blocks
        _, cold, cold_ttft = await run(eng, "cold", prompt)
        _, warm, warm_ttft = await run(eng, "warm", prompt)
        assert cold.num_cached_tokens == 0
        assert warm.num_cached_tokens == 624  # 39 blocks: the last token is always computed
        assert sample(eng, "vllm:prefix_cache_hits_total") == 624
        assert sample(eng, "vllm:prefix_cache_queries_total") == 1280
        saved = 624 * timing.prefill_time_per_token  # 0.125 s of modelled prefill
        assert cold_ttft - warm_ttft == pytest.approx(saved, abs=0.03)
    finally:
        await eng.stop()


async def test_adapter_moves_from_waiting_to_running():
    eng = engine(enable_lora=True, max_loras=1)
    await eng.start()
    try:
        first = asyncio.create_task(run(eng, "ra", list(range(1, 20)), max_tokens=20, lora="a"))
        await asyncio.sleep(0.02)
        second = asyncio.create_task(run(eng, "rb", list(range(1, 20)), max_tokens=5, lora="b"))
        await asyncio.sleep(0.02)
        snap = snapshot(eng)
        assert snap.running_adapters == {"a"} and snap.waiting_adapters == {"b"}
        assert snap.max_lora == 1
        await first
        await asyncio.sleep(0.02)
        snap = snapshot(eng)
        assert snap.running_adapters == {"b"} and snap.waiting_adapters == frozenset()
        await second
        page = generate_latest(eng.registry).decode()
        assert page.count("vllm:lora_requests_info{") == 1  # old label sets are removed
    finally:
        await eng.stop()


async def test_abort_frees_blocks_and_counts_abort():
    eng = engine()
    await eng.start()
    try:
        stream = eng.generate("x", list(range(1, 100)), SamplingParams(max_tokens=1000))
        await anext(stream)
        await stream.aclose()  # what a client disconnect does
        assert sample(eng, "vllm:request_success_total", finished_reason="abort") == 1
        assert eng.kv.num_free_blocks == eng.kv.num_blocks
        assert eng.num_unfinished == 0
    finally:
        await eng.stop()


async def test_preemptions_are_counted_and_requests_still_complete():
    eng = engine(SimTiming.zero(), num_gpu_blocks=12, block_size=4)
    await eng.start()
    try:
        results = await asyncio.gather(*(run(eng, f"r{i}", list(range(i * 50, i * 50 + 8)), 16) for i in range(4)))
        assert all(len(tokens) == 16 for tokens, _, _ in results)
        assert sample(eng, "vllm:num_preemptions_total") > 0
    finally:
        await eng.stop()


async def test_hidden_v0_metric_only_when_asked():
    plain = engine()
    assert b"gpu_cache_usage_perc" not in generate_latest(plain.registry)
    cfg = EngineConfig(num_gpu_blocks=16)
    hidden = AsyncEngine(cfg, SimExecutor(SimTiming.zero(), 16, 16, FILLER), model_name="m", log_stats=False,
                         show_hidden_metrics_for_version="0.10")  # fmt: skip
    page = generate_latest(hidden.registry).decode()
    assert "vllm:gpu_cache_usage_perc" in page and "DEPRECATED" in page


async def test_fast_page_equals_prometheus_client_exposition():
    from prometheus_client.parser import text_string_to_metric_families

    eng = engine(enable_lora=True)
    await eng.start()
    try:
        await run(eng, "a", list(range(1, 40)), max_tokens=5, lora="a")

        def samples(text):
            families = text_string_to_metric_families(text)
            return sorted((s.name, tuple(sorted(s.labels.items())), s.value) for f in families for s in f.samples)

        assert samples(eng.metrics.render().decode()) == samples(generate_latest(eng.registry).decode())
    finally:
        await eng.stop()
