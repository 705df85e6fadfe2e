"""ZMQ publisher of the block manager's KV events, as vLLM's ZmqEventPublisher (wire format: protocol/kv_events.py).

The engine hands one KVEventBatch per step to `publish` (never blocks: a full queue drops the batch and counts it,
so a stuck subscriber cannot stall the engine); a daemon thread encodes, numbers and sends it, keeps the last
`buffer_steps` payloads for the replay ROUTER socket, and answers replay requests between sends. Framing, numbering
and the bind-or-connect rule follow vLLM v0.11.2's vllm/distributed/kv_events.py.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import msgspec
import zmq

from protocol.kv_events import END_SEQ, KVEventBatch, KVEventsConfig

log = logging.getLogger(__name__)


def should_bind(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard, IPv6-any, ipc or inproc endpoint; connect to anything else."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """vLLM's ZmqEventPublisher. Bounded everywhere: `publish` never blocks (a full queue of `max_queue_size` drops
    the batch and counts it; subscribers see the gap and ask for a replay), the PUB socket drops what a slow or absent
    subscriber has not taken beyond `hwm` messages, and the replay buffer keeps the last `buffer_steps` payloads (with a
    replay socket; without one, none)."""

    def __init__(self, config: KVEventsConfig, topic: str, context: zmq.Context | None = None):
        self._ctx = context or zmq.Context.instance()
        self._queue: queue.Queue[KVEventBatch] = queue.Queue(maxsize=config.max_queue_size)
        # kept only for a replay socket to serve: a step's batch of a long prompt is kilobytes, and 10,000 of them
        # (vLLM's buffer_steps) held 36-62 MB of a sim server under load with nothing to read them
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps if config.replay_endpoint else 0)
        self._topic = topic.encode()
        self._stopping = threading.Event()
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
            self._replay.set_hwm(config.hwm)  # a replay streams up to buffer_steps frames to one client
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
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = 0  # as vLLM's publisher stamps its data-parallel rank (one server: 0)
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped_batches += 1  # subscribers see the gap in sequence numbers and resync

    def close(self) -> None:
        """Send what is queued (for up to a second), then close the sockets."""
        self._stopping.set()
        self._thread.join(timeout=2.0)
        if self._thread.is_alive():  # sockets are not thread-safe: leave them to the (daemon) thread
            log.warning("the KV event publisher thread did not stop; its sockets stay open")
            return
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        encode = msgspec.msgpack.Encoder().encode
        drain_deadline = None
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            if self._stopping.is_set():
                drain_deadline = drain_deadline or time.monotonic() + 1.0
                if self._queue.empty() or time.monotonic() > drain_deadline:
                    return
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            try:
                payload = encode(batch)
                seq = self.next_seq
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                self.next_seq = seq + 1
            except Exception:  # a send failure must not kill the thread: the gap tells subscribers to resync
                log.exception("publishing a KV event batch failed")

    def _serve_replay(self) -> None:
        """vLLM's replay protocol: a request `[identity, b"", start_seq]` (8 bytes big-endian) is answered with
        `[identity, b"", seq, payload]` for every buffered batch from start_seq on, then `[identity, b"", -1, b""]`.
        Anything else is logged and ignored; the thread goes on."""
        try:
            frames = self._replay.recv_multipart()
            if len(frames) != 3:
                log.warning("ignoring a malformed KV event replay request (%d frames)", len(frames))
                return
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")  # vLLM reads any length the same way
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", END_SEQ, b""))
        except Exception:
            log.exception("answering a KV event replay request failed")
