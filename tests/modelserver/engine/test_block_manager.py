"""KV block bookkeeping: prefix reuse, LRU eviction order, usage counting evictable blocks as free."""

import pytest

from modelserver.engine.block_manager import KVCacheManager
from modelserver.engine.request import Request, SamplingParams


def request(tokens, rid="r", lora=None):
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), lora)


def compute_all(kv: KVCacheManager, req: Request) -> None:
    """Allocate and 'compute' the whole prompt, as the engine does after a step."""
    cached = kv.find_cached_prefix(req)
    num_cached = len(cached) * kv.block_size
    assert kv.allocate(req, req.num_tokens - num_cached, cached)
    req.num_computed_tokens = req.num_tokens
    kv.register_full_blocks(req)


def test_prefix_reuse_leaves_at_least_one_token_to_compute():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    first = request(range(12), "a")
    compute_all(kv, first)
    kv.free(first)
    same = request(range(12), "b")
    # 12 tokens = 3 full blocks, but the last token must be computed: only 2 blocks come from the cache
    assert len(kv.find_cached_prefix(same)) == 2
    longer = request([*range(12), 99], "c")
    assert len(kv.find_cached_prefix(longer)) == 3


@pytest.mark.parametrize(
    ("prompt_b", "lora_b", "expected_blocks"),
    [
        ([0, 1, 2, 3, 4, 5, 6, 7, 8], None, 2),  # same prefix
        ([0, 1, 2, 3, 9, 9, 9, 9, 8], None, 1),  # diverges in block 2
        ([9, 1, 2, 3, 4, 5, 6, 7, 8], None, 0),  # diverges in block 1: the chain breaks
        ([0, 1, 2, 3, 4, 5, 6, 7, 8], "adapter", 0),  # another adapter never shares KV
    ],
)
def test_prefix_hash_chain(prompt_b, lora_b, expected_blocks):
    kv = KVCacheManager(num_blocks=10, block_size=4)
    compute_all(kv, request(range(9), "a"))
    assert len(kv.find_cached_prefix(request(prompt_b, "b", lora_b))) == expected_blocks


def test_freed_cached_blocks_are_evicted_least_recently_freed_first():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    old, new = request([1, 2, 3], "old"), request([5, 6, 7], "new")
    compute_all(kv, old)  # uses 2 blocks
    kv.free(old)
    compute_all(kv, new)  # takes the 2 never-used blocks first
    kv.free(new)
    assert len(kv.find_cached_prefix(request([1, 2, 3], "x"))) == 1
    # one more block is needed: the least recently freed cached block (old's tail first, then its head) goes
    filler = request([8, 9], "filler")
    assert kv.allocate(filler, 2)
    assert len(kv.find_cached_prefix(request([1, 2, 3], "y"))) == 1  # old's tail block went, its head stays
    assert kv.allocate(request([10], "more"), 2)
    assert len(kv.find_cached_prefix(request([1, 2, 3], "z"))) == 0
    assert len(kv.find_cached_prefix(request([5, 6, 7], "w"))) == 1


def test_usage_counts_evictable_cached_blocks_as_free():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    req = request(range(16))
    compute_all(kv, req)
    assert kv.usage == pytest.approx(4 / 8)
    kv.free(req)
    assert kv.usage == 0.0
    assert len(kv.find_cached_prefix(request(range(16), "again"))) == 3


def test_allocation_fails_cleanly_when_full():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    big = request(range(12))
    assert not kv.allocate(big, 12)
    assert big.block_ids == []
    assert kv.num_free_blocks == 2


def test_caching_disabled_never_hits():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    compute_all(kv, request(range(9), "a"))
    assert kv.find_cached_prefix(request(range(9), "b")) == []


def test_residency_sampling_records_reuse_gaps_and_lifetimes():
    kv = KVCacheManager(num_blocks=2, block_size=2, sample_rate=1.0)
    a = request([1, 2, 3], "a")
    compute_all(kv, a)
    kv.free(a)
    b = request([1, 2, 3], "b")
    compute_all(kv, b)  # reuses a's first block (a reuse gap) and re-allocates a's tail block (an eviction)
    assert len(kv.residency.reuse_gaps) == 1
    assert len(kv.residency.lifetimes) == 1
    kv.free(b)
    compute_all(kv, request([7, 8, 9], "c"))  # both blocks re-allocated: two more evictions
    assert len(kv.residency.lifetimes) == 3
    assert len(kv.residency.idle_before_evict) == 3
