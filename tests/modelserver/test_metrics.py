"""Metric semantics under load, in-process: the engine with the sim executor and short modelled times."""

import asyncio
import time

import pytest
from prometheus_client import generate_latest

from modelserver.engine.config import EngineConfig
from modelserver.engine.engine import AsyncEngine
from modelserver.engine.request import SamplingParams
from modelserver.engine.sim import SimExecutor, SimTiming
from modelserver.metrics import LoggingStatLogger, PrometheusStatLogger, prometheus_logger
from protocol.metrics import (
    ENGINES,
    VLLM_KV_CACHE_USAGE,
    VLLM_TIME_TO_FIRST_TOKEN_SECONDS,
    inter_token_totals,
    parse_metrics,
)

FILLER = list(range(100, 164))


def engine(timing=None, **config):
    cfg = EngineConfig(**{"num_gpu_blocks": 512, "block_size": 16, **config})
    timing = timing or SimTiming(prefill_overhead=0.001, prefill_time_per_token=0.0001, decode_base=0.005)
    return AsyncEngine(
        cfg,
        SimExecutor(timing, cfg.block_size, cfg.num_gpu_blocks, FILLER),
        model_name="m",
        stat_loggers=[PrometheusStatLogger(cfg, "m")],
        lora_modules={"a": "/a", "b": "/b"} if cfg.enable_lora else None,
    )


def registry(eng):
    return prometheus_logger(eng.stat_loggers).registry


async def run(eng, rid, prompt, max_tokens=4, lora=None):
    tokens, last, started, first = [], None, time.monotonic(), None
    async for out in eng.generate(rid, prompt, SamplingParams(max_tokens=max_tokens), lora):
        first = first or time.monotonic()
        tokens += out.new_token_ids
        last = out
    return tokens, last, first - started


def sample(eng, name, **labels):
    return registry(eng).get_sample_value(name, {"model_name": "m", "engine": "0", **labels})


def snapshot(eng):
    return parse_metrics(generate_latest(registry(eng)).decode())


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
        page = generate_latest(registry(eng)).decode()
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


async def test_preemptions_are_counted_and_stretch_intervals_instead_of_repeating_them():
    eng = engine(SimTiming.zero(), num_gpu_blocks=12, block_size=4)
    await eng.start()
    try:
        results = await asyncio.gather(*(run(eng, f"r{i}", list(range(i * 50, i * 50 + 8)), 16) for i in range(4)))
        assert all(len(tokens) == 16 for tokens, _, _ in results)
        assert sample(eng, "vllm:num_preemptions_total") > 0
        # Seed 001: a recomputed request still has one first token and one prefill; the rest are inter-token gaps.
        assert sample(eng, "vllm:time_to_first_token_seconds_count") == 4
        assert sample(eng, "vllm:request_prefill_time_seconds_count") == 4
        assert sample(eng, "vllm:request_queue_time_seconds_count") == 4
        assert sample(eng, "vllm:inter_token_latency_seconds_count") == 4 * 15
        assert sample(eng, "vllm:prompt_tokens_total") == 4 * 8  # recomputed prompts are not counted again
        assert sample(eng, "vllm:prefix_cache_queries_total") == 4 * 8  # nor queried again
    finally:
        await eng.stop()


async def test_prefill_is_observed_at_the_first_token_and_decode_at_the_end():
    eng = engine()
    await eng.start()
    try:
        stream = eng.generate("x", list(range(1, 50)), SamplingParams(max_tokens=1000))
        await anext(stream)
        assert sample(eng, "vllm:request_prefill_time_seconds_count") == 1
        assert sample(eng, "vllm:time_to_first_token_seconds_count") == 1
        assert sample(eng, "vllm:request_decode_time_seconds_count") == 0
        await anext(stream)
        await stream.aclose()
        assert sample(eng, "vllm:request_decode_time_seconds_count") == 1
        assert sample(eng, "vllm:request_inference_time_seconds_count") == 1
        assert sample(eng, "vllm:e2e_request_latency_seconds_count") == 1
        decode = sample(eng, "vllm:request_decode_time_seconds_sum")
        inference = sample(eng, "vllm:request_inference_time_seconds_sum")
        prefill = sample(eng, "vllm:request_prefill_time_seconds_sum")
        assert inference == pytest.approx(prefill + decode)
    finally:
        await eng.stop()


