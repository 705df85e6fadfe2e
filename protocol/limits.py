"""What both servers (the EPP, the model server) do so that a peer cannot make them hold more than they chose to: byte
budgets shared by all connections, counted warnings of what a peer can repeat at will, and the process's limits set
at start (open files, large blocks given back to the system). The release build compiles this module with the EPP's
request path (setup.py): every ext_proc stream reserves and releases its body's bytes."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import resource


class ByteBudget:
    """Bytes that everyone sharing it may hold at once: one server-wide budget each for the request bodies being
    received and, in the EPP, the incomplete gRPC messages its connections reassemble, so that more connections do not
    mean more memory. Whoever would go over it is refused, and the others go on."""

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


class RepeatedWarning:
    """An event a peer can repeat at will, worth an operator's attention: counted, and logged at the first and at
    every thousandth (with the count so far, the message's last argument), so that it is seen without flooding the
    log."""

    __slots__ = ("count", "logger", "message")

    def __init__(self, logger: str, message: str) -> None:
        self.count = 0
        self.logger = logging.getLogger(logger)
        self.message = message

    def note(self, *args: object) -> None:
        if self.count % 1000 == 0:
            self.logger.warning(self.message, *args, self.count + 1)
        self.count += 1


def raise_open_files_limit() -> int:
    """The soft limit on open files raised to the hard one, as Go's runtime does for GIE's EPP: the connections a
    server accepts (up to its connection limits) and the ones it opens (the EPP's scrapes and KV-event sockets) must
    not hit a distribution's default soft limit of 1,024. Returns the limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# Allocations of at least this many bytes (request bodies, KV-event batches, long prompts' token lists) are mapped
# from the system apart and unmapped when freed. glibc's default threshold rises to the largest block freed so far (up
# to 32 MiB), after which 1 MiB bodies came from the heap, which fragmentation kept from shrinking: after 400 unfinished
# 1 MiB bodies' connections to the EPP closed, RSS stayed at 158-328 MB for 10 s in 6 of 9 runs, idle being 83
# (tests/integration/test_memory_after_flood.py); with the threshold fixed, 85 MB within 0.2 s in 5 of 5.
MMAP_THRESHOLD_BYTES = 128 << 10
M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def give_large_blocks_back() -> None:
    """Fix glibc's mmap threshold at MMAP_THRESHOLD_BYTES (a fixed value also stops its dynamic rise). Nothing where
    the C library has no mallopt or ignores it (not glibc): memory then comes back as that allocator returns it."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
