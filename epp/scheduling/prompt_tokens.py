"""A prompt's exact token ids, as the model server computes them, with a bounded per-prefix cache.

The tokenizer is `protocol.tokenizer` (the one the model server uses): the sim's built-in tokenizer, or a local
Hugging Face directory (tokenizer.json + tokenizer_config.json with its chat template). A Chat request is rendered
through the chat template (generation prompt on, as the server renders it) and encoded without special tokens; a
Completions request encodes its prompt text, or takes its token ids as they are (the first prompt of a list).

Per-prefix cache: the text is cut into segments at deterministic points (the last `<non-space><space>` at or
before `head_chars` characters, then at or before every `segment_chars` more) and each segment is encoded on its
own, so a prompt that shares a prefix with an earlier one (a tenant's context, a conversation's history) reuses the
earlier segments' tokens and encodes only what is new, and a caller that needs only a prompt's start (the blocks
some server holds) stops reading `pieces` there and encodes no more. The first segment is short (a quarter of the
others): a prompt whose first block no server holds, the usual new one, costs its first ~60 tokens of encoding,
not ~250. This is exact, not an approximation: byte-level BPE tokenizers with GPT-2-style
split regexes (GPT-2, Llama 3, Qwen 2, the built-in one) never merge across such a point (a space after a non-space
character always starts a new pre-token, and no split rule looks behind), so the concatenated segments are the
whole text's tokens. Tokenizers where that does not hold (a normalizer, a prefix space, Metaspace/SentencePiece,
added tokens that strip whitespace) are encoded whole every time (`resumable` is False). Segments are keyed by a
hash of their text alone (a segment's tokens do not depend on what surrounds it) and kept in an LRU bounded by
`cache_tokens` tokens in total.

Cost (`epp-bench tokenize`): see epp/bench/tokenize.py. Encoding releases the GIL (the batch API), so a caller may
run long prompts in a worker thread while the event loop serves others.
"""

from __future__ import annotations

import json
import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import xxhash

from protocol.openai import OpenAIError, chat_messages
from protocol.tokenizer import Tokenizer, load_tokenizer

DEFAULT_SEGMENT_CHARS = 1024
DEFAULT_HEAD_CHARS = 256  # the first segment: ~60 tokens, a few blocks of 16
DEFAULT_CACHE_TOKENS = 2_000_000
# Token ids are kept as unsigned 32-bit ints (vocabularies are ~10^5); a prompt of ids beyond names no real token and
# matches nothing.
MAX_TOKEN_ID = 1 << 32


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
        head_chars: int = DEFAULT_HEAD_CHARS,
    ):
        self.tokenizer = tokenizer
        self.segment_chars = segment_chars
        self.head_chars = min(head_chars, segment_chars)
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
        if isinstance(prompt, list) and prompt and all(type(t) is int and 0 <= t < MAX_TOKEN_ID for t in prompt):
            return prompt
        return None

    def segments(self, text: str) -> list[str]:
        """The text cut before `<non-space><space>` at or before `head_chars` characters, then at or before every
        `segment_chars` more (the last piece is the tail, which is not cached)."""
        pieces, start, size, length = [], 0, self.segment_chars, len(text)
        mark = self.head_chars
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
        """Characters of `text` that `pieces` would tokenize anew (what the cache does not hold)."""
        if not self.resumable or len(text) <= self.head_chars:
            return len(text)
        pieces = self.segments(text)
        cache = self._segments
        return len(pieces[-1]) + sum(len(piece) for piece in pieces[:-1] if _key(piece) not in cache)

    def pieces(self, prompt: str | list[int]) -> Iterator[tuple[int, Sequence[int]]]:
        """The prompt's token ids in order, a segment at a time, as (the segment's characters, its token ids); token
        ids come as one piece. A segment is encoded only when the caller asks for it (cached ones come from the
        cache), so a caller that needs only the start of a prompt does not pay for the rest; the pieces' ids
        concatenated are the whole prompt's tokens."""
        if isinstance(prompt, list):
            yield len(prompt), prompt
            return
        if not self.resumable or len(prompt) <= self.head_chars:
            yield len(prompt), self.tokenizer.encode(prompt)
            return
        *cacheable, tail = self.segments(prompt)
        ahead: dict[int, array] = {}  # segments encoded before the caller asked for them
        batch = 1
        for i, piece in enumerate(cacheable):
            tokens = ahead.pop(i, None)
            if tokens is None:
                key = _key(piece)
                with self._lock:
                    tokens = self._segments.get(key)
                    if tokens is not None:
                        self._segments.move_to_end(key)
                        self.hits += 1
            if tokens is None:
                # This segment and the next ones in one call, twice as many each time: a caller that reads on
                # gets the tokenizer's parallel batches (a cold 64k-token prompt read whole: 54 ms against 92 ms
                # one segment per call, epp-bench tokenize), one that stops has had at most as many again encoded.
                span = cacheable[i : i + batch]
                encoded = [array("I", ids) for ids in self.tokenizer.encode_batch(span)]
                batch *= 2
                tokens = encoded[0]
                ahead.update(enumerate(encoded[1:], i + 1))
                with self._lock:
                    self.misses += len(span)
                    for text, ids in zip(span, encoded, strict=True):
                        key = _key(text)
                        if key not in self._segments:
                            self._segments[key] = ids
                            self._cached_tokens += len(ids)
                    while self._cached_tokens > self.cache_tokens and self._segments:
                        self._cached_tokens -= len(self._segments.popitem(last=False)[1])
            yield len(piece), tokens
        yield len(tail), self.tokenizer.encode(tail)


def _key(segment: str) -> int:
    """A segment's cache key: a hash of its text alone (its tokens do not depend on what surrounds it)."""
    return xxhash.xxh3_64_intdigest(segment.encode("utf-8", "surrogatepass"))
