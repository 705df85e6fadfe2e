"""Sampling from the step's logits: greedy at temperature 0, else temperature, top-k, top-p; a request's `seed`
makes its tokens reproducible (each step's generator is seeded by the seed and the token's index)."""

from __future__ import annotations

import torch

from modelserver.engine.executor import ScheduledSequence


def sample(logits: torch.Tensor, sequences: list[ScheduledSequence]) -> tuple[list[int], list[dict[int, float] | None]]:
    """The next token of each row, and (where `params.logprobs` is set) the sampled token's logprob with the top
    `params.logprobs` alternatives, from the unmodified distribution like OpenAI's API."""
    greedy = logits.argmax(dim=-1).tolist()
    out = []
    for row, seq in enumerate(sequences):
        p = seq.params
        if p.temperature == 0.0:
            out.append(greedy[row])
            continue
        scores = logits[row] / p.temperature
        if p.top_k:
            kth = torch.topk(scores, min(p.top_k, scores.shape[-1])).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if p.top_p < 1.0:
            ordered, index = torch.sort(scores, descending=True)
            cumulative = torch.softmax(ordered, dim=-1).cumsum(-1)
            drop = cumulative - torch.softmax(ordered, dim=-1) > p.top_p  # keep the smallest set reaching top_p
            scores = scores.scatter(0, index, ordered.masked_fill(drop, float("-inf")))
        generator = None
        if p.seed is not None:
            generator = torch.Generator(device=logits.device).manual_seed(
                (p.seed * 1_000_003 + seq.num_sampled) % 2**63
            )
        out.append(int(torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator)))
    return out, [
        _logprobs(logits[row], token, seq.params.logprobs)
        for row, (seq, token) in enumerate(zip(sequences, out, strict=True))
    ]


def _logprobs(row: torch.Tensor, token: int, top: int | None) -> dict[int, float] | None:
    if top is None:
        return None
    logprobs = torch.log_softmax(row, dim=-1)
    chosen = {token: float(logprobs[token])}
    if top:
        values, indices = torch.topk(logprobs, min(top, logprobs.shape[-1]))
        chosen.update(zip(indices.tolist(), values.tolist(), strict=True))
    return chosen
