"""Scheduler behaviour: token budget and chunked prefill, max_num_seqs, preemption by recompute, LoRA deferral."""

import pytest

from modelserver.engine.block_manager import KVCacheManager
from modelserver.engine.config import EngineConfig
from modelserver.engine.lora import LoRASlots
from modelserver.engine.request import Request, RequestStatus, SamplingParams
from modelserver.engine.scheduler import Scheduler


def make(**overrides):
    config = EngineConfig(**{"block_size": 4, "num_gpu_blocks": 64, **overrides})
    kv = KVCacheManager(config.num_gpu_blocks, config.block_size)
    loras = LoRASlots(config.max_loras)
    return Scheduler(config, kv, loras)


def add(scheduler, rid, prompt_len, max_tokens=8, lora=None):
    request = Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), lora)
    scheduler.add(request)
    return request


def step(scheduler):
    """One schedule + a pretend forward: computed tokens advance, sampling appends token 7."""
    out = scheduler.schedule()
    for request, seq in zip(out.requests, out.batch.sequences, strict=True):
        request.num_computed_tokens = seq.start + seq.num_new_tokens
        scheduler.kv.register_full_blocks(request)
        if seq.samples:
            request.token_ids.append(7)
    return out


@pytest.mark.parametrize(
    ("budget", "prompt_len", "chunks"),
    [(2048, 100, [100]), (64, 100, [64, 36]), (32, 100, [32, 32, 32, 4]), (100, 100, [100])],
)
def test_chunked_prefill_splits_the_prompt_by_the_token_budget(budget, prompt_len, chunks):
    scheduler = make(max_num_batched_tokens=budget)
    add(scheduler, "a", prompt_len)
    seen = []
    for _ in chunks:
        out = step(scheduler)
        seen.append(out.batch.sequences[0].num_new_tokens)
    assert seen == chunks
    assert out.batch.sequences[0].samples  # only the last chunk samples a token


def test_running_decodes_go_before_new_prefills_in_the_budget():
    scheduler = make(max_num_batched_tokens=50)
    add(scheduler, "a", 10)
    step(scheduler)  # a prefilled
    add(scheduler, "b", 200)
    out = step(scheduler)
    assert [s.request_id for s in out.batch.sequences] == ["a", "b"]
    assert [s.num_new_tokens for s in out.batch.sequences] == [1, 49]
    assert out.batch.num_decode_tokens == 1
    assert out.batch.num_uncached_prefill_tokens == 49


def test_max_num_seqs_keeps_the_rest_waiting():
    scheduler = make(max_num_seqs=2)
    for i in range(5):
        add(scheduler, f"r{i}", 8)
    step(scheduler)
    assert len(scheduler.running) == 2
    assert len(scheduler.waiting) == 3


def test_preemption_by_recompute_frees_the_newest_and_requeues_it_first():
    scheduler = make(num_gpu_blocks=6, block_size=4)
    old = add(scheduler, "old", 8, max_tokens=100)  # 2 blocks
    step(scheduler)
    new = add(scheduler, "new", 12, max_tokens=100)  # 3 blocks (+1 for its first decode)
    step(scheduler)
    preemptions = 0
    for _ in range(12):  # decodes grow both until a block is missing
        preemptions += step(scheduler).num_preemptions
        if preemptions:
            break
    assert preemptions == 1
    assert new.status is RequestStatus.WAITING
    assert new.num_preemptions == 1
    assert new.num_computed_tokens == 0 and new.block_ids == []
    assert scheduler.waiting[0] is new
    assert old.status is RequestStatus.RUNNING


def test_lora_request_over_max_loras_is_deferred_and_the_scan_continues():
    scheduler = make(enable_lora=True, max_loras=1)
    scheduler.loras.add("a", "/a")
    scheduler.loras.add("b", "/b")
    ra = add(scheduler, "ra", 8, lora="a")
    rb = add(scheduler, "rb", 8, lora="b")
    base = add(scheduler, "base", 8)
    out = step(scheduler)
    assert {s.request_id for s in out.batch.sequences} == {"ra", "base"}
    assert out.batch.new_lora_loads == {1: ("a", "/a")}
    assert rb.status is RequestStatus.WAITING
    assert list(scheduler.waiting) == [rb]
    scheduler.finish(ra, "stop")
    out = step(scheduler)
    assert "rb" in {s.request_id for s in out.batch.sequences}
    assert out.batch.new_lora_loads == {1: ("b", "/b")}  # the idle adapter's slot is reused
    assert base.status is RequestStatus.RUNNING


@pytest.mark.parametrize(
    ("params", "eos", "outputs", "expected"),
    [
        (SamplingParams(max_tokens=3), None, [5, 5], None),
        (SamplingParams(max_tokens=3), None, [5, 5, 5], "length"),
        (SamplingParams(max_tokens=8), 0, [5, 0], "stop"),  # EOS
        (SamplingParams(max_tokens=8, ignore_eos=True), 0, [5, 0], None),
        (SamplingParams(max_tokens=8, min_tokens=3), 0, [5, 0], None),  # EOS before min_tokens is ignored
        (SamplingParams(max_tokens=8, min_tokens=3), 0, [5, 5, 0], "stop"),
        (SamplingParams(max_tokens=8, stop_token_ids=(9,)), None, [9], "stop"),
        (SamplingParams(max_tokens=100), None, [5] * 12, "length"),  # max_model_len = 16 with a 4-token prompt
    ],
)
def test_stop_conditions(params, eos, outputs, expected):
    config = EngineConfig(block_size=4, num_gpu_blocks=64, max_model_len=16)
    kv = KVCacheManager(config.num_gpu_blocks, config.block_size)
    scheduler = Scheduler(config, kv, LoRASlots(1), eos_token_id=eos)
    request = Request("r", [1, 2, 3, 4], params)
    scheduler.add(request)
    request.token_ids += outputs
    assert scheduler.check_stop(request, outputs[-1]) == expected
