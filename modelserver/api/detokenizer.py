"""Output text grown token by token, with stop strings, in time proportional to the new tokens.

Decoding the whole output at every step costs O(length) per token (O(length²) per request). As vLLM's incremental
detokenizer does, each step decodes only a short window: the tokens from `prefix_offset` (a few tokens of context,
so tokenizers that drop or merge a leading space decode the boundary as in the full text) up to the end, and the new
text is what that window adds beyond its first part (`prefix_offset:read_offset`). A window whose text ends in an
incomplete UTF-8 sequence (U+FFFD) is held back until the next token completes it.

Stop strings are searched only in the new text plus the longest stop string's length - 1 of the text before it, so
a match that straddles two steps is still found; the text is cut before the earliest match, and `stop_reason` is the
matched string (the `stop_reason` vLLM reports).
"""

from __future__ import annotations

from collections.abc import Callable

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    __slots__ = ("decode", "max_stop", "prefix_offset", "read_offset", "stop", "stop_reason", "text", "token_ids")

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str], token_ids: list[int] | None = None):
        self.decode = decode
        self.stop = stop
        self.max_stop = max((len(s) for s in stop), default=0)
        self.token_ids = token_ids if token_ids is not None else []
        self.prefix_offset = self.read_offset = 0
        self.text = ""
        self.stop_reason: str | None = None

    def append(self, new_token_ids: list[int], final: bool = False) -> bool:
        """Add the step's tokens; True when a stop string matched (the text then ends before it). `final` also
        emits a trailing incomplete UTF-8 sequence, as a full decode would."""
        ids = self.token_ids
        ids += new_token_ids
        prefix_text = self.decode(ids[self.prefix_offset : self.read_offset])
        window_text = self.decode(ids[self.prefix_offset :])
        if len(window_text) <= len(prefix_text) or (window_text.endswith(REPLACEMENT_CHAR) and not final):
            return False
        delta = window_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        search_from = max(0, len(self.text) - self.max_stop + 1)
        self.text += delta
        if not self.stop:
            return False
        text = self.text
        earliest, matched = -1, None
        for stop in self.stop:
            at = text.find(stop, search_from)
            if at >= 0 and (earliest < 0 or at < earliest):
                earliest, matched = at, stop
        if matched is None:
            return False
        self.text = text[:earliest]
        self.stop_reason = matched
        return True
