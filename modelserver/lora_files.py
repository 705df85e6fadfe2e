"""Where LoRA adapters may be loaded from: only inside the `--lora-root` directories (symlinks resolved first,
so neither `..` nor a link can escape)."""

from __future__ import annotations

from pathlib import Path

from protocol.openai import OpenAIError


def resolve_adapter_path(path: str, roots: list[str]) -> Path:
    if not isinstance(path, str) or not path:
        raise OpenAIError("`lora_path` must be a non-empty string", param="lora_path")
    if not roots:
        raise OpenAIError("runtime LoRA loading needs --lora-root: no directory is allowed", param="lora_path")
    if "\0" in path:
        raise OpenAIError("`lora_path` must not contain NUL bytes", param="lora_path")
    shown = path if len(path) <= 200 else path[:200] + "..."
    try:
        resolved = Path(path).resolve()
        for root in roots:
            if resolved.is_relative_to(Path(root).resolve()):
                break
        else:
            raise OpenAIError(
                f"`lora_path` {shown!r} is outside the allowed --lora-root directories", param="lora_path"
            )
        exists = resolved.exists()
    except OSError as exc:  # e.g. a component longer than the filesystem allows
        raise OpenAIError(f"`lora_path` {shown!r} is not a usable path: {exc.strerror}", param="lora_path") from None
    if not exists:
        raise OpenAIError(f"LoRA adapter path {shown!r} does not exist", 404, param="lora_path")
    return resolved
