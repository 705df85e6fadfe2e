"""prefix-cache-scorer: send a prompt where its prefix is probably still in the KV cache, unless that endpoint is
overloaded.

How: the prompt text (`protocol.openai.prompt_text`) is cut into blocks of `blockSize` tokens x ~4 characters and
hashed as a chain (xxhash64, each block seeded by the previous block's hash, the first by a hash of the model name,
so two models never share entries), at most `maxPrefixBlocksToMatch` blocks; the hashes are computed once per
request and kept in the cycle state (PREFIX_HASHES). The EPP remembers which hashes it sent to each endpoint: one
LRU per endpoint, sized by the endpoint's `num_gpu_blocks` (the server cannot hold more blocks than that). Score =
longest remembered prefix / number of blocks of the prompt. The pick is recorded in `pre_request` (from the cycle
state the result carries), which runs after the EPP answered the proxy, so the index update is off the request's
critical path.
Reads: the request's prompt and model; `block_size` and `num_gpu_blocks` (from `vllm:cache_config_info`) when the
endpoints publish them (`autoTune`), else the parameters; the candidates' queue depths for the load guard (shared
with queue-scorer through the cycle state). Writes: PREFIX_HASHES. Reports its index size and hit ratio
(PrefixIndexStats) for the EPP's metrics.

Matching: a prompt's blocks are recorded last block first, so within one prompt the LRU evicts the tail before the
head (what vLLM's free-block queue does too) and what an endpoint holds of a prompt stays a prefix. The longest
match is then found by binary search: about 8 look-ups per endpoint that holds the first block (a small index of
first blocks names them), none for the rest; a prompt whose first block was never routed costs one look-up.

Load guard: prefix affinity alone piles a popular prefix onto one endpoint until it melts (the peers' known
failure: prefix-only routing dropped llm-d's success rate to ~55%). The prefix score of an endpoint whose queue
(waiting requests plus what this EPP routed there that the last scrape does not show yet) exceeds the shallowest
candidate's by `excess` is scaled by max(0, 1 - excess / loadGuardQueueGap): at `loadGuardQueueGap` requests more
than the least loaded candidate the cached prefix counts for nothing and the load scorers alone decide. This holds
even when the scorer is configured alone (ties then fall to the picker's random choice), so no configuration can
queue more than about `loadGuardQueueGap` requests on a hot endpoint beyond its peers. The cost: under heavy load
some cache hits are given up to keep queues even; a larger gap keeps more hits and tolerates more imbalance,
0 disables the guard.

Learning from the servers: a response's `usage.prompt_tokens_details.cached_tokens` says how much of the prompt
the server really had (ResponseComplete). When it had less than the index believed at the pick, the server evicted
what the index still remembers (memory pressure, other routers' traffic, a restart): that endpoint's LRU capacity
shrinks by the difference and its oldest entries go; when it had more, the capacity grows back towards
num_gpu_blocks. Mixed pools: with the KV-event index (KVEventsConsumer), endpoints that publish KV events are left
to precise-prefix-cache-scorer (scored 0 here, their picks not recorded); the rest are scored as above.

Replicas (`--replica-peers`, epp/replicas.py): every pick it records goes to the peer replicas, which record it as
their own (`learn`), so each replica's index knows what all of them routed.

Memory: an entry (a block hash an endpoint was sent) costs 163-216 bytes at the cap, 166-220 at the peak
(`epp-bench kv-index`, tracemalloc, caps of 400,000 to 2,500,000 over 8 servers, each entry evicted once; 116-143
just filled: an LRU's hash table is rebuilt at three times its entries); however many blocks the servers say they
hold, the index keeps at most maxIndexEntries over all endpoints (each endpoint's LRU at most its share of them),
1,200,000 by default: ~252 MiB at the worst peak measured, a budget of 256 MiB, 38 servers of 31,250 blocks.
Eviction is O(1) an entry (the LRU's oldest; one pass in C finds the few evicted blocks that begin a prompt), and
one pick trims at most MAX_TRIM entries, so a capacity that falls a long way is reached over a few picks, never in
one long stop of the event loop.

Parameters: blockSizeTokens (16; `blockSize`, also in tokens, is its older alias), maxPrefixBlocksToMatch (256) or
maxPrefixTokensToMatch (llm-d's, which wins when set), lruCapacityPerServer (31250 blocks, used when the endpoint does
not publish num_gpu_blocks), maxIndexEntries (1,200,000), autoTune (true), loadGuardQueueGap (8; 0 = off; ours,
not llm-d's).
Trade-offs: approximate: it knows where it sent a prefix, not what the server kept (evictions under memory
pressure, restarts); text blocks only roughly align with the server's token blocks; a prompt shorter than one
block scores 0 everywhere.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from xxhash import xxh64_intdigest

from epp.datalayer.endpoint import Endpoint
from epp.datalayer.kv_events import KVBlockIndex
from epp.datalayer.load import QUEUE_DEPTH_READS
from epp.scheduling.framework import (
    KVEventsConsumer,
    Parameters,
    PoolChanged,
    PrefixIndexStats,
    PreRequest,
    ResponseComplete,
    Scorer,
    SharedPrefixIndex,
    Stability,
    register,
)
from epp.scheduling.load import QUEUE_DEPTHS, guard_load
from epp.scheduling.plugins.precise_prefix_cache_scorer import PROMPT_BLOCKS
from epp.scheduling.types import CycleState, ResponseInfo, SchedulingRequest, SchedulingResult, StateKey

CHARS_PER_TOKEN = 4
# The most entries one pick (or one response) trims from an endpoint's LRU: ~0.2 ms of the event loop.
MAX_TRIM = 1024
PREFIX_HASHES: StateKey[list[int]] = StateKey("prefix-hashes")  # the prompt's chained block hashes
# the share of the prompt's blocks each endpoint that holds its first block holds (match_fractions), by endpoint name
PREFIX_MATCH: StateKey[dict[str, float]] = StateKey("prefix-match")
# (blocks the index believed the pick held, blocks of the whole prompt), recorded with the pick
PREFIX_BELIEF: StateKey[tuple[int, float]] = StateKey("prefix-belief")


def longest_prefix(hashes: list[int], held: OrderedDict[int, None] | None) -> int:
    """How many leading `hashes` an endpoint holds, assuming what it holds of one chain is a prefix."""
    if not held or hashes[0] not in held:
        return 0
    low, high = 1, len(hashes)  # hashes[:low] are held; the answer is <= high
    while low < high:
        middle = (low + high + 1) // 2
        if hashes[middle - 1] in held:
            low = middle
        else:
            high = middle - 1
    return low


@register("prefix-cache-scorer", Stability.BETA)
class PrefixCacheScorer(
    Scorer, PreRequest, ResponseComplete, PoolChanged, PrefixIndexStats, KVEventsConsumer, SharedPrefixIndex
):
    consumes = ("block_size", "num_gpu_blocks", *QUEUE_DEPTH_READS, QUEUE_DEPTHS, PREFIX_HASHES)
    produces = (PREFIX_HASHES, QUEUE_DEPTHS, PREFIX_BELIEF, PREFIX_MATCH)

    def __init__(self, parameters: dict | None):
        p = Parameters("prefix-cache-scorer", parameters)
        # llm-d's blockSizeTokens wins over our older blockSize (in tokens too, where llm-d's deprecated one counts
        # characters); its maxPrefixTokensToMatch, when given, over maxPrefixBlocksToMatch
        block_size = p.get("blockSize", 16, int, minimum=1)
        self.block_size = p.get("blockSizeTokens", block_size, int, minimum=1)
        max_blocks = p.get("maxPrefixBlocksToMatch", 256, int, minimum=1)
        max_tokens = p.get("maxPrefixTokensToMatch", 0, int, minimum=0)
        self.max_blocks = max(1, max_tokens // self.block_size) if max_tokens else max_blocks
        self.default_capacity = p.get("lruCapacityPerServer", 31250, int, minimum=1)
        self.max_entries = p.get("maxIndexEntries", 1_200_000, int, minimum=1)
        self.auto_tune = p.get("autoTune", True, bool)
        self.load_guard_gap = float(p.get("loadGuardQueueGap", 8, (int, float), minimum=0))
        p.done()
        self._held: dict[str, OrderedDict[int, None]] = {}  # endpoint name -> hashes sent there, oldest first
        self._heads: dict[int, set[str]] = {}  # first-block hash -> endpoints that hold it
        self._capacity: dict[str, int] = {}  # endpoint name -> blocks it keeps, as learnt from its cached_tokens
        self._kv_index: KVBlockIndex | None = None
        self.lookups = 0
        self.matched_blocks = 0
        self.total_blocks = 0

    def block_chars(self, endpoints: Sequence[Endpoint]) -> int:
        """Characters per block: the servers' block size in tokens (when published) x ~4 characters a token."""
        if self.auto_tune:
            for e in endpoints:
                m = e.metrics
                if m is not None and m.block_size:
                    return m.block_size * CHARS_PER_TOKEN
        return self.block_size * CHARS_PER_TOKEN

    def hashes(self, cycle_state: CycleState, request: SchedulingRequest, endpoints: Sequence[Endpoint]) -> list[int]:
        """The prompt's chained block hashes, computed once per scheduling cycle."""
        hashes = cycle_state.read(PREFIX_HASHES)
        if hashes is None:
            size = self.block_chars(endpoints)
            text = request.prompt[: size * self.max_blocks].encode("utf-8", "surrogatepass")
            digest = xxh64_intdigest
            h = digest(request.model.encode("utf-8", "surrogatepass"))
            hashes = []
            cycle_state.write(PREFIX_HASHES, hashes)
            append = hashes.append
            for start in range(0, min(len(text) // size, self.max_blocks) * size, size):
                h = digest(text[start : start + size], h)
                append(h)
        return hashes

    def score(
        self, cycle_state: CycleState, request: SchedulingRequest, endpoints: list[Endpoint]
    ) -> list[float] | None:
        index = self._kv_index
        if index is not None and not index.has_publishers:
            index = None  # no endpoint publishes KV events: this scorer has them all
        if index is not None and all(index.publishes(e.hostport) for e in endpoints):
            return None  # precise-prefix-cache-scorer scores them all: no text hashing at all
        hashes = self.hashes(cycle_state, request, endpoints)
        holders = self._heads.get(hashes[0]) if hashes else None
        if not holders:
            return None  # nobody was sent this prompt's first block: no preference
        held, blocks = self._held, len(hashes)
        matched = {name: longest_prefix(hashes, held[name]) / blocks for name in holders}
        if index is None:
            scores = [matched.get(e.spec.name, 0.0) for e in endpoints]
        else:  # endpoints that publish KV events are scored by precise-prefix-cache-scorer
            scores = [0.0 if index.publishes(e.hostport) else matched.get(e.spec.name, 0.0) for e in endpoints]
        return guard_load(scores, cycle_state, endpoints, self.load_guard_gap)

    def match_fractions(
        self, cycle_state: CycleState, request: SchedulingRequest, endpoints: Sequence[Endpoint]
    ) -> list[float]:
        matched = cycle_state.read(PREFIX_MATCH)
        if matched is None:
            hashes = self.hashes(cycle_state, request, endpoints)
            holders = self._heads.get(hashes[0]) if hashes else None
            held, blocks = self._held, len(hashes)
            matched = {name: longest_prefix(hashes, held[name]) / blocks for name in holders or ()}
            cycle_state.write(PREFIX_MATCH, matched)
        return [matched.get(e.spec.name, 0.0) for e in endpoints]

    def cached_tokens(
        self, cycle_state: CycleState, request: SchedulingRequest, endpoints: Sequence[Endpoint]
    ) -> list[int]:
        """Prompt tokens each of `endpoints` probably holds for `request` (the latency predictor's cache input);
        only the endpoints that were sent the prompt's first block are matched. Endpoints that publish KV events
        are answered from the KV-event index with the prompt's exact block hashes, when precise-prefix-cache-scorer
        prepared them for this cycle (the held leading run, all a match needs), and cost no text hashing: when they
        all publish, the prompt's text is not hashed at all (an 8k-token prompt's ~500 text blocks)."""
        index = self._kv_index
        publishing = [e.hostport for e in endpoints if index.publishes(e.hostport)] if index is not None else []
        counts = [0] * len(endpoints)
        if len(publishing) < len(endpoints):
            hashes = self.hashes(cycle_state, request, endpoints)
            holders = self._heads.get(hashes[0]) if hashes else None
            if holders:
                held, tokens_per_block = self._held, self.block_chars(endpoints) // CHARS_PER_TOKEN
                counts = [
                    longest_prefix(hashes, held[e.spec.name]) * tokens_per_block if e.spec.name in holders else 0
                    for e in endpoints
                ]
        exact = cycle_state.read(PROMPT_BLOCKS)
        if publishing and exact is not None:
            matched, block_size = exact.held_by(index, publishing), index.block_size or 16
            counts = [
                matched[e.hostport] * block_size if e.hostport in matched else c
                for e, c in zip(endpoints, counts, strict=True)
            ]
        return counts

    def unknown_endpoint_tokens(
        self, cycle_state: CycleState, request: SchedulingRequest, endpoints: Sequence[Endpoint]
    ) -> list[int]:
        """Prompt tokens to expect cached on each of `endpoints` that neither index knows anything of (it has
        published no KV events and was not sent a prompt: a server new to the pool, or never picked): the prefix
        every publishing candidate holds (`PromptBlocks.common`); 0 for the others. What the latency predictor
        predicts from when it compares candidates (`CandidatePredictions.get`), not what it learns from: such a
        server needs that prefix once to serve anything, and counted as a miss there it never gets new work while
        the servers that happened to be sent it first stay within reach (docs/2026-11-30-replicas-notebook.md,
        "Agent sessions locked onto the first servers")."""
        index, exact = self._kv_index, cycle_state.read(PROMPT_BLOCKS)
        counts = [0] * len(endpoints)
        if index is None or exact is None:
            return counts
        publishes = [index.publishes(e.hostport) for e in endpoints]
        publishing = [e.hostport for e, p in zip(endpoints, publishes, strict=True) if p]
        held = self._held
        unknown = [i for i, e in enumerate(endpoints) if not publishes[i] and e.spec.name not in held]
        common = exact.common(index, publishing, len(endpoints)) if publishing and unknown else 0
        if common:
            tokens = common * (index.block_size or 16)
            for i in unknown:
                counts[i] = tokens
        return counts

    def use_kv_index(self, index: KVBlockIndex) -> None:
        self._kv_index = index

    def pre_request(self, request: SchedulingRequest, result: SchedulingResult) -> None:
        hashes = result.cycle_state.read(PREFIX_HASHES)
        if not hashes or not result.endpoints:
            return
        endpoint = result.endpoints[0]
        if self._kv_index is not None and self._kv_index.publishes(endpoint.hostport):
            return  # the KV-event index knows what it holds
        name = endpoint.spec.name
        held = self._held.get(name)
        if held is None:
            held = self._held[name] = OrderedDict()
        believed = longest_prefix(hashes, held)
        result.cycle_state.write(PREFIX_BELIEF, (believed, len(request.prompt) / self.block_chars((endpoint,))))
        self.lookups += 1
        self.matched_blocks += believed
        self.total_blocks += len(hashes)
        self._record(endpoint, name, held, hashes)
        if self.learned is not None:
            self.learned(endpoint.hostport, hashes)

    def learn(self, endpoint: Endpoint, hashes: list[int]) -> None:
        if self._kv_index is not None and self._kv_index.publishes(endpoint.hostport):
            return
        name = endpoint.spec.name
        held = self._held.get(name)
        if held is None:
            held = self._held[name] = OrderedDict()
        self._record(endpoint, name, held, hashes)

    def _record(self, endpoint: Endpoint, name: str, held: OrderedDict[int, None], hashes: list[int]) -> None:
        touch = held.move_to_end
        for h in reversed(hashes):  # the head is touched last: evicted last
            if h in held:
                touch(h)
            else:
                held[h] = None
        self._heads.setdefault(hashes[0], set()).add(name)
        full = self.server_capacity(endpoint)
        self._trim(name, held, min(self._capacity.get(name) or full, full))

    def server_capacity(self, endpoint: Endpoint) -> int:
        """The blocks the server holds (its num_gpu_blocks), at most its share of maxIndexEntries."""
        m = endpoint.metrics
        blocks = m.num_gpu_blocks if m is not None and m.num_gpu_blocks else self.default_capacity
        return min(blocks, self.max_entries // max(1, len(self._held)))

    def _trim(self, name: str, held: OrderedDict[int, None], capacity: int) -> None:
        evicted = [held.popitem(last=False)[0] for _ in range(min(len(held) - capacity, MAX_TRIM))]
        for block_hash in self._heads.keys() & evicted:  # the few that begin a prompt: one pass in C finds them
            self._forget(name, block_hash)

    def response_complete(
        self, request: SchedulingRequest, result: SchedulingResult, endpoint: Endpoint, response: ResponseInfo
    ) -> None:
        """Learn from the server's own count of cached prompt tokens how many blocks it really keeps: when it had
        fewer of the prompt cached than the index believed, it evicted them (memory pressure, another router's
        traffic, a restart), so the endpoint's LRU shrinks by the difference; when it had more, it grows back
        towards the server's num_gpu_blocks. Both counts are in this prompt's blocks (the server's share of cached
        prompt tokens x the prompt's text blocks), so the ~4 characters per token estimate cancels out."""
        belief = result.cycle_state.read(PREFIX_BELIEF)
        if belief is None or response.cached_tokens is None or not response.prompt_tokens:
            return
        name = endpoint.spec.name
        held = self._held.get(name)
        if held is None:
            return
        believed, prompt_blocks = belief
        cached = response.cached_tokens / response.prompt_tokens * prompt_blocks
        full = self.server_capacity(endpoint)
        capacity = self._capacity.get(name) or full
        if believed > cached + 1:
            capacity = max(int(prompt_blocks) + 1, capacity - int(believed - cached))
            self._trim(name, held, capacity)
        elif cached > believed + 1:
            capacity = min(full, capacity + int(cached - believed))
        self._capacity[name] = capacity

    def _forget(self, name: str, block_hash: int) -> None:
        holders = self._heads.get(block_hash)
        if holders is not None:
            holders.discard(name)
            if not holders:
                del self._heads[block_hash]

    def pool_changed(self, endpoints: Sequence[Endpoint]) -> None:
        present = {e.spec.name for e in endpoints}
        for name in [n for n in self._held if n not in present]:
            self._capacity.pop(name, None)
            for block_hash in self._heads.keys() & self._held.pop(name).keys():
                self._forget(name, block_hash)

    @property
    def index_size(self) -> int:
        """Entries in the index: (block hash, endpoint) pairs over all endpoints."""
        return sum(len(held) for held in self._held.values())

    def entries(self, endpoint: Endpoint) -> int:
        """Block hashes the index believes `endpoint` holds."""
        held = self._held.get(endpoint.spec.name)
        return len(held) if held is not None else 0

    @property
    def hit_ratio(self) -> float:
        """Share of the routed prompts' blocks that the chosen endpoint was already known to hold."""
        return self.matched_blocks / self.total_blocks if self.total_blocks else 0.0
