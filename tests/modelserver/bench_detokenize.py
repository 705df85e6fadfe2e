"""Detokenization cost per output token at a given output length: the incremental detokenizer against decoding
the whole output at every step and searching all of it for stop strings (what the API did before it).

    python -m tests.modelserver.bench_detokenize --tokens 4000
"""

import argparse
import random
import time

from modelserver.api.detokenizer import IncrementalDetokenizer
from protocol.tokenizer import Tokenizer, build_default_tokenizer

STOPS = ["<|never-1|>", "never two"]


def output_ids(tokenizer: Tokenizer, count: int) -> list[int]:
    words = [
        "the",
        "model",
        "server",
        "streams",
        "tokens",
        "to",
        "the",
        "client",
        "while",
        "the",
        "router",
        "watches",
        "every",
        "queue",
    ]
    rng = random.Random(0)
    ids: list[int] = []
    while len(ids) < count:
        ids += tokenizer.encode(" ".join(rng.choice(words) for _ in range(50)) + ".\n")
    return ids[:count]


def full_decode_per_step(tokenizer: Tokenizer, ids: list[int]) -> float:
    started = time.perf_counter()
    for n in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:n])
        for stop in STOPS:
            text.find(stop)
    return time.perf_counter() - started


def incremental(tokenizer: Tokenizer, ids: list[int]) -> float:
    started = time.perf_counter()
    detokenizer = IncrementalDetokenizer(tokenizer.decode, STOPS)
    for n in range(len(ids)):
        detokenizer.append(ids[n : n + 1])
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4000)
    args = parser.parse_args()
    tokenizer = Tokenizer(build_default_tokenizer())
    ids = output_ids(tokenizer, args.tokens)
    before = full_decode_per_step(tokenizer, ids)
    after = incremental(tokenizer, ids)
    print(f"{args.tokens} output tokens, one per step, {len(STOPS)} stop strings:")
    print(f"  full decode per step: {before * 1e6 / len(ids):.1f} µs per token ({before * 1e3:.0f} ms in all)")
    print(f"  incremental:          {after * 1e6 / len(ids):.1f} µs per token ({after * 1e3:.0f} ms in all)")
    print(f"  ratio {before / after:.0f}x")


if __name__ == "__main__":
    main()
