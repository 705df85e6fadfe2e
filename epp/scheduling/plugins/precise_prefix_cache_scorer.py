"""precise-prefix-cache-scorer: send a prompt where the model server's KV cache holds its prefix, as the server
itself reports it (vLLM KV events), unless that endpoint is overloaded.

How: the prompt is tokenized exactly as the server tokenizes it (`epp.scheduling.prompt_tokens`: the same tokenizer
and chat template, with a per-prefix cache) and its full blocks are hashed exactly as the server hashes them
(`protocol.kv_events.request_block_hashes`: vLLM's chained SHA-256 with the servers' PYTHONHASHSEED, the adapter's
name for a LoRA request), so a block found in the index is a block the server holds. Score = the longest run of the
prompt's leading blocks an endpoint holds (`epp.datalayer.kv_events.KVBlockIndex`, fed by the servers' KV events)
/ the prompt's blocks, for endpoints that publish events; prefix-cache-scorer (the approximate index) keeps scoring
the others, so a pool that mixes both works with both scorers in the profile. An endpoint that has published nothing
yet (a server new to the pool, or never sent a request) is expected to hold what every publishing candidate holds,
when at least two publish (`PromptBlocks.common`): a prefix every serving server holds (an agent's tools prompt) is
a prefill each server pays once, and scored as a miss there it kept every new session on the servers that happened
to get that prompt first (docs/2026-11-30-replicas-notebook.md, "Agent sessions locked onto the first servers").
The same load guard as prefix-cache-scorer (`epp.scheduling.load.guard_load`).

Tokenizing and hashing run in `prepare` (PrepareData), before the cycle, and only as far as the score needs: a
segment at a time, up to the segment with the first block that no endpoint's run of leading blocks holds (blocks
chain their parent's hash, so no later block can match); the rest of the prompt is neither tokenized nor hashed
and its block count is estimated from its characters (the same denominator for every endpoint: the order of the
scores is exact). A new 8k-token prompt costs its first, short segment, ~0.16 ms against ~6 ms for the whole prompt
(harness/bench/tokenize.py). In a worker thread when the part of the prompt the per-prefix cache does not hold is
longer than `threadPromptChars` (the tokenizer releases the GIL; the pre-token cache holds it a segment at a time),
so a 64k-token prompt that a server holds does not stall the event loop while a conversation's next turn does not
pay for a thread hop. Block digests are cached per token prefix (`blockHashCacheBlocks`), so a prompt that extends
an earlier one hashes only its new blocks.
Reads: the request body (PrepareData), the KV-event index, the candidates' queue depths (load guard). Writes:
PROMPT_BLOCKS (the held leading blocks' hashes and the prompt's block count).

Parameters: tokenizerDir (a local Hugging Face model directory with tokenizer.json and tokenizer_config.json; unset:
the sim's built-in tokenizer), blockSize (0: the block size of the servers' events, else 16), hashSeed (the servers'
PYTHONHASHSEED; default: the EPP's own PYTHONHASHSEED), hashAlgo (the servers' --prefix-caching-hash-algo: sha256 or
sha256_cbor), loadGuardQueueGap (8; 0 = off), scoreBeyondShared (true: the held run beyond what every candidate
holds (an endpoint that has published nothing counted as holding `common`), over the prompt's blocks beyond it, so that a prefix held everywhere (an agent's shared tools
prompt) does not dilute what tells the candidates apart: a session's own context; false: the held run over the
prompt's blocks. The default since docs/2026-11-29-agentic-floor.md measured it: better on the agentic workload,
within 5 % on the others), threadPromptChars (8192), tokenCacheTokens (2,000,000 tokens of
cached prompt segments), blockHashCacheBlocks (500,000).
Trade-offs: needs the servers' tokenizer files and hash seed (without PYTHONHASHSEED vLLM's hashes are random per
process and nothing matches: the scorer then abstains everywhere); a request waits for its tokenization (~ms for a
new 8k-token prompt, see harness/bench/tokenize.py) where the approximate scorer hashes text; the index is only as fresh
as the events (a gap drops an endpoint until it republishes); the first request a server new to the pool gets
pays the common prefix's prefill, which its score and its latency prediction (`CandidatePredictions.get`) counted as
held: once per new server, that request is slower than predicted (and an SLO filter may have let it through).
"""

