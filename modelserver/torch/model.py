"""A decoder-only transformer (Llama / Qwen2 family) that reads and writes K/V in the engine's paged KV cache.

One step runs the new tokens of every scheduled sequence, flattened: prefill chunks and decodes together. New K/V
are written at each token's slot (block_table[pos // block_size] * block_size + pos % block_size). Attention then
runs once per layer for a whole group of sequences (the decodes; the prefill chunks), not once per sequence: the
group's queries and its gathered context K/V are padded to its longest chunk and context, and one mask, built once
per step, keeps each query to its own sequence's keys up to its position (a causal mask offset by the tokens
already cached, so a prefix-cache hit skips those tokens' compute entirely). Projections carry stacked LoRA slots
applied per token (shrink to rank r, then expand), so requests of different adapters share one pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

# The kernels scaled_dot_product_attention may choose, cuDNN attention left out: on an H200 (torch 2.11, cuDNN 9.19)
# SDPA preferred it for these masked calls, and a 1B-shaped decode step took 19.8 ms at batch 32 (14.5 ms at batch 1)
# against 14.7 ms (11.5 ms) with the memory-efficient kernel chosen otherwise. Flash stays: the CPU's fused kernel (on
# CUDA it takes no mask, so it never runs here).
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 4096

    @classmethod
    def from_hf(cls, config: dict) -> ModelConfig:
        architectures = config.get("architectures") or []
        if not any(a in ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM") for a in architectures):
            raise ValueError(f"unsupported architecture {architectures}: Llama, Qwen2 or Mistral expected")
        scaling = config.get("rope_scaling")
        if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
            raise ValueError(f"rope_scaling {scaling} is not supported")
        heads = config["num_attention_heads"]
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads", heads),
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=config.get("rope_theta", 10000.0),
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            attention_bias=config.get("attention_bias", "Qwen2ForCausalLM" in architectures),
            max_position_embeddings=config.get("max_position_embeddings", 4096),
        )


@dataclass
class AttentionGroup:
    """Sequences whose attention is one scaled_dot_product_attention call per layer: S sequences, each's new tokens
    padded to the longest chunk N, over each's context (cached and new tokens) padded to the longest context C."""

    query_rows: torch.Tensor  # [S, N] flat token of each query (padding repeats the sequence's first token)
    token_rows: torch.Tensor  # [n] flat index of each real query
    padded_rows: torch.Tensor  # [n] where that query sits among the S * N padded ones
    context_slots: torch.Tensor  # [S, C] cache slot of each key position (padding: slot 0, masked out)
    # [S, 1, G * N, C] additive, 0 where the query sees the key, -inf elsewhere; its rows are ordered (query head
    # within a KV head's group of G, token), as Attention.attend lays out the queries
    mask: torch.Tensor

    @classmethod
    def build(cls, first_rows, starts, lengths, block_tables, block_size, heads_per_kv, dtype, device, slot_mapping):
        """Per sequence: its first flat token, the position of that token, its number of new tokens, its blocks.
        Also writes where each new token's K/V goes into `slot_mapping` (flat, on the CPU): the context slots of
        the new tokens' positions."""
        first, start, new = torch.tensor(first_rows), torch.tensor(starts), torch.tensor(lengths)
        end = start + new
        # a multiple of 8 keys: CUDA's memory-efficient kernel otherwise pads a copy of the mask in every layer
        max_new, max_context = int(new.max()), -(-int(end.max()) // 8) * 8
        blocks = -(-max_context // block_size)
        tables = torch.tensor([t[:blocks] + [0] * (blocks - len(t)) for t in block_tables])
        context_slots = (tables[:, :, None] * block_size + torch.arange(block_size)).flatten(1)[:, :max_context]
        i = torch.arange(max_new)
        real = i < new[:, None]  # [S, N]
        offset = torch.where(real, i, 0)
        query_rows = first[:, None] + offset
        token_rows = query_rows[real]
        slot_mapping[token_rows] = context_slots.gather(1, start[:, None] + offset)[real]
        # query i of a sequence sits at position start + i and sees keys 0 .. start + i of its own context; a
        # padding query (i >= new) sees the whole context, so that no row of the softmax is empty. Built where the
        # model runs: for a long prefill chunk it is the step's largest tensor (G x N x C), too big to build on the
        # host and copy over every step.
        key = torch.arange(max_context, device=device)
        position = (start[:, None] + i).to(device)
        sees = (key <= position[:, :, None]) & (key < end.to(device)[:, None, None])  # [S, N, C]
        mask = torch.zeros(sees.shape, dtype=dtype, device=device).masked_fill_(~sees, float("-inf"))
        return cls(
            query_rows=query_rows.to(device),
            token_rows=token_rows.to(device),
            padded_rows=real.flatten().nonzero().squeeze(1).to(device),
            context_slots=context_slots.to(device),
            mask=mask.repeat(1, heads_per_kv, 1).unsqueeze(1),
        )


@dataclass
class StepInput:
    """One step's flattened tokens, its adapters' tokens and its attention groups: every tensor the layers share,
    built once per step."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] flat cache slots to write
    lora_rows: list[tuple[int, torch.Tensor]]  # per adapter slot in use (not 0): the flat indices of its tokens
    attention: list[AttentionGroup]  # together they cover every flat token once
    sample_rows: torch.Tensor  # flat token index of the last token of each sequence that samples


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class LoRALinear(nn.Module):
    """A projection with `max_loras + 1` stacked adapter slots; slot 0 stays zero ("no adapter")."""

    def __init__(self, in_features: int, out_features: int, bias: bool, max_loras: int, max_rank: int):
        super().__init__()
        self.base = nn.Linear(in_features, out_features, bias=bias)
        self.lora_a = nn.Parameter(torch.zeros(max_loras + 1, max_rank, in_features), requires_grad=False)
        self.lora_b = nn.Parameter(torch.zeros(max_loras + 1, out_features, max_rank), requires_grad=False)
        self.scaling = nn.Parameter(torch.zeros(max_loras + 1), requires_grad=False)

    def forward(self, x: torch.Tensor, lora_rows: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        y = self.base(x)
        for slot, rows in lora_rows:  # shrink then expand, one group of tokens per adapter slot
            shrunk = x[rows] @ self.lora_a[slot].T
            y.index_add_(0, rows, (shrunk @ self.lora_b[slot].T) * self.scaling[slot])
        return y

    def set_slot(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None, scaling: float) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.scaling[slot] = 0.0
        if a is not None and b is not None:
            rank = a.shape[0]
            if rank > self.lora_a.shape[1]:
                raise ValueError(f"LoRA rank {rank} exceeds --max-lora-rank {self.lora_a.shape[1]}")
            self.lora_a[slot, :rank] = a.to(self.lora_a.dtype)
            self.lora_b[slot, :, :rank] = b.to(self.lora_b.dtype)
            self.scaling[slot] = scaling


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig, max_loras: int, max_rank: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        b = c.attention_bias
        self.q_proj = LoRALinear(c.hidden_size, self.heads * self.head_dim, b, max_loras, max_rank)
        self.k_proj = LoRALinear(c.hidden_size, self.kv_heads * self.head_dim, b, max_loras, max_rank)
        self.v_proj = LoRALinear(c.hidden_size, self.kv_heads * self.head_dim, b, max_loras, max_rank)
        self.o_proj = LoRALinear(self.heads * self.head_dim, c.hidden_size, False, max_loras, max_rank)

    def forward(self, x, cos, sin, step: StepInput, k_cache, v_cache) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x, step.lora_rows).view(t, self.heads, self.head_dim)
        k = self.k_proj(x, step.lora_rows).view(t, self.kv_heads, self.head_dim)
        v = self.v_proj(x, step.lora_rows).view(t, self.kv_heads, self.head_dim)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        flat_k = k_cache.view(-1, self.kv_heads, self.head_dim)
        flat_v = v_cache.view(-1, self.kv_heads, self.head_dim)
        flat_k[step.slot_mapping] = k.to(flat_k.dtype)
        flat_v[step.slot_mapping] = v.to(flat_v.dtype)
        out = torch.empty_like(q)
        for group in step.attention:
            out[group.token_rows] = self.attend(q, flat_k, flat_v, group)
        return self.o_proj(out.view(t, -1), step.lora_rows)

    def attend(self, q, flat_k, flat_v, group: AttentionGroup) -> torch.Tensor:
        """The group's attention output [n, heads, head_dim], in the order of group.token_rows."""
        (s, n), d, kv = group.query_rows.shape, self.head_dim, self.kv_heads
        per_kv = self.heads // kv
        # the query heads that share a KV head become more query rows of that head (queries [S, kv, G * N, d]):
        # head counts then match without enable_gqa, which CUDA's kernels that take a mask (memory-efficient) and
        # the CPU's flash kernel refuse, and each KV head is read once for its G query heads
        queries = q[group.query_rows].view(s, n, kv, per_kv, d).permute(0, 2, 3, 1, 4).reshape(s, kv, per_kv * n, d)
        keys = flat_k[group.context_slots].to(q.dtype).transpose(1, 2)  # [S, kv, C, d]
        values = flat_v[group.context_slots].to(q.dtype).transpose(1, 2)
        attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=group.mask)
        attended = attended.view(s, kv, per_kv, n, d).permute(0, 3, 1, 2, 4).reshape(s * n, self.heads, d)
        return attended[group.padded_rows]


class MLP(nn.Module):
    def __init__(self, c: ModelConfig, max_loras: int, max_rank: int):
        super().__init__()
        self.gate_proj = LoRALinear(c.hidden_size, c.intermediate_size, False, max_loras, max_rank)
        self.up_proj = LoRALinear(c.hidden_size, c.intermediate_size, False, max_loras, max_rank)
        self.down_proj = LoRALinear(c.intermediate_size, c.hidden_size, False, max_loras, max_rank)

    def forward(self, x, lora_rows) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x, lora_rows)) * self.up_proj(x, lora_rows), lora_rows)


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, max_loras: int, max_rank: int):
        super().__init__()
        self.self_attn = Attention(c, max_loras, max_rank)
        self.mlp = MLP(c, max_loras, max_rank)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin, step, k_cache, v_cache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, step, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x), step.lora_rows)


class Transformer(nn.Module):
    LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

    def __init__(self, c: ModelConfig, max_loras: int = 1, max_lora_rank: int = 16):
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, max_loras, max_lora_rank) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def lora_modules(self, layer: int) -> dict[str, LoRALinear]:
        block = self.layers[layer]
        attn, mlp = block.self_attn, block.mlp
        return {
            "q_proj": attn.q_proj,
            "k_proj": attn.k_proj,
            "v_proj": attn.v_proj,
            "o_proj": attn.o_proj,
            "gate_proj": mlp.gate_proj,
            "up_proj": mlp.up_proj,
            "down_proj": mlp.down_proj,
        }

    @torch.inference_mode()
    def forward(self, step: StepInput, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Logits [len(sample_rows), vocab] for the sequences that sample this step."""
        x = self.embed_tokens(step.input_ids)
        freqs = step.positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype)[:, None, :], emb.sin().to(x.dtype)[:, None, :]
        with sdpa_kernel(SDPA_BACKENDS):
            for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
                x = layer(x, cos, sin, step, k_cache, v_cache)
        x = self.norm(x[step.sample_rows])
        return self.lm_head(x).float()
