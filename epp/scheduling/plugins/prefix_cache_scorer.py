"""prefix-cache-scorer: send a prompt where its prefix is probably still in the KV cache, unless that endpoint is
overloaded.

How: the prompt text (`protocol.openai.prompt_text`) is cut into blocks of `blockSize` tokens x ~4 characters and
hashed as a chain (xxhash64, each block seeded by the previous hash, the first by the model name), at most
`maxPrefixBlocksToMatch` blocks. The EPP remembers which hashes it sent to each endpoint (an LRU per endpoint sized
by the endpoint's `num_gpu_blocks`). Score = longest remembered prefix / number of blocks.
Reads: the request's prompt and model; `block_size` and `num_gpu_blocks` from `vllm:cache_config_info` when the
endpoints publish them (auto-tune), else the parameters.

Load guard: prefix affinity alone piles a popular prefix onto one endpoint until it melts (the peers' known
failure: prefix-only routing dropped llm-d's success rate to ~55%). The score of an endpoint whose queue is
deeper than the shallowest candidate's is scaled by max(0, 1 - excess / loadGuardQueueGap): at a gap of
`loadGuardQueueGap` queued requests the cached prefix counts for nothing and the load scorers decide. The cost:
under heavy load some hits are given up to keep queues even; a larger gap keeps more hits and tolerates more
imbalance (0 disables the guard).

Parameters: blockSize (16 tokens), maxPrefixBlocksToMatch (256), lruCapacityPerServer (31250 blocks, used when the
endpoint does not publish num_gpu_blocks), autoTune (true), loadGuardQueueGap (8; 0 = off).
Trade-offs: approximate — it knows where it sent a prefix, not what the server kept; text blocks only roughly align
with the server's token blocks. Recording happens in on_routed, after the reply to the proxy.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import xxhash

from epp.datalayer.endpoint import Endpoint
from epp.scheduling.framework import Parameters, register
from epp.scheduling.load import queue_depth
from epp.scheduling.types import SchedulingRequest, SchedulingResult

CHARS_PER_TOKEN = 4


@register("prefix-cache-scorer")
class PrefixCacheScorer:
    def __init__(self, parameters: dict):
        p = Parameters("prefix-cache-scorer", parameters)
        self.block_size = p.get("blockSize", 16, int, minimum=1)
        self.max_blocks = p.get("maxPrefixBlocksToMatch", 256, int, minimum=1)
        self.default_capacity = p.get("lruCapacityPerServer", 31250, int, minimum=1)
        self.auto_tune = p.get("autoTune", True, bool)
        self.load_guard_gap = p.get("loadGuardQueueGap", 8, (int, float), minimum=0)
        p.done()
        self._lru: dict[str, OrderedDict[int, None]] = {}  # endpoint name -> hashes, oldest first
        self._holders: dict[int, set[str]] = {}  # hash -> endpoint names that hold it
        self.lookups = 0
        self.matched_blocks = 0
        self.total_blocks = 0

    # -- hashing -----------------------------------------------------------------------------------------------
    def _block_chars(self, endpoints: Sequence[Endpoint]) -> int:
        block_size = self.block_size
        if self.auto_tune:
            for e in endpoints:
                if e.metrics is not None and e.metrics.block_size:
                    block_size = e.metrics.block_size
                    break
        return block_size * CHARS_PER_TOKEN

    def hashes(self, request: SchedulingRequest, endpoints: Sequence[Endpoint]) -> list[int]:
        if request.prefix_hashes is None:
            size = self._block_chars(endpoints)
            text = request.prompt[: size * self.max_blocks].encode("utf-8", "surrogatepass")  # ~4 bytes a token
            count = min(len(text) // size, self.max_blocks)
            digest = xxhash.xxh64_intdigest
            h = digest(request.model.encode())
            out = []
            for i in range(count):
                h = digest(text[i * size : (i + 1) * size], h)
                out.append(h)
            request.prefix_hashes = out
        return request.prefix_hashes

    # -- scoring -----------------------------------------------------------------------------------------------
    def score(self, request: SchedulingRequest, endpoints: list[Endpoint]) -> list[float]:
        hashes = self.hashes(request, endpoints)
        n = len(hashes)
        if n == 0 or not self._holders:
            return [0.0] * len(endpoints)
        matched: dict[str, int] = {}  # endpoint name -> number of leading blocks it holds
        holders = self._holders
        alive = set(holders.get(hashes[0], ()))
        depth = 0
        while alive:
            depth += 1
            if depth == n:
                break
            holding = holders.get(hashes[depth])
            if not holding:
                break
            for name in alive - holding:
                matched[name] = depth
            alive &= holding
        for name in alive:
            matched[name] = depth
        scores = [matched.get(e.name, 0) / n for e in endpoints]
        if self.load_guard_gap and any(scores):
            queues = [queue_depth(e) for e in endpoints]
            shallowest, gap = min(queues), self.load_guard_gap
            scores = [
                s * max(0.0, 1.0 - (q - shallowest) / gap) if s else 0.0 for s, q in zip(scores, queues, strict=True)
            ]
        return scores

    # -- recording ---------------------------------------------------------------------------------------------
    def _capacity(self, endpoint: Endpoint) -> int:
        m = endpoint.metrics
        return m.num_gpu_blocks if m is not None and m.num_gpu_blocks else self.default_capacity

    def on_routed(self, request: SchedulingRequest, result: SchedulingResult) -> None:
        hashes = request.prefix_hashes
        if not hashes or not result.endpoints:
            return
        endpoint = result.endpoints[0]
        self._record_stats(endpoint.name, hashes)
        lru = self._lru.setdefault(endpoint.name, OrderedDict())
        holders = self._holders
        name = endpoint.name
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                holders.setdefault(h, set()).add(name)
        capacity = self._capacity(endpoint)
        while len(lru) > capacity:
            old, _ = lru.popitem(last=False)
            names = holders.get(old)
            if names is not None:
                names.discard(name)
                if not names:
                    del holders[old]

    def _record_stats(self, name: str, hashes: list[int]) -> None:
        lru = self._lru.get(name)
        hit = 0
        if lru:
            for h in hashes:
                if h not in lru:
                    break
                hit += 1
        self.lookups += 1
        self.matched_blocks += hit
        self.total_blocks += len(hashes)

    def on_finished(self, request: SchedulingRequest, endpoint: Endpoint) -> None:
        return None

    def on_pool_changed(self, endpoints: Sequence[Endpoint]) -> None:
        present = {e.name for e in endpoints}
        for name in [n for n in self._lru if n not in present]:
            for h in self._lru.pop(name):
                names = self._holders.get(h)
                if names is not None:
                    names.discard(name)
                    if not names:
                        del self._holders[h]

    @property
    def index_size(self) -> int:
        return len(self._holders)

    @property
    def hit_ratio(self) -> float:
        return self.matched_blocks / self.total_blocks if self.total_blocks else 0.0