from __future__ import annotations

import itertools
import os
import threading
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import xxhash

from epp.config import ConfigError
from epp.datalayer.endpoint import Endpoint
from epp.datalayer.kv_events import KVBlockIndex
from epp.datalayer.load import QUEUE_DEPTH_READS
from epp.scheduling.framework import KVEventsConsumer, Parameters, PrepareData, Scorer, Stability, register
from epp.scheduling.load import QUEUE_DEPTHS, guard_load
from epp.scheduling.types import CycleState, SchedulingRequest, StateKey
from protocol.kv_events import HASH_ALGOS, block_hasher, external_block_hash, lora_extra_keys

DEFAULT_BLOCK_SIZE = 16
UINT64 = (1 << 64) - 1


@dataclass(slots=True)
class PromptBlocks:
    """The prompt's blocks as far as the score needs them."""

    hashes: list[int]  # the leading blocks' hashes (as KV events carry them) while some endpoint holds them all
    blocks: int  # the prompt's full blocks: counted when all its tokens were read, else estimated (see prepare)
    held: dict[str, int] = field(default_factory=dict)  # held_by's answers this cycle, per endpoint
    common_blocks: int | None = field(default=None, compare=False)  # common's answer this cycle

    def held_by(self, index: KVBlockIndex, endpoints: list[str]) -> dict[str, int]:
        """How many of the leading blocks each of `endpoints` holds (`KVBlockIndex.prefix_blocks`: an endpoint's
        count does not depend on the others asked with it), walked once a cycle: this scorer and
        prefix-cache-scorer's cache estimate for the latency predictor both ask, and an agent's prompt is ~350
        held blocks. The answer may name more endpoints than asked."""
        held = self.held
        missing = [e for e in endpoints if e not in held]
        if missing:
            held.update(index.prefix_blocks(self.hashes, missing))
        return held

    def common(self, index: KVBlockIndex, publishing: list[str], candidates: int) -> int:
        """The leading blocks every publishing candidate holds (`held_by`), when every one of the `candidates`
        publishes or at least two do; else 0. A candidate that has published nothing (a server new to the pool, or
        never sent a request) is expected to hold that much as well: a prefix every server that serves holds (an
        agent's tools prompt) is a cost each server pays once, not a reason to keep new work off the ones that
        have not paid it yet. With one publisher, what it holds is its own (a new pool's first prompt), not
        common. Worked out once a cycle, for the first candidates asked: the latency predictor's filter asks for
        all of them, and the scorers after it must not lose what is common because it dropped a publisher."""
        common = self.common_blocks
        if common is None:
            if len(publishing) < 2 and len(publishing) < candidates:
                common = 0
            else:
                held = self.held_by(index, publishing)
                common = min(held[e] for e in publishing)
            self.common_blocks = common
        return common


PROMPT_BLOCKS: StateKey[PromptBlocks] = StateKey("prompt-blocks")


