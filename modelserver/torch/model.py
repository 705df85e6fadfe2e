"""A decoder-only transformer (Llama / Qwen2 family) that reads and writes K/V in the engine's paged KV cache.

One step runs the new tokens of every scheduled sequence, flattened: prefill chunks and decodes together. New K/V
are written at each token's slot (block_table[pos // block_size] * block_size + pos % block_size); each sequence
then attends over its gathered blocks with scaled_dot_product_attention and a causal mask offset by the tokens
already cached, so a prefix-cache hit skips those tokens' compute entirely. Projections carry stacked LoRA slots
applied per token (shrink to rank r, then expand), so requests of different adapters share one pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


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
class StepInput:
    """One step's flattened tokens and, per sequence, what to attend over."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] flat cache slots to write
    lora_slots: torch.Tensor  # [T] LoRA slot per token (0 = none)
    seq_slices: list[tuple[int, int]]  # per sequence: [begin, end) in the flat tokens
    seq_context_slots: list[torch.Tensor]  # per sequence: flat cache slots of positions [0, context_len)
    seq_starts: list[int]  # per sequence: position of its first new token
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

    def forward(self, x: torch.Tensor, slots: torch.Tensor, active: list[int]) -> torch.Tensor:
        y = self.base(x)
        for slot in active:  # shrink then expand, one group of tokens per adapter slot
            rows = (slots == slot).nonzero(as_tuple=True)[0]
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

    def forward(self, x, cos, sin, step: StepInput, active, k_cache, v_cache) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x, step.lora_slots, active).view(t, self.heads, self.head_dim)
        k = self.k_proj(x, step.lora_slots, active).view(t, self.kv_heads, self.head_dim)
        v = self.v_proj(x, step.lora_slots, active).view(t, self.kv_heads, self.head_dim)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        flat_k = k_cache.view(-1, self.kv_heads, self.head_dim)
        flat_v = v_cache.view(-1, self.kv_heads, self.head_dim)
        flat_k[step.slot_mapping] = k.to(flat_k.dtype)
        flat_v[step.slot_mapping] = v.to(flat_v.dtype)
        out = torch.empty_like(q)
        for (begin, end), context, start in zip(step.seq_slices, step.seq_context_slots, step.seq_starts, strict=True):
            keys = flat_k[context].to(q.dtype).transpose(0, 1)  # [kv_heads, ctx, d]
            values = flat_v[context].to(q.dtype).transpose(0, 1)
            queries = q[begin:end].transpose(0, 1)  # [heads, n, d]
            n, ctx = end - begin, context.shape[0]
            # query i sits at position start + i and sees keys 0 .. start + i
            mask = torch.arange(ctx, device=x.device)[None, :] <= (start + torch.arange(n, device=x.device))[:, None]
            attended = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=mask, enable_gqa=self.heads != self.kv_heads
            )
            out[begin:end] = attended.transpose(0, 1)
        return self.o_proj(out.reshape(t, -1), step.lora_slots, active)


class MLP(nn.Module):
    def __init__(self, c: ModelConfig, max_loras: int, max_rank: int):
        super().__init__()
        self.gate_proj = LoRALinear(c.hidden_size, c.intermediate_size, False, max_loras, max_rank)
        self.up_proj = LoRALinear(c.hidden_size, c.intermediate_size, False, max_loras, max_rank)
        self.down_proj = LoRALinear(c.intermediate_size, c.hidden_size, False, max_loras, max_rank)

    def forward(self, x, slots, active) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x, slots, active)) * self.up_proj(x, slots, active), slots, active)


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, max_loras: int, max_rank: int):
        super().__init__()
        self.self_attn = Attention(c, max_loras, max_rank)
        self.mlp = MLP(c, max_loras, max_rank)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin, step, active, k_cache, v_cache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, step, active, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x), step.lora_slots, active)


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
        active = [s for s in step.lora_slots.unique().tolist() if s != 0]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, step, active, k_cache, v_cache)
        x = self.norm(x[step.sample_rows])
        return self.lm_head(x).float()
