"""SCRATCH (branch oracle, never merged): replicas on one host share their in-flight counts through a shared memory
file, written at every change and read before every pick, so a peer's pick is seen at once (the floor of sharing)."""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import time

SLOTS, ENDPOINTS = 16, 64
_HEAD = struct.Struct("=dQ")  # written at (time.time()), instance
_LOAD = struct.Struct("=ii")
SLOT_BYTES = _HEAD.size + ENDPOINTS * _LOAD.size


class Oracle:
    def __init__(self, path: str, instance: int):
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        if os.fstat(self.fd).st_size < SLOTS * SLOT_BYTES:
            os.ftruncate(self.fd, SLOTS * SLOT_BYTES)
        self.mm = mmap.mmap(self.fd, SLOTS * SLOT_BYTES)
        now = time.time()
        self.slot = next(s for s in range(SLOTS) if now - _HEAD.unpack_from(self.mm, s * SLOT_BYTES)[0] > 5.0)
        self.mm[self.slot * SLOT_BYTES : (self.slot + 1) * SLOT_BYTES] = bytes(SLOT_BYTES)
        _HEAD.pack_into(self.mm, self.slot * SLOT_BYTES, now, instance)
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        self.instance = instance
        self.index: dict[str, int] = {}

    def _indices(self, endpoints) -> dict[str, int]:
        if len(self.index) != len(endpoints):
            self.index = {h: i for i, h in enumerate(sorted(e.hostport for e in endpoints))}
        return self.index

    def lock(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def unlock(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def write(self, endpoints, picked=None, tokens_picked=0) -> None:
        index, base = self._indices(endpoints), self.slot * SLOT_BYTES
        for e in endpoints:
            requests = e.in_flight_requests - e.peer_in_flight_requests
            tokens = e.in_flight_tokens - e.peer_in_flight_tokens
            if e is picked:
                requests += 1
                tokens += tokens_picked
            _LOAD.pack_into(self.mm, base + _HEAD.size + index[e.hostport] * _LOAD.size, max(requests, 0), max(tokens, 0))
        _HEAD.pack_into(self.mm, base, time.time(), self.instance)

    def read(self, endpoints) -> None:
        """Set each endpoint's peer share to the sum over the other live slots."""
        index, now, mm = self._indices(endpoints), time.time(), self.mm
        live = [s * SLOT_BYTES for s in range(SLOTS) if s != self.slot and now - _HEAD.unpack_from(mm, s * SLOT_BYTES)[0] <= 2.0]
        for e in endpoints:
            offset = _HEAD.size + index[e.hostport] * _LOAD.size
            requests = tokens = 0
            for base in live:
                r, t = _LOAD.unpack_from(mm, base + offset)
                requests += r
                tokens += t
            e.in_flight_requests += requests - e.peer_in_flight_requests
            e.peer_in_flight_requests = requests
            e.in_flight_tokens += tokens - e.peer_in_flight_tokens
            e.peer_in_flight_tokens = tokens
