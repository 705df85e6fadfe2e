"""ZMQ publisher of the block manager's KV events, as vLLM's ZmqEventPublisher (wire format: protocol/kv_events.py).

The engine hands one KVEventBatch per step to `publish` (never blocks: a full queue drops the batch and counts it,
so a stuck subscriber cannot stall the engine); a daemon thread encodes, numbers and sends it, keeps the last
`buffer_steps` payloads for the replay ROUTER socket, and answers replay requests between sends.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque

import msgspec
import zmq

from protocol.kv_events import END_SEQ, KVEventBatch, KVEventsConfig

log = logging.getLogger(__name__)


def should_bind(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard, IPv6-any, ipc or inproc endpoint; connect to anything else."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, topic: str, context: zmq.Context | None = None):
        self._ctx = context or zmq.Context.instance()
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = topic.encode()
        self.dropped_batches = 0
        self.next_seq = 0
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if should_bind(config.endpoint):
            self._pub.bind(config.endpoint)
        else:
            self._pub.connect(config.endpoint)
        self._replay: zmq.Socket | None = None
        if config.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(config.replay_endpoint)
        self._thread = threading.Thread(target=self._run, daemon=True, name="kv-events-publisher")
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return self._pub.getsockopt_string(zmq.LAST_ENDPOINT)

    @property
    def replay_endpoint(self) -> str | None:
        return None if self._replay is None else self._replay.getsockopt_string(zmq.LAST_ENDPOINT)

    def publish(self, batch: KVEventBatch) -> None:
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped_batches += 1  # subscribers see the gap in sequence numbers and resync

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=2.0)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        encode = msgspec.msgpack.Encoder().encode
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            try:
                payload = encode(batch)
                seq = self.next_seq
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                self.next_seq = seq + 1
            except Exception:  # a send failure must not kill the thread: the gap tells subscribers to resync
                log.exception("publishing a KV event batch failed")

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("ignoring a malformed KV event replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))
