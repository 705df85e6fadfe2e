"""Hugging Face checkpoints from a local directory (config.json + safetensors, sharded or not) and PEFT LoRA adapters
(adapter_config.json + adapter_model.safetensors). safetensors only: no pickles, nothing fetched from a hub."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from modelserver.torch.model import ModelConfig, Transformer

_LAYER_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])\.weight$")


def read_config(model_dir: Path) -> ModelConfig:
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: --model must be a local Hugging Face model directory")
    return ModelConfig.from_hf(json.loads(path.read_text()))


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return [model_dir / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"no model.safetensors (or index) in {model_dir}")


def _our_name(hf_name: str) -> str:
    name = hf_name.removeprefix("model.")
    return re.sub(r"(_proj)\.(weight|bias)$", r"\1.base.\2", name)


def load_model(
    model_dir: str | Path, max_loras: int, max_lora_rank: int, device: torch.device, dtype: torch.dtype
) -> Transformer:
    model_dir = Path(model_dir)
    config = read_config(model_dir)
    with torch.device("meta"):
        model = Transformer(config, max_loras, max_lora_rank)
    model = model.to_empty(device=device)
    state = model.state_dict()
    loaded = set()
    for path in _weight_files(model_dir):
        for hf_name, tensor in load_file(str(path), device="cpu").items():
            name = _our_name(hf_name)
            if name not in state:
                continue  # e.g. rotary caches some checkpoints carry
            state[name].copy_(tensor.to(dtype))
            loaded.add(name)
    if config.tie_word_embeddings or "lm_head.weight" not in loaded:
        model.lm_head.weight = model.embed_tokens.weight
        loaded.add("lm_head.weight")
    expected = {n for n in state if ".lora_" not in n and not n.endswith(".scaling")}
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks {len(missing)} weights, e.g. {missing[:3]}")
    for name, param in model.named_parameters():
        if ".lora_" in name or name.endswith(".scaling"):
            param.data.zero_()
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, config.head_dim, 2, dtype=torch.float32) / config.head_dim))
    model.inv_freq = inv_freq.to(device)
    return model.to(dtype).eval()


def load_lora_into_slot(model: Transformer, slot: int, adapter_dir: str | Path) -> None:
    """Copy a PEFT adapter's A/B matrices into `slot` of every targeted projection (others are zeroed)."""
    adapter_dir = Path(adapter_dir)
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights = load_file(str(adapter_dir / "adapter_model.safetensors"), device="cpu")
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in weights.items():
        match = _LAYER_KEY.search(key)
        if match is None:
            raise ValueError(f"unsupported LoRA weight {key!r} in {adapter_dir}")
        pairs.setdefault((int(match.group(1)), match.group(2)), {})[match.group(3)] = tensor
    for layer in range(model.config.num_hidden_layers):
        for name, module in model.lora_modules(layer).items():
            pair = pairs.get((layer, name), {})
            module.set_slot(slot, pair.get("A"), pair.get("B"), scaling)
