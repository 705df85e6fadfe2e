"""Precise prefix index from the model servers' own KV events (vLLM's wire format: protocol/kv_events.py).

`KVBlockIndex` maps a block hash to the endpoints that hold it, and keeps each endpoint's hashes in the order they
were stored so a memory cap can drop an endpoint's oldest entries first. `KVEventSubscriber` binds one SUB socket
(default port 5557, as llm-d's EPP) that every server connects or is connected to, and applies each batch to the
index on its own thread. Endpoints are identified by the topic `kv@<address:port>@<model>`.

Gaps: sequence numbers per topic must be consecutive; on a gap (or a server that restarted: its sequence went
back) the endpoint's entries are dropped and the index relearns it from the events that follow: until then a
block it still holds scores as a miss (a lost hit), never a block it evicted as a hit.
Parameters: `max_entries` (hash->endpoint pairs over all endpoints); `dropped_entries` counts what the cap removed.
Trade-off: the replay socket is not used yet (its address is not in the topic), so a gap costs a resync.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict, deque

import msgspec
import zmq

from epp.datalayer.endpoint import Endpoint
from protocol.kv_events import (
    DEFAULT_SUBSCRIBER_PORT,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    parse_topic,
)

log = logging.getLogger(__name__)


class KVBlockIndex:
    def __init__(self, max_entries: int = 4_000_000):
        self.max_entries = max_entries
        self._holders: dict[int, set[str]] = {}
        self._by_endpoint: dict[str, OrderedDict[int, None]] = {}
        self._size = 0
        self.dropped_entries = 0
        self._lock = threading.Lock()

    @property
    def size(self) -> int:
        return self._size

    def store(self, endpoint: str, block_hashes: list[int]) -> None:
        with self._lock:
            owned = self._by_endpoint.setdefault(endpoint, OrderedDict())
            for block_hash in block_hashes:
                if block_hash in owned:
                    owned.move_to_end(block_hash)
                    continue
                owned[block_hash] = None
                self._holders.setdefault(block_hash, set()).add(endpoint)
                self._size += 1
            while self._size > self.max_entries:
                largest = max(self._by_endpoint, key=lambda e: len(self._by_endpoint[e]))
                oldest, _ = self._by_endpoint[largest].popitem(last=False)
                self._unlink(oldest, largest)
                self.dropped_entries += 1

    def remove(self, endpoint: str, block_hashes: list[int]) -> None:
        with self._lock:
            owned = self._by_endpoint.get(endpoint)
            if owned is None:
                return
            for block_hash in block_hashes:
                if block_hash in owned:
                    del owned[block_hash]
                    self._unlink(block_hash, endpoint)

    def clear(self, endpoint: str) -> None:
        with self._lock:
            for block_hash in self._by_endpoint.pop(endpoint, ()):
                self._unlink(block_hash, endpoint)

    def _unlink(self, block_hash: int, endpoint: str) -> None:
        holders = self._holders[block_hash]
        holders.discard(endpoint)
        if not holders:
            del self._holders[block_hash]
        self._size -= 1

    def prefix_blocks(self, block_hashes: list[int], endpoints: list[str]) -> dict[str, int]:
        """For each endpoint, how many of the prompt's leading blocks it holds."""
        matched = dict.fromkeys(endpoints, 0)
        alive = set(endpoints)
        holders = self._holders
        for depth, block_hash in enumerate(block_hashes):
            alive &= holders.get(block_hash, set())
            if not alive:
                break
            for endpoint in alive:
                matched[endpoint] = depth + 1
        return matched


class KVEventSubscriber:
    """An endpoint source (`epp.datalayer.source`) pushed to by the model servers: one SUB socket bound for all of
    them (each publishes on its own `kv@<address:port>@<model>` topic); a receiver thread applies each batch to
    the index. An endpoint that leaves the pool loses its entries."""

    name = "kv-events"

    def __init__(self, index: KVBlockIndex, endpoint: str = f"tcp://*:{DEFAULT_SUBSCRIBER_PORT}"):
        self.index = index
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.bind(endpoint)
        self._next_seq: dict[str, int] = {}
        self._forget: deque[str] = deque()  # endpoints that left the pool (appended on the loop, read by the thread)
        self.gaps = 0
        self.bad_messages = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="kv-events-subscriber")
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return self._sub.getsockopt_string(zmq.LAST_ENDPOINT)

    def start(self, endpoint: Endpoint) -> None:
        pass  # its events identify it by topic; nothing to open per endpoint

    def stop(self, endpoint: Endpoint) -> None:
        self._forget.append(endpoint.hostport)  # the receiver thread owns the index: it clears it there

    def wake(self) -> None:
        pass

    async def close(self) -> None:
        await asyncio.to_thread(self.shutdown)

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._sub.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        decode = msgspec.msgpack.Decoder(KVEventBatch).decode
        while not self._stop.is_set():
            while self._forget:
                endpoint = self._forget.popleft()
                self.index.clear(endpoint)
                self._next_seq.pop(endpoint, None)
            if not self._sub.poll(100):
                continue
            frames = self._sub.recv_multipart()
            try:
                topic_bytes, seq_bytes, payload = frames
                parsed = parse_topic(topic_bytes.decode())
                if parsed is None or len(seq_bytes) != 8:
                    raise ValueError("not a kv@<address:port>@<model> topic with an 8-byte sequence number")
                batch = decode(payload)
            except (ValueError, UnicodeDecodeError, msgspec.DecodeError) as exc:
                self.bad_messages += 1  # one bad publisher must not stop the others' events
                log.debug("ignoring a malformed KV event message: %s", exc)
                continue
            self._apply(parsed[0], int.from_bytes(seq_bytes, "big"), batch)

    def _apply(self, endpoint: str, seq: int, batch: KVEventBatch) -> None:
        expected = self._next_seq.get(endpoint)
        if expected is not None and seq != expected:
            self.gaps += 1  # missed batches or a restarted server: what we know of it may be stale
            self.index.clear(endpoint)
        self._next_seq[endpoint] = seq + 1
        for event in batch.events:
            if type(event) is BlockStored:
                self.index.store(endpoint, event.block_hashes)
            elif type(event) is BlockRemoved:
                self.index.remove(endpoint, event.block_hashes)
            elif type(event) is AllBlocksCleared:
                self.index.clear(endpoint)
