"""`epp-bench tokenize`: what exact tokens cost the EPP (precise-prefix-cache-scorer's `prepare`) at 1k, 8k and 64k
prompt tokens, with the sim's built-in tokenizer: a chat request rendered through the chat template, tokenized and
its blocks hashed (vLLM's SHA-256 chain) as far as some server holds them (the whole text's encoding through the
tokenizer and through the scorer's warm pre-token cache beside them), four ways: cold (nothing cached) when a
server holds the whole prompt (all of it is read) and when no server holds it (read up to its first block), a new
question on a context a server holds (the per-prefix caches hit), and the same prompt again. Also the event loop's
longest stall while held 64k-token prompts are prepared in a worker thread (the scheduler's path for long prompts),
against preparing them on the loop."""

from __future__ import annotations

import asyncio
import random
import statistics
import time

from epp.datalayer.kv_events import KVBlockIndex
from epp.scheduling.plugins import build_plugin
from epp.scheduling.plugins.precise_prefix_cache_scorer import PROMPT_BLOCKS
from epp.scheduling.prompt_tokens import PromptTokenizer
from epp.scheduling.types import CycleState, SchedulingRequest
from protocol.kv_events import request_block_hashes
from protocol.openai import prompt_text
from protocol.tokenizer import load_tokenizer

SIZES = (1024, 8192, 65536)


def _context(tokens: int, rng: random.Random) -> str:
    tokenizer = load_tokenizer(None)
    words = [tokenizer.decode([i]) for i in tokenizer.filler_token_ids()]
    return "".join(rng.choice(words) for _ in range(tokens))


SERVER = "127.0.0.1:8000"


def _scorer():
    scorer = build_plugin("precise-prefix-cache-scorer", {"hashSeed": "0"})
    index = KVBlockIndex()
    index.saw(SERVER, "m")
    scorer.use_kv_index(index)
    return scorer, index


def _hold(index: KVBlockIndex, scorer, request: SchedulingRequest) -> None:
    """The server holds the whole prompt: its blocks as the server hashes them, in the index."""
    ids = load_tokenizer(None).encode(scorer.tokenizer.prompt(request.payload))
    index.store(SERVER, request_block_hashes(ids, 16, hash_seed="0"))


def _request(context: str, question: str) -> SchedulingRequest:
    payload = {
        "model": "m",
        "messages": [{"role": "system", "content": context}, {"role": "user", "content": question}],
    }
    return SchedulingRequest(request_id="r", model="m", prompt=prompt_text(payload), payload=payload)


def _prepare_ms(scorer, request: SchedulingRequest) -> float:
    state = CycleState()
    start = time.perf_counter()
    scorer.prepare(state, request)
    elapsed = time.perf_counter() - start
    assert state.read(PROMPT_BLOCKS).blocks
    return elapsed * 1000


def measure(repeats: int = 5, sizes: tuple[int, ...] = SIZES) -> list[dict]:
    """A row per prompt size in `sizes` (tokens of context), each figure the median of `repeats`."""
    rng = random.Random(0)
    tokenizer = load_tokenizer(None)
    encoder = PromptTokenizer(tokenizer).encoder  # the scorer's kind, its own cache (the scorers' stay cold)
    rows = []
    for size in sizes:
        cold, cold_new, new_question, same, whole, cached, one_by_one = [], [], [], [], [], [], []
        for r in range(repeats):
            context = _context(size, rng)
            first = _request(context, f"question {r}: what is the capital of France?")
            scorer, _ = _scorer()  # empty caches, a server that holds nothing
            cold_new.append(_prepare_ms(scorer, first))
            scorer, index = _scorer()
            _hold(index, scorer, first)
            text = scorer.tokenizer.prompt(first.payload)
            start = time.perf_counter()
            tokens = tokenizer.encode(text)
            whole.append((time.perf_counter() - start) * 1000)
            assert encoder.encode(text) == tokens  # the same text through a pre-token cache, warm
            start = time.perf_counter()
            encoder.encode(text)
            cached.append((time.perf_counter() - start) * 1000)
            start = time.perf_counter()  # what `pieces` would cost encoding each segment in its own call
            for segment in scorer.tokenizer.segments(text):
                tokenizer.encode(segment)
            one_by_one.append((time.perf_counter() - start) * 1000)
            cold.append(_prepare_ms(scorer, first))
            new_question.append(_prepare_ms(scorer, _request(context, f"question {r}: how many days in a year?")))
            same.append(_prepare_ms(scorer, first))
        rows.append(
            {
                "prompt_tokens": len(tokens),
                "encode_whole_ms": statistics.median(whole),
                "encode_whole_pre_token_cache_ms": statistics.median(cached),
                "encode_segments_one_by_one_ms": statistics.median(one_by_one),
                "prepare_cold_ms": statistics.median(cold),
                "prepare_cold_new_ms": statistics.median(cold_new),
                "prepare_cached_context_ms": statistics.median(new_question),
                "prepare_same_prompt_ms": statistics.median(same),
            }
        )
    return rows


async def _loop_stall(in_thread: bool, prompts: int = 4) -> float:
    """The event loop's longest gap between 1 ms ticks while `prompts` cold 64k-token prompts that a server holds
    are prepared."""
    scorer, index = _scorer()
    rng = random.Random(1)
    requests = [_request(_context(SIZES[-1], rng), "q") for _ in range(prompts)]
    for request in requests:
        _hold(index, scorer, request)
    stop, longest = False, 0.0

    async def ticker():
        nonlocal longest
        last = time.perf_counter()
        while not stop:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            longest = max(longest, now - last)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    for request in requests:
        if in_thread:
            await asyncio.to_thread(scorer.prepare, CycleState(), request)
        else:
            scorer.prepare(CycleState(), request)
            await asyncio.sleep(0)
    stop = True
    await task
    return longest * 1000


def main() -> None:
    rows = measure()
    print(
        "| prompt tokens | encode whole (ms) | encode whole, pre-token cache (ms) | encode segments one call each (ms) "
        "| prepare cold, held (ms) "
        "| prepare cold, held by none (ms) | new question, cached context (ms) | same prompt (ms) |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        print(
            f"| {row['prompt_tokens']} | {row['encode_whole_ms']:.2f} | {row['encode_whole_pre_token_cache_ms']:.2f} | "
            f"{row['encode_segments_one_by_one_ms']:.2f} | "
            f"{row['prepare_cold_ms']:.2f} | "
            f"{row['prepare_cold_new_ms']:.2f} | "
            f"{row['prepare_cached_context_ms']:.2f} | {row['prepare_same_prompt_ms']:.2f} |"
        )
    on_loop = asyncio.run(_loop_stall(in_thread=False))
    threaded = asyncio.run(_loop_stall(in_thread=True))
    print(
        f"\nevent loop's longest stall while 4 cold held 64k-token prompts are prepared: {on_loop:.1f} ms on the loop, "
        f"{threaded:.1f} ms in a worker thread"
    )
