"""The byte budgets that bound what the EPP buffers for its peers (request bodies, partial gRPC messages, answers a
peer has not read). A module of its own, not the package's __init__, so that the release build compiles it with the
request path (setup.py leaves package __init__ files as Python): every request reserves and releases its body's
bytes."""

from __future__ import annotations


class ByteBudget:
    """Bytes that everyone sharing it may hold at once; one EPP-wide budget each for the request bodies its streams
    buffer and the incomplete gRPC messages its connections reassemble, so that more connections (any number may
    connect) do not mean more memory. Whoever would go over it is refused, and the others go on."""

    __slots__ = ("held", "limit")

    def __init__(self, limit: int):
        self.limit = limit
        self.held = 0

    def reserve(self, size: int) -> bool:
        if self.held + size > self.limit:
            return False
        self.held += size
        return True

    def release(self, size: int) -> None:
        self.held -= size
