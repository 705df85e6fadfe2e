"""The approximate prefix index: hashing, longest-prefix scores, LRU bounds, pool changes, hit ratio, load guard."""

import pytest
import xxhash

from epp.scheduling.plugins import build_plugin
from epp.scheduling.plugins.prefix_cache_scorer import MAX_TRIM, PREFIX_HASHES
from epp.scheduling.types import CycleState, SchedulingRequest, SchedulingResult
from tests.epp.helpers import endpoint

SYSTEM = "You are a helpful assistant that answers briefly and precisely. " * 16  # 1024 chars: 16 blocks of 64


def req(prompt, model="m"):
    return SchedulingRequest(request_id="r", model=model, prompt=prompt)


def scorer(**parameters):
    return build_plugin("prefix-cache-scorer", {"loadGuardQueueGap": 0, **parameters})


def route(s, prompt, e, pool, model="m"):
    """Score, then record the pick, in one cycle (what the scheduler does); the cycle's state."""
    cycle_state = CycleState()
    s.score(cycle_state, req(prompt, model), pool)
    s.pre_request(req(prompt, model), SchedulingResult([e], cycle_state=cycle_state))
    return cycle_state


def test_hashes_are_a_chain_over_blocks_of_block_size_times_four_characters_seeded_by_the_model():
    pool = [endpoint(0, block_size=16)]
    request, cycle_state = req("a" * 64 + "b" * 64 + "c" * 63, model="llama"), CycleState()
    hashes = scorer().hashes(cycle_state, request, pool)
    first = xxhash.xxh64_intdigest(b"a" * 64, xxhash.xxh64_intdigest(b"llama"))
    assert hashes == [first, xxhash.xxh64_intdigest(b"b" * 64, first)]  # the partial last block is not hashed
    assert cycle_state.read(PREFIX_HASHES) is hashes  # computed once, kept for pre_request
    assert scorer().hashes(CycleState(), req(request.prompt, model="other"), pool)[0] != first


@pytest.mark.parametrize(
    ("block_size", "auto_tune", "parameter", "blocks"),
    [
        (16, True, 16, 16),  # 1024 chars / 64
        (32, True, 16, 8),  # the servers' block size wins: 1024 / 128
        (32, False, 16, 16),  # unless auto-tuning is off
        (None, True, 8, 32),  # servers that publish no block size: the parameter, 1024 / 32
    ],
)
def test_block_size_is_auto_tuned_from_cache_config_info(block_size, auto_tune, parameter, blocks):
    s = scorer(autoTune=auto_tune, blockSize=parameter)
    assert len(s.hashes(CycleState(), req(SYSTEM), [endpoint(0, block_size=block_size)])) == blocks


def test_at_most_max_prefix_blocks_are_hashed():
    assert len(scorer().hashes(CycleState(), req("x" * 220_000), [endpoint(0)])) == 256
    assert len(scorer(maxPrefixBlocksToMatch=4).hashes(CycleState(), req(SYSTEM), [endpoint(0)])) == 4
    assert scorer().hashes(CycleState(), req("short"), [endpoint(0)]) == []


def test_score_is_the_longest_recorded_prefix_over_the_prompts_blocks():
    s, pool = scorer(), [endpoint(0), endpoint(1), endpoint(2)]
    assert s.score(CycleState(), req(SYSTEM + "question one"), pool) is None  # empty index
    route(s, SYSTEM + "q" * 64, pool[1], pool)  # 17 blocks on e1
    route(s, SYSTEM[:512] + "z" * 512, pool[2], pool)  # 16 blocks on e2, the first 8 shared with SYSTEM
    second = req(SYSTEM + "w" * 64 * 4)  # 20 blocks: the first 16 are SYSTEM's
    assert s.score(CycleState(), second, pool) == pytest.approx([0.0, 16 / 20, 8 / 20])
    assert s.score(CycleState(), req(SYSTEM + "q" * 64), pool)[1] == 1.0
    assert s.score(CycleState(), req(SYSTEM, model="other"), pool) is None  # another model shares nothing


def test_index_is_bounded_per_endpoint_by_num_gpu_blocks_and_evicts_the_tail_first():
    s = scorer()
    small, large = endpoint(0, num_gpu_blocks=10), endpoint(1, num_gpu_blocks=1000)
    first = route(s, SYSTEM, small, [small])  # 16 blocks into a 10-block LRU: the head 10 stay
    assert s.index_size == 10
    assert s.score(CycleState(), req(SYSTEM), [small]) == [10 / 16]
    route(s, "n" * 64 * 6, small, [small])  # 6 new blocks evict 6 of the old ones, tail first
    assert s.score(CycleState(), req(SYSTEM), [small]) == [4 / 16]
    route(s, SYSTEM, large, [large])
    assert s.index_size == 10 + 16
    assert len(first.read(PREFIX_HASHES)) == 16


