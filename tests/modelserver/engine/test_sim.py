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


def test_speed_divides_every_step_time_and_must_be_positive():
    batch = ScheduledBatch([], num_uncached_prefill_tokens=1000, num_decode_tokens=4)
    rng = random.Random(0)
    half = SimTiming(speed=0.5).step_time(batch, rng)
    assert half == pytest.approx(2 * SimTiming().step_time(batch, rng))
    assert SimTiming(speed=2.0).step_time(batch, rng) == pytest.approx(SimTiming().step_time(batch, rng) / 2)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="speed"):
            SimTiming(speed=bad)


def test_cli_gives_each_replica_its_speed_in_turn():
    from modelserver.cli import _sim_timing, build_parser, main

    args = build_parser().parse_args(["--replicas", "5", "--sim-speed", "1", "0.5"])
    assert [_sim_timing(args, i).speed for i in range(5)] == [1.0, 0.5, 1.0, 0.5, 1.0]
    assert [_sim_timing(args, i).seed for i in range(3)] == [0, 1, 2]
    assert _sim_timing(build_parser().parse_args([]), 3).speed == 1.0
    for bad in ("0", "-2", "nan", "inf"):
        with pytest.raises(SystemExit, match="--sim-speed"):
            main(["--sim-speed", "1", bad])


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
