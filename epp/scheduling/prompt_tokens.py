"""A prompt's exact token ids, as the model server computes them, with a bounded per-prefix cache.

The tokenizer is `protocol.tokenizer` (the one the model server uses): the sim's built-in tokenizer, or a local
Hugging Face directory (tokenizer.json + tokenizer_config.json with its chat template). A Chat request is rendered
through the chat template (generation prompt on, as the server renders it) and encoded without special tokens; a
Completions request encodes its prompt text, or takes its token ids as they are (the first prompt of a list).

Per-prefix cache: the text is cut into segments at deterministic points (the last `<non-space><space>` at or
before every `segment_chars` characters) and each segment is encoded on its own, so a prompt that shares a prefix
with an earlier one (a tenant's context, a conversation's history) reuses the earlier segments' tokens and encodes
only what is new. This is exact, not an approximation: byte-level BPE tokenizers with GPT-2-style split regexes
(GPT-2, Llama 3, Qwen 2, the built-in one) never merge across such a point (a space after a non-space character
always starts a new pre-token, and no split rule looks behind), so the concatenated segments are the whole text's
tokens. Tokenizers where that does not hold (a normalizer, a prefix space, Metaspace/SentencePiece, added tokens that
strip whitespace) are encoded whole every time (`resumable` is False). Segments are keyed by a hash chain over their
text alone (a segment's tokens do not depend on what surrounds it) and kept in an LRU bounded by `cache_tokens`
tokens in total.

Cost (`epp-bench tokenize`): see epp/bench/tokenize.py. Encoding releases the GIL (the batch API), so a caller may
run long prompts in a worker thread while the event loop serves others.
"""

from __future__ import annotations

import json
import threading
from array import array
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import xxhash

from protocol.openai import OpenAIError, chat_messages
from protocol.tokenizer import Tokenizer, load_tokenizer

DEFAULT_SEGMENT_CHARS = 1024
DEFAULT_CACHE_TOKENS = 2_000_000


def resumable(tokenizer: Tokenizer) -> bool:
    """True when encoding a text in segments cut before `<non-space><space>` gives the whole text's tokens."""
    spec = json.loads(tokenizer.backend.to_str())
    if spec.get("normalizer") is not None:
        return False
    for added in spec.get("added_tokens") or ():
        if added.get("lstrip") or added.get("rstrip") or any(c.isspace() for c in added.get("content", "")):
            return False
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel":
        return not pre.get("add_prefix_space") and pre.get("use_regex", True)
    if pre.get("type") == "Sequence":
        steps = pre.get("pretokenizers") or []
        kinds = [s.get("type") for s in steps]
        return (
            bool(kinds)
            and kinds[-1] == "ByteLevel"
            and not steps[-1].get("add_prefix_space")
            and not steps[-1].get("use_regex", True)
            and all(k in ("Split", "Digits") for k in kinds[:-1])
        )
    return False


class PromptTokenizer:
    """Token ids of a request body (Chat or Completions) through a bounded per-prefix cache; thread-safe (the
    encoding itself runs outside the lock)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        segment_chars: int = DEFAULT_SEGMENT_CHARS,
        cache_tokens: int = DEFAULT_CACHE_TOKENS,
    ):
        self.tokenizer = tokenizer
        self.segment_chars = segment_chars
        self.cache_tokens = cache_tokens
        self.resumable = resumable(tokenizer)
        self._segments: OrderedDict[int, array] = OrderedDict()  # chain key -> the segment's token ids
        self._cached_tokens = 0
        self._lock = threading.Lock()
        self.hits = 0  # segments found in the cache
        self.misses = 0  # segments encoded

    @classmethod
    def from_directory(cls, directory: str | None, **kwargs: Any) -> PromptTokenizer:
        """The tokenizer of a local model directory (None: the sim's built-in one)."""
        return cls(load_tokenizer(directory), **kwargs)

    @property
    def cached_tokens(self) -> int:
        return self._cached_tokens

    def prompt(self, payload: Mapping[str, Any]) -> str | list[int] | None:
        """What the server tokenizes: the rendered chat text, the prompt text, or the prompt's token ids; None when
        the body has neither a usable `messages` nor `prompt` (the server answers it 400; nothing to match)."""
        if "messages" in payload:
            try:
                return self.tokenizer.apply_chat_template(chat_messages(payload))
            except OpenAIError:
                return None
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and prompt:
            prompt = prompt[0] if isinstance(prompt[0], str | list) else prompt
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and prompt and all(type(t) is int and t >= 0 for t in prompt):
            return prompt
        return None

    def token_ids(self, payload: Mapping[str, Any]) -> list[int] | None:
        prompt = self.prompt(payload)
        if prompt is None or isinstance(prompt, list):
            return prompt
        return self.encode(prompt)

    def segments(self, text: str) -> list[str]:
        """The text cut before `<non-space><space>` at or before every `segment_chars` characters (the last piece
        is the tail, which is not cached)."""
        pieces, start, size, length = [], 0, self.segment_chars, len(text)
        mark = size
        while mark < length:
            cut = text.rfind(" ", start + 1, mark + 1)
            while cut > start and text[cut - 1].isspace():
                cut = text.rfind(" ", start + 1, cut)
            if cut > start:
                pieces.append(text[start:cut])
                start = cut
                mark = max(mark, start) + size
            else:
                mark += size
        pieces.append(text[start:])
        return pieces

    def uncached_chars(self, text: str) -> int:
        """Characters of `text` that `encode` would tokenize anew (what the cache does not hold)."""
        if not self.resumable or len(text) <= self.segment_chars:
            return len(text)
        pieces = self.segments(text)
        cache = self._segments
        return len(pieces[-1]) + sum(
            len(piece)
            for piece in pieces[:-1]
            if xxhash.xxh3_64_intdigest(piece.encode("utf-8", "surrogatepass")) not in cache
        )

    def encode(self, text: str) -> list[int]:
        if not self.resumable or len(text) <= self.segment_chars:
            return self.tokenizer.encode_releasing_gil(text)
        pieces = self.segments(text)
        keys = [xxhash.xxh3_64_intdigest(piece.encode("utf-8", "surrogatepass")) for piece in pieces[:-1]]
        found: list[array | None] = []
        with self._lock:
            cache = self._segments
            for k in keys:
                tokens = cache.get(k)
                if tokens is not None:
                    cache.move_to_end(k)
                found.append(tokens)
        missing = [i for i, tokens in enumerate(found) if tokens is None]
        encoded = self.tokenizer.encode_batch([pieces[i] for i in missing] + [pieces[-1]])
        for i, ids in zip(missing, encoded, strict=False):
            found[i] = array("I", ids)
        self.hits += len(keys) - len(missing)
        self.misses += len(missing)
        if missing:
            with self._lock:
                for i in missing:
                    if keys[i] not in self._segments:
                        self._segments[keys[i]] = found[i]
                        self._cached_tokens += len(found[i])
                while self._cached_tokens > self.cache_tokens and self._segments:
                    self._cached_tokens -= len(self._segments.popitem(last=False)[1])
        out: list[int] = []
        for tokens in found:
            out.extend(tokens)
        out.extend(encoded[-1])
        return out