def test_default_capacity_applies_when_the_endpoint_publishes_no_num_gpu_blocks():
    s, e = scorer(lruCapacityPerServer=5), endpoint(0, num_gpu_blocks=None)
    route(s, SYSTEM, e, [e])
    assert s.index_size == 5


def test_the_whole_index_is_capped_and_a_large_fall_in_capacity_is_trimmed_over_several_picks():
    """maxIndexEntries bounds the index whatever the servers' num_gpu_blocks (each endpoint's LRU at most its
    share); a capacity that falls by more than MAX_TRIM entries is reached over several picks, never in one."""
    s = scorer(maxIndexEntries=20)
    pool = [endpoint(0, num_gpu_blocks=10**9), endpoint(1, num_gpu_blocks=10**9)]
    route(s, SYSTEM, pool[0], pool)
    route(s, SYSTEM + "x" * 64 * 10, pool[1], pool)  # 26 blocks: its share is 20 // 2
    assert len(s._held[pool[0].spec.name]) == 16 and len(s._held[pool[1].spec.name]) == 10
    route(s, SYSTEM, pool[0], pool)
    assert s.index_size == 20

    big = scorer(maxIndexEntries=10**6, maxPrefixBlocksToMatch=4096)
    e = endpoint(0, num_gpu_blocks=5000)
    route(big, "y" * 64 * 4000, e, [e])
    assert big.index_size == 4000
    e.metrics.num_gpu_blocks = 10  # the server came back far smaller
    route(big, "z" * 64, e, [e])
    assert big.index_size == 4000 + 1 - MAX_TRIM
    for _ in range(3):
        route(big, "z" * 64, e, [e])
    assert big.index_size == 10


def test_removed_endpoints_are_forgotten():
    s, pool = scorer(), [endpoint(0), endpoint(1)]
    route(s, SYSTEM, pool[0], pool)
    route(s, SYSTEM, pool[1], pool)
    s.pool_changed([pool[1]])
    assert s.index_size == 16
    assert s.score(CycleState(), req(SYSTEM), pool) == [0.0, 1.0]


def test_hit_ratio_counts_the_chosen_endpoints_known_blocks():
    s, e = scorer(), endpoint(0)
    assert s.hit_ratio == 0.0
    route(s, SYSTEM, e, [e])  # 0 of 16 known
    route(s, SYSTEM[:512] + "y" * 512, e, [e])  # 8 of 16 known
    assert (s.lookups, s.matched_blocks, s.total_blocks) == (2, 8, 32)
    assert s.hit_ratio == 0.25


def test_a_request_without_prompt_blocks_is_not_recorded():
    s, e = scorer(), endpoint(0)
    route(s, "", e, [e])
    assert (s.index_size, s.lookups) == (0, 0)


@pytest.mark.parametrize(
    ("gap", "queues", "expected"),
    [
        # the hot endpoint e0 holds the whole prompt; e1 holds half of it; e2 nothing
        (8, [0, 0, 0], [1.0, 0.5, 0.0]),  # no imbalance: no cap
        (8, [2, 0, 0], [0.75, 0.5, 0.0]),  # 2 deeper than the shallowest: 1 - 2/8
        (8, [6, 2, 2], [0.5, 0.5, 0.0]),  # relative to the shallowest candidate, not to zero
        (8, [8, 0, 0], [0.0, 0.5, 0.0]),  # at the gap the cached prefix counts for nothing
        (8, [30, 0, 0], [0.0, 0.5, 0.0]),  # never negative
        (4, [2, 0, 0], [0.5, 0.5, 0.0]),
        (0, [30, 0, 0], [1.0, 0.5, 0.0]),  # guard off
    ],
)
def test_load_guard_caps_the_prefix_score_of_an_endpoint_queued_deeper_than_its_peers(gap, queues, expected):
    s = build_plugin("prefix-cache-scorer", {"loadGuardQueueGap": gap})
    pool = [endpoint(i) for i in range(3)]
    route(s, SYSTEM, pool[0], pool)
    route(s, SYSTEM[:512], pool[1], pool)
    for e, q in zip(pool, queues, strict=True):
        e.metrics.waiting = q
    assert s.score(CycleState(), req(SYSTEM), pool) == pytest.approx(expected)


def test_load_guard_sees_requests_routed_since_the_last_scrape():
    s = build_plugin("prefix-cache-scorer", {"loadGuardQueueGap": 4})
    pool = [endpoint(0), endpoint(1)]
    route(s, SYSTEM, pool[0], pool)
    pool[0].in_flight_requests = 4  # a burst the scrape does not show yet
    assert s.score(CycleState(), req(SYSTEM), pool) == [0.0, 0.0]
