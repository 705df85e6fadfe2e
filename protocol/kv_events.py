"""KV cache events: vLLM's wire format, shared by the model server (publisher) and the EPP (subscriber).

Targets vLLM v0.11.0 (`vllm/distributed/kv_events.py`): ZMQ PUB multipart frames `[topic, seq, payload]`, seq an
8-byte big-endian counter from 0, payload a msgpack `KVEventBatch`; structs are array-like and tagged, so an event is
`["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]` and a batch is
`[ts, events, data_parallel_rank]`. The replay ROUTER answers a request `[b"", start_seq]` with `[b"", seq, payload]`
for every buffered batch from start_seq on, then `[b"", -1 (signed), b""]`.

Block hashes are the engine's own (ints): see modelserver/engine/block_manager.py for how they are computed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgspec

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIUM_GPU = "GPU"
DEFAULT_SUBSCRIBER_PORT = 5557  # the EPP's bound SUB socket (llm-d's default)


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