async def test_iteration_and_request_histograms_use_vllms_buckets_and_definitions():
    eng = engine(max_model_len=1000)
    await eng.start()
    try:
        await asyncio.gather(run(eng, "a", list(range(1, 31)), max_tokens=5), run(eng, "b", list(range(1, 11)), 3))
        # Per step: prompt tokens of the prefills that completed plus tokens generated, as vLLM counts them.
        assert sample(eng, "vllm:iteration_tokens_total_sum") == 30 + 10 + 5 + 3
        assert sample(eng, "vllm:iteration_tokens_total_bucket", le="16384.0") is not None
        assert sample(eng, "vllm:iteration_tokens_total_bucket", le="8.0") is not None
        assert sample(eng, "vllm:request_prompt_tokens_bucket", le="1000.0") is not None  # 1-2-5 up to max_model_len
        assert sample(eng, "vllm:request_prompt_tokens_bucket", le="2000.0") is None
        assert sample(eng, "vllm:request_max_num_generation_tokens_sum") == 5 + 3
        assert sample(eng, "vllm:request_params_max_tokens_sum") == 5 + 3
        assert sample(eng, "vllm:request_params_n_bucket", le="1.0") == 2
        assert sample(eng, "vllm:time_to_first_token_seconds_bucket", le="2560.0") == 2
        assert sample(eng, "vllm:e2e_request_latency_seconds_bucket", le="7680.0") == 2
        assert sample(eng, "vllm:request_time_per_output_token_seconds_count") == 2
    finally:
        await eng.stop()


async def test_info_gauges():
    eng = engine(enable_lora=True, max_loras=2)
    await eng.start()
    try:
        before = time.time()
        await run(eng, "a", list(range(1, 20)), max_tokens=2, lora="a")
        snap = snapshot(eng)
        assert (snap.block_size, snap.num_gpu_blocks, snap.max_lora) == (16, 512, 2)
        page = generate_latest(registry(eng)).decode()
        (line,) = [ln for ln in page.splitlines() if ln.startswith("vllm:lora_requests_info{")]
        assert 'running_lora_adapters=""' in line and 'waiting_lora_adapters=""' in line
        assert before <= float(line.rsplit(" ", 1)[1]) <= time.time()  # wall-clock time of the last update
        assert 'enable_prefix_caching="True"' in page and 'block_size="16"' in page
    finally:
        await eng.stop()


async def test_hidden_v0_metrics_only_when_asked():
    page = generate_latest(registry(engine())).decode()
    for name in ("gpu_cache_usage_perc", "gpu_prefix_cache", "vllm:time_per_output_token_seconds"):
        assert name not in page
    cfg = EngineConfig(num_gpu_blocks=16)
    hidden = AsyncEngine(
        cfg,
        SimExecutor(SimTiming.zero(), 16, 16, FILLER),
        model_name="m",
        stat_loggers=[PrometheusStatLogger(cfg, "m", show_hidden_metrics_for_version="0.10")],
    )
    await hidden.start()
    try:
        await run(hidden, "a", list(range(1, 40)), max_tokens=3)
        page = generate_latest(registry(hidden)).decode()
        for name in (
            "vllm:gpu_cache_usage_perc",
            "vllm:gpu_prefix_cache_queries",
            "vllm:time_per_output_token_seconds",
        ):
            (help_line, *_) = [ln for ln in page.splitlines() if ln.startswith(f"# HELP {name}")]
            assert "DEPRECATED" in help_line
        assert sample(hidden, "vllm:gpu_prefix_cache_queries_total") == 39
        assert sample(hidden, "vllm:time_per_output_token_seconds_count") == 2
    finally:
        await hidden.stop()


