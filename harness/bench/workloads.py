"""Seeded request streams from the YAML workloads in this folder: (arrival offset in seconds, request body, request
headers)."""

from __future__ import annotations

import functools
import random
from pathlib import Path
from typing import NamedTuple

import yaml

from epp.scheduling.plugins.slo_headroom_filter import TPOT_HEADER, TTFT_HEADER

WORKLOADS = Path(__file__).parent / "workloads"
WORDS = (  # noqa: SIM905 (one sentence of words reads better than a column of 38 strings)
    "the model server cache request token route queue memory prompt answer question system user assistant latency "
    "batch prefix block adapter engine gateway picker metric scrape score weight budget decode prefill stream output "
    "input context window paged attention layer"
).split()


class TimedRequest(NamedTuple):
    at: float  # arrival offset, seconds from the start
    body: dict
    headers: dict[str, str]  # e.g. the request's latency objectives (TTFT_HEADER, TPOT_HEADER)
    kind: str = (
        ""  # the request's class in the workload (a mix entry, a traffic tier): reports break figures down by it
    )


def load_workload(name: str) -> dict:
    """A workload's YAML; `modelserver_args` (optional) are extra flags for its sim servers (e.g. a longer context)."""
    path = WORKLOADS / f"{name}.yaml"
    if not path.is_file():
        raise SystemExit(f"unknown workload {name!r}; known: {', '.join(p.stem for p in WORKLOADS.glob('*.yaml'))}")
    return yaml.safe_load(path.read_text())


@functools.cache
def _tokens_per_word() -> float:
    """Mean tokens per word of WORDS under the sim servers' built-in tokenizer, so that a workload's token counts
    are what the servers count (the jargon splits into ~2.3 tokens a word)."""
    from protocol.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(None)
    return sum(len(tokenizer.encode(" " + w)) for w in WORDS) / len(WORDS)


def _words(rng: random.Random, count: float) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, int(count))))


def _text(rng: random.Random, tokens: float) -> str:
    return _words(rng, tokens / _tokens_per_word())


def _text_of_bytes(rng: random.Random, size: float) -> str:
    return _words(rng, size / (sum(len(w) + 1 for w in WORDS) / len(WORDS)))


def _arrivals(rng: random.Random, arrival: dict, rate: float, duration: float) -> list[float]:
    times, t = [], 0.0
    burst = int(arrival.get("burst", 1))
    while True:
        t += rng.expovariate(rate / burst)
        if t >= duration:
            return times
        times += [t] * burst


def requests(
    spec: dict, model: str, rate: float | None = None, duration: float | None = None, seed: int = 0, scale: float = 1.0
) -> list[TimedRequest]:
    """The workload's requests; `scale` shrinks prompt lengths (for smoke runs). A mix entry's `slo` ({ttft_ms,
    tpot_ms}, either or both) becomes its requests' objective headers. Each request's `kind` is its mix entry
    (its `name`, or "<prompt_tokens>-token prompts") or its multi-LoRA traffic tier; empty for one-class
    workloads."""
    rng = random.Random(seed)
    arrival = spec.get("arrival", {})
    times = _arrivals(rng, arrival, rate or arrival.get("rate", 10), duration or spec.get("duration", 60))
    name = spec["name"]
    out: list[tuple[float, dict]] = []
    headers: list[dict[str, str]] = []
    kinds: list[str] = []
    if name == "shared-prefix":
        systems = [_text(rng, spec["system_prompt_tokens"] * scale) for _ in range(spec["groups"])]
        # Multi-turn: each (group, prompt) is one user whose next request carries its earlier turns, each answered
        # by a stand-in text of output_tokens (the open-loop stream is generated before any answer exists).
        histories: dict[tuple[int, int], str] = {}
        for t in times:
            user = (rng.randrange(spec["groups"]), rng.randrange(spec["prompts_per_group"]))
            question = f"\nQuestion {user[1]}: " + _text(rng, spec["question_tokens"])
            history = histories.get(user, "")
            out.append(
                (
                    t,
                    {
                        "model": model,
                        "prompt": systems[user[0]] + history + question,
                        "max_tokens": spec["output_tokens"],
                    },
                )
            )
            if spec.get("multi_turn"):
                histories[user] = history + question + "\nAnswer: " + _text(rng, spec["output_tokens"])
    elif name == "multi-lora":
        names, weights, tiers = [], [], {}
        for tier_index, tier in enumerate(spec["tiers"]):
            for i in range(tier["adapters"]):
                names.append(f"lora-{tier_index}-{i}")
                weights.append(tier["share"] / tier["adapters"])
                tiers[names[-1]] = f"tier {tier_index} ({tier['share']:.0%} of traffic on {tier['adapters']} adapters)"
        for t in times:
            adapter = rng.choices(names, weights)[0]
            kinds.append(tiers[adapter])
            out.append(
                (
                    t,
                    {
                        "model": adapter,
                        "prompt": _text(rng, spec["prompt_tokens"] * scale),
                        "max_tokens": spec["output_tokens"],
                    },
                )
            )
    elif name in ("heterogeneous", "slo-mixed", "mixed-gpus"):
        entries, shares = spec["mix"], [m["share"] for m in spec["mix"]]
        for t in times:
            kind = rng.choices(entries, shares)[0]
            slo = kind.get("slo") or {}
            kinds.append(kind.get("name") or f"{kind['prompt_tokens']}-token prompts")
            headers.append(
                {
                    header: str(slo[key])
                    for key, header in (("ttft_ms", TTFT_HEADER), ("tpot_ms", TPOT_HEADER))
                    if key in slo
                }
            )
            out.append(
                (
                    t,
                    {
                        "model": model,
                        "prompt": _text(rng, kind["prompt_tokens"] * scale),
                        "max_tokens": kind["output_tokens"],
                    },
                )
            )
    elif name == "long-prompt":
        for t in times:
            out.append(
                (
                    t,
                    {
                        "model": model,
                        "prompt": _text_of_bytes(rng, spec["prompt_bytes"] * scale),
                        "max_tokens": spec["output_tokens"],
                    },
                )
            )
    else:
        raise SystemExit(f"workload {name!r} has no generator")
    for _, body in out:
        body.update(stream=True, stream_options={"include_usage": True}, ignore_eos=True)
    return [
        TimedRequest(t, body, headers[i] if headers else {}, kinds[i] if kinds else "")
        for i, (t, body) in enumerate(out)
    ]


def lora_names(spec: dict) -> list[str]:
    return [f"lora-{i}-{j}" for i, tier in enumerate(spec.get("tiers", [])) for j in range(tier["adapters"])]
