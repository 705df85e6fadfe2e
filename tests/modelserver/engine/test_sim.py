"""The sim executor's timing model and outputs."""

import random

import pytest

from modelserver.engine.executor import ScheduledBatch, ScheduledSequence
from modelserver.engine.request import SamplingParams
from modelserver.engine.sim import SimExecutor, SimTiming

TIMING = SimTiming(
    prefill_overhead=0.004,
    prefill_time_per_token=0.0001,
    decode_base=0.012,
    decode_per_seq=0.00005,
    lora_load_time=0.02,
    lora_cold_load_time=0.05,
)


@pytest.mark.parametrize(
    ("batch", "seconds"),
    [
        (ScheduledBatch([], num_decode_tokens=1), 0.012 + 0.00005),
        (ScheduledBatch([], num_decode_tokens=256), 0.012 + 256 * 0.00005),  # ITL grows with the batch
        (ScheduledBatch([], num_uncached_prefill_tokens=1000), 0.004 + 0.1),
        (ScheduledBatch([], num_uncached_prefill_tokens=100, num_decode_tokens=10), 0.004 + 0.01 + 0.012 + 0.0005),
        (ScheduledBatch([], num_decode_tokens=1, new_lora_loads={1: ("a", "/a")}), 0.02 + 0.012 + 0.00005),
        (
            ScheduledBatch([], num_decode_tokens=1, new_lora_loads={1: ("a", "/a")}, num_cold_lora_loads=1),
            0.07 + 0.012 + 0.00005,
        ),
    ],
)
def test_step_time_model(batch, seconds):
    assert TIMING.step_time(batch, random.Random(0)) == pytest.approx(seconds)


def test_zero_timing_is_free_and_jitter_is_seeded():
    batch = ScheduledBatch([], num_uncached_prefill_tokens=500, num_decode_tokens=64, new_lora_loads={1: ("a", "/")})
    assert SimTiming.zero().step_time(batch, random.Random(0)) == 0.0
    jittery = SimTiming(jitter=0.1)
    first = [jittery.step_time(batch, random.Random(7)) for _ in range(3)]
    assert len(set(first)) == 1  # same seed, same time
    assert first[0] != SimTiming().step_time(batch, random.Random(7))


async def test_tokens_are_deterministic_filler_and_only_for_sampling_sequences():
    executor = SimExecutor(SimTiming.zero(), 16, 64, filler_token_ids=[5, 6, 7])
    params = SamplingParams()

    def seq(rid, tokens, samples):
        return ScheduledSequence(rid, tokens, 0, len(tokens), [0], samples, params, 0, 0)

    batch = ScheduledBatch([seq("a", [1, 2, 3], True), seq("b", [1, 2], False), seq("c", [1, 2, 3], True)])
    out = await executor.execute(batch)
    assert out.tokens[1] is None
    assert out.tokens[0] == out.tokens[2] in (5, 6, 7)  # same prompt, same text (like greedy decoding)
    assert (await executor.execute(batch)).tokens == out.tokens
