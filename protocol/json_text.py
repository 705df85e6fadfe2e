"""`json.dumps` of the objects a chat template serialises (Jinja's `tojson`), through a bounded cache.

Agents send the same tool definitions with every request: ~12 tools of ~900 characters each, whose `tojson` (the
json module with sorted keys, then Jinja's HTML escapes) cost ~17 us each, ~0.2 ms a prompt, paid once by the
approximate transcript and once by each chat-template rendering. A tool's msgpack encoding (~0.7 us with its
digest) keys its text instead. msgpack tells apart what the json module writes differently (an int and a float,
NaN and null, True and 1), so two values with one key have one text; insertion order is part of the key, so the same
keys in another order are another entry with the same (sorted) text. Values that msgpack refuses (an int over 64
bits, an object of another type) and scalars are serialised every time.

Bounded: at most MAX_ENTRIES texts and MAX_CHARS characters in all; past either the cache is emptied whole (a
dict's get and set are atomic, so threads may share it) and refills with what is in use.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import xxhash

MAX_ENTRIES = 4096
MAX_CHARS = 8 << 20
# a value whose key is longer is serialised every time: it is no agent's tool, and the key would cost its size again
MAX_KEY_BYTES = 1 << 20

_encode = msgspec.msgpack.Encoder().encode
_texts: dict[tuple[bytes, tuple], str] = {}
_chars = 0


def dumps(value: Any, **kwargs: Any) -> str:
    """`json.dumps(value, **kwargs)`, from the cache when `value` (a dict or list) was serialised so before."""
    global _chars
    if type(value) is not dict and type(value) is not list:
        return json.dumps(value, **kwargs)
    try:
        encoded = _encode(value)
    except (TypeError, OverflowError, ValueError):
        return json.dumps(value, **kwargs)
    if len(encoded) > MAX_KEY_BYTES:
        return json.dumps(value, **kwargs)
    key = (xxhash.xxh3_128_digest(encoded), tuple(kwargs.items()))
    text = _texts.get(key)
    if text is None:
        text = json.dumps(value, **kwargs)
        if len(_texts) >= MAX_ENTRIES or _chars + len(text) > MAX_CHARS:
            _texts.clear()
            _chars = 0
        _texts[key] = text
        _chars += len(text)
    return text


def tojson(value: Any) -> str:
    """Jinja's `tojson` filter's text: sorted keys, and <, >, & and ' escaped for HTML."""
    text = dumps(value, sort_keys=True)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026").replace("'", "\\u0027")
