"""precise-prefix-cache-scorer: send a prompt where the model server's KV cache holds its prefix, as the server
itself reports it (vLLM KV events), unless that endpoint is overloaded.

How: the prompt is tokenized exactly as the server tokenizes it (`epp.scheduling.prompt_tokens`: the same tokenizer
and chat template, with a per-prefix cache) and its full blocks are hashed exactly as the server hashes them
(`protocol.kv_events.request_block_hashes`: vLLM's chained SHA-256 with the servers' PYTHONHASHSEED, the adapter's
name for a LoRA request), so a block found in the index is a block the server holds. Score = the longest run of the
prompt's leading blocks an endpoint holds (`epp.datalayer.kv_events.KVBlockIndex`, fed by the servers' KV events)
/ the prompt's blocks, for endpoints that publish events; it abstains for the others, which prefix-cache-scorer
(the approximate index) keeps scoring, so a pool that mixes both works with both scorers in the profile. The same
load guard as prefix-cache-scorer (`epp.scheduling.load.guard_load`).

Tokenizing and hashing run in `prepare` (PrepareData), before the cycle: in a worker thread when the part of the prompt
the per-prefix cache does not hold is longer than `threadPromptChars` (the tokenizer releases the GIL), so a new
64k-token prompt does not hold the event loop while a conversation's next turn does not pay for a thread hop. Block
digests are cached per token prefix (`blockHashCacheBlocks`), so a prompt that extends an earlier one hashes only
its new blocks.
Reads: the request body (PrepareData), the KV-event index, the candidates' queue depths (load guard). Writes:
PROMPT_BLOCK_HASHES.

Parameters: tokenizerDir (a local Hugging Face model directory with tokenizer.json and tokenizer_config.json; unset:
the sim's built-in tokenizer), blockSize (0: the block size of the servers' events, else 16), hashSeed (the servers'
PYTHONHASHSEED; default: the EPP's own PYTHONHASHSEED), hashAlgo (the servers' --prefix-caching-hash-algo: sha256 or
sha256_cbor), loadGuardQueueGap (8; 0 = off), threadPromptChars (8192), tokenCacheTokens (2,000,000 tokens of
cached prompt segments), blockHashCacheBlocks (500,000).
Trade-offs: needs the servers' tokenizer files and hash seed (without PYTHONHASHSEED vLLM's hashes are random per
process and nothing matches: the scorer then abstains everywhere); a request waits for its tokenization (~ms for a
new 8k-token prompt, see epp/bench/tokenize.py) where the approximate scorer hashes text; the index is only as fresh
as the events (a gap drops an endpoint until it republishes).
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Sequence

from epp.datalayer.endpoint import Endpoint
from epp.datalayer.kv_events import KVBlockIndex
from epp.scheduling.errors import ConfigError
from epp.scheduling.framework import KVEventsConsumer, Parameters, PrepareData, Scorer, register
from epp.scheduling.load import QUEUE_DEPTH_READS, QUEUE_DEPTHS, guard_load
from epp.scheduling.prompt_tokens import PromptTokenizer
from epp.scheduling.types import CycleState, SchedulingRequest, StateKey
from protocol.kv_events import HASH_ALGOS, block_hasher, external_block_hash, lora_extra_keys

DEFAULT_BLOCK_SIZE = 16
PROMPT_BLOCK_HASHES: StateKey[list[int]] = StateKey("prompt-block-hashes")  # the server's hashes of the prompt


class BlockHashCache:
    """vLLM block digests per token prefix: the key of block i chains Python's hash of the block's token ids onto
    block i-1's key (cheap), so only blocks never seen before are hashed with SHA-256. Bounded, oldest insertion
    first out (a prefix still in use that falls out is hashed again once); thread-safe."""

    def __init__(self, algo: str, hash_seed: str | None, capacity: int):
        self.hasher = block_hasher(algo, hash_seed)
        self.capacity = capacity
        self._digests: dict[int, tuple[bytes, int]] = {}
        self._lock = threading.Lock()

    def hashes(self, token_ids: Sequence[int], block_size: int, lora_name: str | None) -> list[int]:
        extra = lora_extra_keys(lora_name)
        key = hash((block_size, lora_name))
        parent: bytes | None = None
        out: list[int] = []
        append = out.append
        digests, hash_block = self._digests, self.hasher.hash_block
        with self._lock:  # one acquisition per prompt: the loop and a worker thread rarely meet here
            for start in range(0, len(token_ids) - block_size + 1, block_size):
                block = tuple(token_ids[start : start + block_size])
                key = hash((key, block))
                known = digests.get(key)
                if known is None:
                    digest = hash_block(parent, block, extra)
                    known = digests[key] = (digest, external_block_hash(digest))
                parent = known[0]
                append(known[1])
            excess = len(digests) - self.capacity
            if excess > 0:
                for old in list(itertools.islice(digests, excess)):
                    del digests[old]
        return out


@register("precise-prefix-cache-scorer")
class PrecisePrefixCacheScorer(Scorer, PrepareData, KVEventsConsumer):
    consumes = (*QUEUE_DEPTH_READS, QUEUE_DEPTHS, PROMPT_BLOCK_HASHES)
    produces = (PROMPT_BLOCK_HASHES, QUEUE_DEPTHS)
    requires_kv_events = True

    def __init__(self, parameters: dict | None):
        p = Parameters("precise-prefix-cache-scorer", parameters)
        tokenizer_dir = p.get("tokenizerDir", None, (str, type(None)))
        self.block_size = p.get("blockSize", 0, int, minimum=0)
        self.hash_seed = p.get("hashSeed", os.environ.get("PYTHONHASHSEED"), (str, type(None)))
        algo = p.get("hashAlgo", "sha256", str)
        if algo not in HASH_ALGOS:
            raise ConfigError(f"precise-prefix-cache-scorer: hashAlgo must be one of {HASH_ALGOS}, got {algo!r}")
        self.load_guard_gap = float(p.get("loadGuardQueueGap", 8, (int, float), minimum=0))
        self.thread_prompt_chars = p.get("threadPromptChars", 8192, int, minimum=0)
        cache_tokens = p.get("tokenCacheTokens", 2_000_000, int, minimum=0)
        cache_blocks = p.get("blockHashCacheBlocks", 500_000, int, minimum=0)
        p.done()
        try:
            self.tokenizer = PromptTokenizer.from_directory(tokenizer_dir, cache_tokens=cache_tokens)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"precise-prefix-cache-scorer: tokenizerDir: {exc}") from None
        self.block_hashes = BlockHashCache(algo, self.hash_seed, cache_blocks)
        self.index: KVBlockIndex | None = None

    def use_kv_index(self, index: KVBlockIndex) -> None:
        self.index = index

    def _active(self, request: SchedulingRequest) -> bool:
        """Something to match against: events flow and the request has a body (else no tokenizing at all)."""
        return self.index is not None and self.index.has_publishers and request.payload is not None

    def in_thread(self, request: SchedulingRequest) -> bool:
        """A worker thread only for what is long to tokenize: a long prompt whose new part (what the per-prefix
        cache does not hold) is itself over threadPromptChars; a long conversation's next turn stays on the loop."""
        if len(request.prompt) <= self.thread_prompt_chars or not self._active(request):
            return False
        prompt = self.tokenizer.prompt(request.payload)
        return isinstance(prompt, str) and self.tokenizer.uncached_chars(prompt) > self.thread_prompt_chars

    def prepare(self, cycle_state: CycleState, request: SchedulingRequest) -> None:
        if not self._active(request):
            return
        index = self.index
        token_ids = self.tokenizer.token_ids(request.payload)
        if not token_ids:
            return
        block_size = self.block_size or index.block_size or DEFAULT_BLOCK_SIZE
        models = index.base_models
        lora_name = None if not models or request.model in models else request.model
        cycle_state.write(PROMPT_BLOCK_HASHES, self.block_hashes.hashes(token_ids, block_size, lora_name))

    def score(
        self, cycle_state: CycleState, request: SchedulingRequest, endpoints: list[Endpoint]
    ) -> list[float] | None:
        hashes = cycle_state.read(PROMPT_BLOCK_HASHES)
        index = self.index
        if not hashes or index is None:
            return None
        publishing = [e.hostport for e in endpoints if index.publishes(e.hostport)]
        if not publishing:
            return None
        matched = index.prefix_blocks(hashes, publishing)
        blocks = len(hashes)
        scores = [matched.get(e.hostport, 0) / blocks for e in endpoints]
        return guard_load(scores, cycle_state, endpoints, self.load_guard_gap)
