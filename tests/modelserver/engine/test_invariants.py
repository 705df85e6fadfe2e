"""Randomised workloads through the scheduler and block manager: whatever arrives, aborts or gets preempted, every
request ends with exactly its tokens, block reference counts stay consistent, and all KV is free at the end."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modelserver.engine.block_manager import KVCacheManager
from modelserver.engine.config import EngineConfig
from modelserver.engine.lora import LoRASlots
from modelserver.engine.request import Request, RequestStatus, SamplingParams
from modelserver.engine.scheduler import Scheduler

request_strategy = st.tuples(
    st.lists(st.integers(0, 3), min_size=1, max_size=40),  # prompt over a tiny vocabulary: prefixes get shared
    st.integers(1, 12),  # max_tokens
    st.sampled_from([None, "a", "b", "c"]),  # adapter
    st.integers(0, 6),  # arrival step
    st.one_of(st.none(), st.integers(0, 20)),  # abort at this step
)


def check_block_accounting(kv: KVCacheManager, live: list[Request]) -> None:
    refs = [0] * kv.num_blocks
    for request in live:
        for block_id in request.block_ids:
            refs[block_id] += 1
    assert refs == kv._ref_counts
    assert kv.num_free_blocks == refs.count(0)
    assert 0.0 <= kv.usage <= 1.0


@settings(max_examples=150, suppress_health_check=list(HealthCheck))
@given(
    workload=st.lists(request_strategy, min_size=1, max_size=12),
    num_blocks=st.integers(4, 24),
    budget=st.sampled_from([3, 8, 64]),
    max_num_seqs=st.integers(1, 6),
    max_loras=st.integers(1, 2),
    caching=st.booleans(),
)
def test_random_workloads_finish_exactly_and_free_everything(
    workload, num_blocks, budget, max_num_seqs, max_loras, caching
):
    block_size = 4
    config = EngineConfig(
        block_size=block_size,
        num_gpu_blocks=num_blocks,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        max_model_len=1000,
        enable_prefix_caching=caching,
        enable_lora=True,
        max_loras=max_loras,
        max_cpu_loras=2,
    )
    kv = KVCacheManager(num_blocks, block_size, caching, sample_rate=0.5)
    loras = LoRASlots(max_loras, 2)
    for name in "abc":
        loras.add(name, f"/{name}")
    scheduler = Scheduler(config, kv, loras)
    pending = []
    for i, (prompt, max_tokens, lora, arrival, abort_at) in enumerate(workload):
        if kv.blocks_needed(len(prompt) + 1) > num_blocks:  # the engine rejects these up front
            continue
        pending.append((arrival, abort_at, Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens), lora)))
    requests = [r for _, _, r in pending]
    finished: dict[str, str] = {}
    for step in range(2000):
        for arrival, _, request in pending:
            if arrival == step:
                scheduler.add(request)
        for _, abort_at, request in pending:
            added = request in scheduler.running or request in scheduler.waiting
            if abort_at == step and request.status is not RequestStatus.FINISHED and added:
                scheduler.finish(request, "abort")
                finished[request.request_id] = "abort"
        out = scheduler.schedule()
        batch_loras = {r.lora_name for r in out.requests if r.lora_name}
        assert len(batch_loras) <= max_loras
        assert len(out.requests) <= max_num_seqs
        assert sum(s.num_new_tokens for s in out.batch.sequences) <= budget
        for request, seq in zip(out.requests, out.batch.sequences, strict=True):
            assert len(seq.block_table) * block_size >= seq.start + seq.num_new_tokens
            request.num_computed_tokens = seq.start + seq.num_new_tokens
            kv.register_full_blocks(request)
            if seq.samples:
                request.token_ids.append(7)
                reason = scheduler.check_stop(request, 7)
                if reason is not None:
                    scheduler.finish(request, reason)
                    finished[request.request_id] = reason
        check_block_accounting(kv, scheduler.running)
        if step > 6 and not scheduler.num_unfinished:
            break
    assert not scheduler.num_unfinished, "the workload did not drain"
    assert kv.num_free_blocks == num_blocks
    for request in requests:
        if finished.get(request.request_id) == "length":  # max_tokens, or a sequence as long as the whole KV cache
            expected = min(request.params.max_tokens, kv.capacity_tokens - request.num_prompt_tokens)
            assert request.num_output_tokens == expected
        else:
            assert finished.get(request.request_id) == "abort"
