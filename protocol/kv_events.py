"""KV cache events: vLLM's wire format, shared by the model server (publisher) and the EPP (subscriber).

Targets vLLM v0.11.0 (`vllm/distributed/kv_events.py`): ZMQ PUB multipart frames `[topic, seq, payload]`, seq an
8-byte big-endian counter from 0, payload a msgpack `KVEventBatch`; structs are array-like and tagged, so an event is
`["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]` and a batch is
`[ts, events, data_parallel_rank]`. The replay ROUTER answers a request `[b"", start_seq]` with `[b"", seq, payload]`
for every buffered batch from start_seq on, then `[b"", -1 (signed), b""]`.

Block hashes are vLLM v0.11.2's prefix-cache hashes (`vllm/v1/core/kv_cache_utils.py`), computed here once for
both sides (`BlockHasher`, `request_block_hashes`): the model server's block manager keys its prefix cache with them and
the EPP hashes its own tokenization the same way, so a hash in the EPP's index is a block in the server's cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIUM_GPU = "GPU"
DEFAULT_SUBSCRIBER_PORT = 5557  # a server's KV-event publisher (vLLM tcp://*:5557, llm-d's socketPort)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged events (the tag is the class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def default_topic(address: str, model: str) -> str:
    """The topic a server publishes on when its config names none: `kv@<address:port>@<model>`."""
    return f"kv@{address}@{model}"


def parse_topic(topic: str) -> tuple[str, str] | None:
    """(address:port, model) from a default topic, None for any other topic."""
    parts = topic.split("@", 2)
    if len(parts) != 3 or parts[0] != "kv" or not parts[1] or not parts[2]:
        return None
    return parts[1], parts[2]


@dataclass
class KVEventsConfig:
    """vLLM's `--kv-events-config` JSON (the same keys and defaults)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # None: zmq when events are enabled, else null (as vLLM)
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config is not JSON: {exc}") from None
        if not isinstance(values, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = set(cls.__dataclass_fields__)
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"--kv-events-config: unknown keys {sorted(unknown)}")
        config = cls(**values)
        if config.publisher is None:
            config.publisher = "zmq" if config.enable_kv_cache_events else "null"
        if config.publisher not in ("null", "zmq"):
            raise ValueError(f"--kv-events-config: publisher must be 'zmq' or 'null', not {config.publisher!r}")
        if config.buffer_steps < 1 or config.hwm < 0 or config.max_queue_size < 1:
            raise ValueError("--kv-events-config: buffer_steps and max_queue_size must be >= 1, hwm >= 0")
        return config

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


# -- block hashes (vLLM v0.11.2) ----------------------------------------------------------------------------------
#
# Matched against vLLM v0.11.2's source (the wheel's vllm/v1/core/kv_cache_utils.py, vllm/utils/hashing.py,
# vllm/v1/core/block_pool.py, vllm/config/cache.py, vllm/envs.py):
# * a full block's hash is hash_fn((parent digest, tuple(block token ids), extra_keys)), a 32-byte SHA-256 digest;
#   the first block's parent is NONE_HASH.
# * hash_fn is `--prefix-caching-hash-algo`: "sha256" (the default: SHA-256 of pickle.dumps(obj, HIGHEST_PROTOCOL))
#   or "sha256_cbor" (SHA-256 of canonical CBOR, language-neutral).
# * NONE_HASH is hash_fn(PYTHONHASHSEED) when that variable is set (the string itself, hashed like any object), else
#   32 random bytes per process: without a shared PYTHONHASHSEED no router can reproduce a server's hashes.
# * extra_keys is (lora_name,) for a LoRA request (v0.11.1 on; v0.11.0 used the adapter's integer id), else None.
#   Multimodal inputs, cache_salt and prompt embeddings also add extra keys in vLLM; nothing here produces them.
# * a KV event carries the digest's low 64 bits, int.from_bytes(digest, "big") & (2**64 - 1)
#   (`maybe_convert_block_hash`, VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, the default); that int cannot continue a
#   chain, so chaining takes the full digest.

HASH_ALGOS = ("sha256", "sha256_cbor")
DEFAULT_HASH_ALGO = "sha256"
_UNSEEDED_NONE_HASH = os.urandom(32)  # vLLM's NONE_HASH when PYTHONHASHSEED is unset: random, once per process


def _cbor_head(major: int, value: int) -> bytes:
    if value < 24:
        return bytes((major << 5 | value,))
    if value < 0x100:
        return struct.pack(">BB", major << 5 | 24, value)
    if value < 0x10000:
        return struct.pack(">BH", major << 5 | 25, value)
    if value < 0x100000000:
        return struct.pack(">BI", major << 5 | 26, value)
    if value < 0x10000000000000000:
        return struct.pack(">BQ", major << 5 | 27, value)
    raise ValueError(f"integer {value} does not fit a CBOR head (bignums are not used in block hashes)")