EPP_SAMPLES = frozenset(ENGINES["vllm"].sample_names())


@pytest.mark.parametrize(
    "names",
    [
        None,
        EPP_SAMPLES,  # what the EPP's scraper asks for
        frozenset({VLLM_TIME_TO_FIRST_TOKEN_SECONDS + "_bucket", VLLM_KV_CACHE_USAGE, "vllm:no_such_metric"}),
        frozenset({""}),  # `?name[]=` asks for nothing
    ],
    ids=["whole", "epp", "buckets-and-unknown", "nothing"],
)
async def test_fast_page_equals_prometheus_client_exposition(names):
    from prometheus_client.parser import text_string_to_metric_families

    eng = engine(enable_lora=True)
    await eng.start()
    try:
        await run(eng, "a", list(range(1, 40)), max_tokens=5, lora="a")

        def samples(text):
            families = text_string_to_metric_families(text)
            return sorted((s.name, tuple(sorted(s.labels.items())), s.value) for f in families for s in f.samples)

        reference = registry(eng) if names is None else registry(eng).restricted_registry(names)
        page = prometheus_logger(eng.stat_loggers).render(names).decode()
        assert samples(page) == samples(generate_latest(reference).decode())
        if names is EPP_SAMPLES:  # the few samples read the same as the whole page
            whole = prometheus_logger(eng.stat_loggers).render().decode()
            assert len(page) < len(whole) / 10
            assert parse_metrics(page, scraped_at=0.0) == parse_metrics(whole, scraped_at=0.0)
            assert inter_token_totals(page) == inter_token_totals(whole) != (0.0, 0.0)
    finally:
        await eng.stop()


async def test_logging_stat_logger_prints_the_summary_line(caplog):
    log_line = LoggingStatLogger("Engine 003")
    eng = AsyncEngine(
        EngineConfig(num_gpu_blocks=64),
        SimExecutor(SimTiming.zero(), 16, 64, FILLER),
        model_name="m",
        engine_index=3,
        stat_loggers=[log_line],
    )
    await eng.start()
    try:
        with caplog.at_level("INFO", logger="modelserver.stats"):
            await run(eng, "a", list(range(1, 33)), max_tokens=2)
            await run(eng, "b", list(range(1, 33)), max_tokens=2)  # 16 of 32 tokens hit the cache
            log_line.log_interval = 0.0  # the next update logs
            eng._record(None)
            log_line.log_interval = 5.0
        line = caplog.records[-1].getMessage()
        assert line.startswith("Engine 003: Avg prompt throughput: ")
        for part in ("Avg generation throughput: ", "Running: ", "Waiting: ", "GPU KV cache usage: "):
            assert part in line
        assert log_line.hit_rate == 16 / 64
        assert line.endswith("Prefix cache hit rate: 25.0%")
    finally:
        await eng.stop()


async def test_stat_logger_logs_the_last_busy_interval_then_goes_quiet(caplog):
    eng = AsyncEngine(
        EngineConfig(num_gpu_blocks=64),
        SimExecutor(SimTiming.zero(), 16, 64, FILLER),
        model_name="m",
        stat_loggers=[LoggingStatLogger("Engine 000", log_interval=0.05)],
    )
    await eng.start()
    try:
        with caplog.at_level("DEBUG", logger="modelserver.stats"):
            await run(eng, "a", list(range(1, 33)), max_tokens=2)
            await asyncio.sleep(0.3)  # idle: the engine still wakes once per interval
        levels = [r.levelname for r in caplog.records]
        assert "INFO" in levels and levels[-1] == "DEBUG"
    finally:
        await eng.stop()
