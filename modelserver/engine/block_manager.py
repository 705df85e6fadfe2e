"""Paged KV cache bookkeeping with automatic prefix caching (vLLM V1's KVCacheManager and BlockPool, simplified).

A full block is keyed by vLLM's block hash (protocol/kv_events.py `BlockHasher`: SHA-256 over the parent block's
digest, the block's token ids and, for a LoRA request, the adapter name; seeded by PYTHONHASHSEED), computed once
per block as it fills. A block whose last user finishes keeps its hash and stays reusable until it is re-allocated;
free blocks are reused least-recently-freed first, and a finished request's blocks are freed tail-first so its
deepest (least shareable) blocks go first.

With `record_events`, the cache's changes are recorded as vLLM KV events until the engine drains them once per step,
as vLLM's BlockPool records them: one BlockStored per run of newly cached blocks of a request (parent = the block
before the run), one BlockRemoved per cached block that is re-allocated (evicted), AllBlocksCleared on a reset. A
preempted request's blocks stay cached, so they are announced as removed only when they are actually reused. Unlike
vLLM, a block whose hash is already cached (the same prefix computed by two requests at once) is not cached twice, so
every stored hash is removed exactly once.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

from modelserver.engine.request import Request
from protocol.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockHasher,
    BlockRemoved,
    BlockStored,
    block_hasher,
    external_block_hash,
    lora_extra_keys,
)

KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class BlockResidencyEvents:
    """Sampled blocks' residency intervals since the last drain (vLLM's V1 metrics design, "KV Cache Residency Metrics")."""

    lifetimes: list[float] = field(default_factory=list)
    idle_before_evict: list[float] = field(default_factory=list)
    reuse_gaps: list[float] = field(default_factory=list)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        sample_rate: float = 0.0,
        record_events: bool = False,
        hasher: BlockHasher | None = None,
        lora_ids: Mapping[str, int] | None = None,
    ):
        """hasher: vLLM's block hash for the server's algorithm and seed (default: sha256, unseeded as vLLM).
        lora_ids: adapter name -> the integer id vLLM gives it (BlockStored.lora_id)."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sample_rate = sample_rate
        self._ref_counts = [0] * num_blocks
        self.hasher = hasher or block_hasher()
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # head = next to reuse
        self._cached: dict[bytes, int] = {}  # block digest -> block id
        self._sampled: dict[int, list[float]] = {}  # block id -> [allocated at, last touched]
        self.residency = BlockResidencyEvents()
        # Prefix-cache counters in tokens since the last drain (the engine turns them into Prometheus counters).
        self.queries = 0
        self.hits = 0
        self.events: list[KVCacheEvent] | None = [] if record_events else None
        self.lora_ids = lora_ids if lora_ids is not None else {}

    def drain_events(self) -> list[KVCacheEvent]:
        events, self.events = self.events, []
        return events

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def usage(self) -> float:
        """Fraction of blocks in use; cached blocks nobody uses count as free (they are evictable)."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _extend_hashes(self, request: Request, num_full_blocks: int) -> list[bytes]:
        """The request's block digests up to num_full_blocks, hashing only blocks not hashed before."""
        hashes = request.block_hashes
        if len(hashes) < num_full_blocks:
            size = self.block_size
            tokens = request.token_ids
            hash_block = self.hasher.hash_block
            extra_keys = lora_extra_keys(request.lora_name)
            parent = hashes[-1] if hashes else None
            for i in range(len(hashes), num_full_blocks):
                parent = hash_block(parent, tokens[i * size : (i + 1) * size], extra_keys)
                hashes.append(parent)
        return hashes

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Block ids holding the longest cached prefix of a not-yet-computed request (at least one token is
        always left to compute, so the step that finishes the prompt produces logits)."""
        if not self.enable_caching:
            return []
        num_full = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        cached = self._cached
        for block_hash in self._extend_hashes(request, num_full)[:num_full]:
            block_id = cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def record_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.queries += num_query_tokens
        self.hits += num_hit_tokens

    def allocate(self, request: Request, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Give `request` blocks for its computed tokens, `cached_blocks`, and `num_new_tokens` more.
        Returns False, changing nothing, when the free pool is too small."""
        total_tokens = request.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        num_new_blocks = self.blocks_needed(total_tokens) - len(request.block_ids) - len(cached_blocks)
        ref_counts = self._ref_counts
        revived = sum(1 for b in cached_blocks if ref_counts[b] == 0)
        if num_new_blocks + revived > len(self._free):
            return False
        now = time.monotonic() if self._sampled else 0.0
        for block_id in cached_blocks:
            if ref_counts[block_id] == 0:
                del self._free[block_id]
            ref_counts[block_id] += 1
            if (times := self._sampled.get(block_id)) is not None:
                self.residency.reuse_gaps.append(now - times[1])
                times[1] = now
        request.block_ids.extend(cached_blocks)
        request.num_registered_blocks += len(cached_blocks)  # a running request's partial last block is not cached yet
        for _ in range(max(0, num_new_blocks)):
            request.block_ids.append(self._take_free_block())
        return True

    def _take_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block_hash = self._block_hash[block_id]
        if block_hash is not None:
            if self._cached.get(block_hash) == block_id:
                del self._cached[block_hash]
                if self.events is not None:
                    self.events.append(BlockRemoved([external_block_hash(block_hash)], MEDIUM_GPU))
            self._block_hash[block_id] = None
        if self._sampled:
            times = self._sampled.pop(block_id, None)
            if times is not None:
                now = time.monotonic()
                self.residency.lifetimes.append(now - times[0])
                self.residency.idle_before_evict.append(now - times[1])
        if self.sample_rate and random.random() < self.sample_rate:
            now = time.monotonic()
            self._sampled[block_id] = [now, now]
        self._ref_counts[block_id] = 1
        return block_id

    def register_full_blocks(self, request: Request) -> None:
        """Enter the request's newly completed blocks in the prefix cache (after a step computed them)."""
        num_full = request.num_computed_tokens // self.block_size
        if num_full <= request.num_registered_blocks or not self.enable_caching:
            return
        hashes = self._extend_hashes(request, num_full)
        events = self.events
        stored: BlockStored | None = None
        for i in range(request.num_registered_blocks, num_full):
            block_id, block_hash = request.block_ids[i], hashes[i]
            if block_hash not in self._cached:
                self._cached[block_hash] = block_id
                self._block_hash[block_id] = block_hash
                if events is None:
                    continue
                if stored is None:  # one event per contiguous run of newly cached blocks
                    parent = external_block_hash(hashes[i - 1]) if i else None
                    lora_id = None if request.lora_name is None else self.lora_ids.get(request.lora_name)
                    stored = BlockStored([], parent, [], self.block_size, lora_id, MEDIUM_GPU)
                    events.append(stored)
                stored.block_hashes.append(external_block_hash(block_hash))
                stored.token_ids.extend(request.token_ids[i * self.block_size : (i + 1) * self.block_size])
            else:
                stored = None
        request.num_registered_blocks = num_full

    def free(self, request: Request) -> None:
        ref_counts = self._ref_counts
        for block_id in reversed(request.block_ids):
            ref_counts[block_id] -= 1
            if ref_counts[block_id] == 0:
                self._free[block_id] = None
        request.block_ids = []
        request.num_registered_blocks = 0

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's BlockPool.reset_prefix_cache): refused, changing nothing, while any
        block is in use; announced as AllBlocksCleared."""
        if len(self._free) != self.num_blocks:
            return False
        self._cached.clear()
        self._block_hash = [None] * self.num_blocks
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        return True