def canonical_cbor(obj: Any) -> bytes:
    """Canonical CBOR (RFC 8949 core deterministic encoding) of the values a block hash is made of: None, int, str,
    bytes, and tuples/lists of them; byte-for-byte what `cbor2.dumps(obj, canonical=True)` writes for these types."""
    if obj is None:
        return b"\xf6"
    if type(obj) is int:
        return _cbor_head(0, obj) if obj >= 0 else _cbor_head(1, -1 - obj)
    if isinstance(obj, bytes):
        return _cbor_head(2, len(obj)) + obj
    if isinstance(obj, str):
        data = obj.encode()
        return _cbor_head(3, len(data)) + data
    if isinstance(obj, tuple | list):
        return _cbor_head(4, len(obj)) + b"".join(canonical_cbor(item) for item in obj)
    raise TypeError(f"cannot hash a {type(obj).__name__} in a block key")


def _sha256_pickle(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(canonical_cbor(obj)).digest()


_HASH_FNS = {"sha256": _sha256_pickle, "sha256_cbor": _sha256_cbor}


def external_block_hash(digest: bytes) -> int:
    """The int a vLLM KV event carries for a block digest (its low 64 bits, big-endian)."""
    return int.from_bytes(digest[-8:], "big")


class BlockHasher:
    """vLLM v0.11.2's block hash for one (algorithm, seed): `hash_block` hashes one full block from its parent's
    digest, the unit the model server's block manager calls as blocks fill; `request_block_hashes` chains many."""

    __slots__ = ("_hash_fn", "algo", "none_hash")

    def __init__(self, algo: str = DEFAULT_HASH_ALGO, hash_seed: str | None = None):
        if algo not in _HASH_FNS:
            raise ValueError(f"unknown prefix caching hash algorithm {algo!r}: one of {', '.join(HASH_ALGOS)}")
        self.algo = algo
        self._hash_fn = _HASH_FNS[algo]
        self.none_hash = _UNSEEDED_NONE_HASH if hash_seed is None else self._hash_fn(hash_seed)

    def hash_block(self, parent: bytes | None, token_ids: Sequence[int], extra_keys: tuple | None = None) -> bytes:
        """The digest of one full block: hash_fn((parent or NONE_HASH, tuple(token_ids), extra_keys))."""
        return self._hash_fn((parent or self.none_hash, tuple(token_ids), extra_keys))

    def chain(
        self, token_ids: Sequence[int], block_size: int, extra_keys: tuple | None = None, parent: bytes | None = None
    ) -> list[bytes]:
        """Digests of the full blocks of token_ids, the first chained to `parent` (None: the start of a sequence)."""
        digests = []
        for start in range(0, len(token_ids) - block_size + 1, block_size):
            parent = self.hash_block(parent, token_ids[start : start + block_size], extra_keys)
            digests.append(parent)
        return digests


_hashers: dict[tuple[str, str | None], BlockHasher] = {}


def block_hasher(algo: str = DEFAULT_HASH_ALGO, hash_seed: str | None = None) -> BlockHasher:
    """The shared BlockHasher of (algo, hash_seed) (NONE_HASH is computed once)."""
    hasher = _hashers.get((algo, hash_seed))
    if hasher is None:
        hasher = _hashers[(algo, hash_seed)] = BlockHasher(algo, hash_seed)
    return hasher


def lora_extra_keys(lora_name: str | None) -> tuple | None:
    """vLLM v0.11.2's extra keys for a request's blocks: the adapter's name for a LoRA request, else none."""
    return None if lora_name is None else (lora_name,)


def request_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    hash_seed: str | None = None,
    parent: bytes | None = None,
    algo: str = DEFAULT_HASH_ALGO,
) -> list[int]:
    """Hashes of the FULL blocks of token_ids, chained exactly as vLLM v0.11.2 chains them, as the ints a vLLM KV
    event carries (BlockStored.block_hashes / parent_block_hash).

    token_ids: Python ints (pickle, the default algorithm, serializes their type). lora_name: the adapter the request
    runs with (None: the base model). hash_seed: the server's PYTHONHASHSEED; None reproduces an unseeded vLLM, whose
    NONE_HASH is random per process (so only this process's own server would match). parent: the 32-byte DIGEST of
    the block before token_ids[0] (`BlockHasher.chain` returns digests; an event's 64-bit int cannot continue a
    chain), None when token_ids starts the sequence. algo: the server's `--prefix-caching-hash-algo`.
    """
    digests = block_hasher(algo, hash_seed).chain(token_ids, block_size, lora_extra_keys(lora_name), parent)
    return [external_block_hash(d) for d in digests]
