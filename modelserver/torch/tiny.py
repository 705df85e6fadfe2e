"""`modelserver make-tiny-model DIR`: a small random Llama-style model in Hugging Face format (config.json,
model.safetensors, tokenizer.json with a chat template), and optionally PEFT LoRA adapters under DIR/loras/NAME.
Deterministic for a given --seed; used by the tests and `epp-local --backend torch`."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from protocol.cli import command_parser
from protocol.tokenizer import EOS_TOKEN, build_default_tokenizer, save_tokenizer

PROJECTIONS = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


def make_tiny_model(
    directory: str | Path,
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    seed: int = 0,
    lora_names: tuple[str, ...] | list[str] = (),
    lora_rank: int = 8,
) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_default_tokenizer()
    vocab = tokenizer.get_vocab_size()
    head_dim = hidden // heads
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": tokenizer.token_to_id(EOS_TOKEN),
    }
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, std: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    shapes = {
        "q_proj": (heads * head_dim, hidden),
        "k_proj": (kv_heads * head_dim, hidden),
        "v_proj": (kv_heads * head_dim, hidden),
        "o_proj": (hidden, heads * head_dim),
        "gate_proj": (intermediate, hidden),
        "up_proj": (intermediate, hidden),
        "down_proj": (hidden, intermediate),
    }
    weights = {
        "model.embed_tokens.weight": rand(vocab, hidden, std=1.0),
        "model.norm.weight": 1 + rand(hidden, std=0.1),
        "lm_head.weight": rand(vocab, hidden),
    }
    for i in range(layers):
        for name, part in PROJECTIONS.items():
            weights[f"model.layers.{i}.{part}.{name}.weight"] = rand(*shapes[name])
        weights[f"model.layers.{i}.input_layernorm.weight"] = 1 + rand(hidden, std=0.1)
        weights[f"model.layers.{i}.post_attention_layernorm.weight"] = 1 + rand(hidden, std=0.1)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_tokenizer(directory)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": config["eos_token_id"]}))
    for name in lora_names:
        adapter = directory / "loras" / name
        adapter.mkdir(parents=True, exist_ok=True)
        (adapter / "adapter_config.json").write_text(
            json.dumps(
                {
                    "peft_type": "LORA",
                    "r": lora_rank,
                    "lora_alpha": 2 * lora_rank,
                    "target_modules": list(PROJECTIONS),
                    "base_model_name_or_path": str(directory),
                }
            )
        )
        tensors = {}
        for i in range(layers):
            for proj, part in PROJECTIONS.items():
                out_features, in_features = shapes[proj]
                prefix = f"base_model.model.model.layers.{i}.{part}.{proj}"
                tensors[f"{prefix}.lora_A.weight"] = rand(lora_rank, in_features)
                tensors[f"{prefix}.lora_B.weight"] = rand(out_features, lora_rank)
        save_file(tensors, str(adapter / "adapter_model.safetensors"))
    return directory


def main(argv: list[str]) -> None:
    p = command_parser("modelserver make-tiny-model", __doc__)
    p.add_argument("directory", help="where to write the model (created)")
    p.add_argument("--layers", type=int, default=2, help="transformer layers")
    p.add_argument("--hidden", type=int, default=64, help="hidden size")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--lora", action="append", default=[], help="also write a PEFT adapter with this name")
    args = p.parse_args(argv)
    path = make_tiny_model(args.directory, layers=args.layers, hidden=args.hidden, seed=args.seed, lora_names=args.lora)
    print(f"tiny model written to {path}")