class BlockHashCache:
    """vLLM block digests per token prefix: the key of block i chains an xxHash of the block's token ids (their
    bytes) onto block i-1's key (cheap), so only blocks never seen before are hashed with SHA-256. A piece's blocks
    are keyed the same way as a whole (one xxHash of all their bytes onto the key before them), so a piece seen
    before (a prompt segment from `PromptTokenizer`'s cache: an agent's shared tools prompt, a conversation's earlier
    turns) costs one lookup, not one per block (~1 us each, ~350 blocks in an agent's prompt). Bounded: past
    `capacity` blocks in either table the oldest tenth of its insertions go at once (a prefix still in use that
    falls out is hashed again once); thread-safe."""

    def __init__(self, algo: str, hash_seed: str | None, capacity: int):
        self.hasher = block_hasher(algo, hash_seed)
        self.capacity = capacity
        self._digests: dict[int, tuple[bytes, int]] = {}
        # a piece's key -> its blocks' hashes, and the key and digest of its last block
        self._pieces: dict[int, tuple[tuple[int, ...], int, bytes]] = {}
        self._piece_blocks = 0
        self._lock = threading.Lock()

    def hashes(self, pieces: Iterable[Sequence[int]], block_size: int, lora_name: str | None) -> Iterator[list[int]]:
        """For each piece of token ids that `pieces` yields (of any length; ids below 2^32, as `PromptTokenizer`
        gives them), the hashes of the full blocks it completes, in order; lazily: a caller that stops pulls no
        further piece and hashes no further block."""
        extra = lora_extra_keys(lora_name)
        key = hash((block_size, lora_name)) & UINT64  # (an xxHash seed: the keys live in this process only)
        parent: bytes | None = None
        digests, known_pieces, hash_block = self._digests, self._pieces, self.hasher.hash_block
        chain = xxhash.xxh3_64_intdigest
        pending = array("I")
        size = pending.itemsize
        for piece in pieces:
            pending.extend(piece)
            full = len(pending) - len(pending) % block_size
            if not full:
                yield []
                continue
            data = pending.tobytes()  # a block's key hashes its bytes: no tuple of ints built per block
            piece_key = chain(data[: full * size], key)
            seen = known_pieces.get(piece_key)
            if seen is not None:
                out, key, parent = list(seen[0]), seen[1], seen[2]
                del pending[:full]
                yield out
                continue
            out = []
            new: dict[int, tuple[bytes, int]] = {}
            for start in range(0, full, block_size):
                key = chain(data[start * size : (start + block_size) * size], key)
                known = digests.get(key)
                if known is None:
                    digest = hash_block(parent, pending[start : start + block_size], extra)
                    known = new[key] = (digest, external_block_hash(digest))
                parent = known[0]
                out.append(known[1])
            del pending[:full]
            self._remember(new, piece_key, (tuple(out), key, parent))
            yield out

    def _remember(self, new: dict[int, tuple[bytes, int]], piece_key: int, piece) -> None:
        """One lock acquisition per piece: the loop and a worker thread rarely meet here."""
        capacity = self.capacity
        with self._lock:
            digests = self._digests
            digests.update(new)
            if len(digests) > capacity:
                for old in list(itertools.islice(digests, len(digests) - capacity * 9 // 10)):
                    del digests[old]
            pieces = self._pieces
            if piece_key not in pieces:
                pieces[piece_key] = piece
                self._piece_blocks += len(piece[0])
            if self._piece_blocks > capacity:
                # the oldest go in one pass, as for the digests: popping the first key one at a time walks the
                # slots already emptied at the dict's front again each time
                old, dropped = [], 0
                for old_key, (hashes, _, _) in pieces.items():
                    if self._piece_blocks - dropped <= capacity * 9 // 10:
                        break
                    old.append(old_key)
                    dropped += len(hashes)
                for old_key in old:
                    del pieces[old_key]
                self._piece_blocks -= dropped


@register("precise-prefix-cache-scorer", Stability.BETA)
class PrecisePrefixCacheScorer(Scorer, PrepareData, KVEventsConsumer):
    consumes = (*QUEUE_DEPTH_READS, QUEUE_DEPTHS, PROMPT_BLOCKS)
    produces = (PROMPT_BLOCKS, QUEUE_DEPTHS)
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
        self.beyond_shared = p.get("scoreBeyondShared", True, bool)
        self.thread_prompt_chars = p.get("threadPromptChars", 8192, int, minimum=0)
        cache_tokens = p.get("tokenCacheTokens", 2_000_000, int, minimum=0)
        cache_blocks = p.get("blockHashCacheBlocks", 500_000, int, minimum=0)
        p.done()
        # here, not at the top: the tokenizer's libraries load only when a profile uses this scorer (the EPP's
        # start-up without them: tests/test_packaging.py)
        from epp.scheduling.prompt_tokens import PromptTokenizer

        try:
            self.tokenizer = PromptTokenizer.from_directory(tokenizer_dir, cache_tokens=cache_tokens)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"precise-prefix-cache-scorer: tokenizerDir: {exc}") from None
        self.block_hashes = BlockHashCache(algo, self.hash_seed, cache_blocks)
        self.index: KVBlockIndex | None = None
        # the last request `in_thread` rendered and its prompt, which `prepare` then takes rather than render it
        # again (~0.1-0.3 ms for an agent's prompt); one slot: another request meanwhile only costs a second render
        self._rendered: tuple[SchedulingRequest, str | list[int] | None] | None = None

    def use_kv_index(self, index: KVBlockIndex) -> None:
        self.index = index
        index.hasher = self.block_hashes.hasher  # servers that hash otherwise are found out (KVEventSubscriber)

    def _active(self, request: SchedulingRequest) -> bool:
        """Something to match against: events flow and the request has a body (else no tokenizing at all)."""
        return self.index is not None and self.index.has_publishers and request.payload is not None

    def in_thread(self, request: SchedulingRequest) -> bool:
        """A worker thread only for what is long to tokenize: a long prompt whose new part (what the per-prefix
        cache does not hold) is itself over threadPromptChars; a long conversation's next turn stays on the loop.
        A new prompt that no endpoint holds now costs only its first segment, yet it keeps the thread hop: on the
        loop, the heterogeneous benchmark's mean TTFT was worse (epp-predicted at 16/s: 230-253 ms in 4 runs
        against 204 and 213 with the hop, and the predictor's TTFT error 21-28 % against 11-14 %), for a reason
        not yet found."""
        if len(request.prompt) <= self.thread_prompt_chars or not self._active(request):
            return False
        prompt = self.tokenizer.prompt(request.payload, request.kind)
        self._rendered = (request, prompt)
        return isinstance(prompt, str) and self.tokenizer.uncached_chars(prompt) > self.thread_prompt_chars

    def prepare(self, cycle_state: CycleState, request: SchedulingRequest) -> None:
        """Writes PROMPT_BLOCKS: the prompt is tokenized a segment at a time, and each segment's blocks hashed
        and followed in the index, only until the segment with the first block that no endpoint's run holds
        (KVBlockIndex.extend_run): no later block can match, so the rest is neither tokenized nor hashed (the
        blocks after it within that segment are: ~20 at ~1.2 us each, where a call per block would cost more on
        a prompt held to its end). The block count is then estimated from the characters left at the tokens per
        character read; it is the same for every endpoint, so it scales the scores but never reorders them. A
        prompt held to its end is read whole and counted exactly."""
        if not self._active(request):
            return
        rendered, self._rendered = self._rendered, None
        if rendered is not None and rendered[0] is request:
            prompt = rendered[1]
        else:
            prompt = self.tokenizer.prompt(request.payload, request.kind)
        if prompt is None:
            return
        index = self.index
        block_size = self.block_size or index.block_size or DEFAULT_BLOCK_SIZE
        models = index.base_models
        lora_name = None if not models or request.model in models else request.model
        chars = tokens = 0

        def read() -> Iterator[Sequence[int]]:
            nonlocal chars, tokens
            for length, ids in self.tokenizer.pieces(prompt):
                chars, tokens = chars + length, tokens + len(ids)
                yield ids

        hashes: list[int] = []
        run: set[str] | None = None
        for piece_hashes in self.block_hashes.hashes(read(), block_size, lora_name):
            held, run = index.extend_run(piece_hashes, run)
            hashes += piece_hashes[:held]
            if held < len(piece_hashes):
                estimate = round(tokens * len(prompt) / chars) // block_size
                cycle_state.write(PROMPT_BLOCKS, PromptBlocks(hashes, max(estimate, len(hashes) + 1)))
                return
        cycle_state.write(PROMPT_BLOCKS, PromptBlocks(hashes, tokens // block_size))

    def score(
        self, cycle_state: CycleState, request: SchedulingRequest, endpoints: list[Endpoint]
    ) -> list[float] | None:
        prompt_blocks = cycle_state.read(PROMPT_BLOCKS)
        index = self.index
        if prompt_blocks is None or not prompt_blocks.blocks or index is None:
            return None
        publishing = [e.hostport for e in endpoints if index.publishes(e.hostport)]
        if not publishing:
            return None
        matched = prompt_blocks.held_by(index, publishing)
        # a candidate that has published nothing yet is expected to hold what every publisher holds (`common`), so
        # that a server new to the pool is not kept from new work by the one prefill it needs to join
        expected = prompt_blocks.common(index, publishing, len(endpoints)) if len(publishing) < len(endpoints) else 0
        held = [matched.get(e.hostport, expected) for e in endpoints]
        # what every candidate holds (scoreBeyondShared) prefills nowhere: only the rest tells them apart
        shared = min(held) if self.beyond_shared else 0
        rest = prompt_blocks.blocks - shared
        if rest <= 0:
            return None
        scores = [(h - shared) / rest for h in held]
        return guard_load(scores, cycle_state, endpoints, self.load_guard_gap)
