"""Precise prefix index from the model servers' own KV events (vLLM's wire format: protocol/kv_events.py).

`KVBlockIndex` maps a block hash to the endpoints that hold it, and keeps each endpoint's hashes in the order they
were stored so a memory cap can drop an endpoint's oldest entries first. `KVEventSubscriber` opens one SUB socket per
endpoint of the pool, connected to that endpoint's own publisher (`epp --kv-events-port`, default 5557 on each
endpoint's address, vLLM's `tcp://*:5557`, as llm-d's pod discovery; or `--kv-events-connect-port-offset` from its
serving port): an endpoint's events are what arrives on its socket, whatever their topic says, so no other process
can add to or wipe its entries, and every EPP replica hears every server. `--kv-events-bind` keeps the older way
(one bound socket the servers connect to), where a message counts only when its sender's address is its topic's.
Its receiver thread applies each batch to the index; an endpoint that has published is scored by
precise-prefix-cache-scorer, the others keep the approximate index. A server whose first blocks do not hash as this
EPP hashes them (another PYTHONHASHSEED or hash algorithm) is logged, counted and left to the approximate index.

Gaps: sequence numbers per topic must be consecutive. On a gap, with a replay endpoint known for the server
(`replay_port_offset`: the server's replay ROUTER listens on its serving port + offset, vLLM's `replay_endpoint`),
the missed batches are requested from it and applied in order; without one, or when the replay fails or no longer
has them, the endpoint's entries are dropped and the index relearns it from the events that follow: until then a
block it still holds scores as a miss (a lost hit), never a block it evicted as a hit. A sequence that goes back (a
restarted server), an AllBlocksCleared, and an endpoint that leaves the pool drop its entries too. A subscriber that
joins after a server started (a new EPP replica) asks the replay socket, when known, for what it still buffers of
the earlier batches; without one it knows only what is stored from then on. A replay runs beside the live sockets
on the subscriber's thread, the endpoint's own batches held until it ends (`replay_timeout` at most): a replay
socket that is slow or absent delays that endpoint only (it blocked every server's events, a second per replay:
a new EPP with a pool of 64 servers whose replay sockets did not answer applied their events after 64 s, now 1 s).
Memory: `max_entries` caps the (block hash, endpoint) pairs over all endpoints; over it, the endpoint with the most
entries loses its oldest, a few C operations each (`_Entries`: a list in the order stored, not an OrderedDict). At
its cap an entry costs 116-151 bytes, 146-208 at the peak while the hash table is rebuilt (`epp-bench kv-index`,
tracemalloc, caps of 2,500,000 and 400,000 over 8 servers, each entry evicted once; 78-96 just filled): the default
cap, 2,500,000 entries, peaks under ~500 MiB, within a budget of 512 MiB (a quarter of the manifest's 2 GiB limit),
and holds 80 servers of 31,250 blocks. What waits to be applied is bounded as well: QUEUED_MESSAGES a socket (the
rest waits in TCP and the server's own queue), MAX_REPLAY_BYTES over the replays under way; and a socket is read
READ_TURN_SECONDS at a time while others wait, so a server that publishes faster than its batches are applied
delays only itself. Updates run in slices (`pace`), so a huge batch never stops the event loop for long. While no
batch comes, the subscriber trims the index a 64th below its cap (`trim`, a slice at a time), so that the batches
that follow only insert; a store over the cap still evicts at once. The EPP exports the index size, the entries the
cap dropped, events applied, gaps, replays and the delay from a batch's step (its `ts`) to its application
(inference_extension_kv_events_*).
"""

from __future__ import annotations

import asyncio
import logging
import selectors
import threading
import time
from collections import deque
from itertools import repeat

import msgspec
import zmq
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from epp.datalayer.endpoint import Endpoint
from epp.metrics import unlabelled
from protocol.exposition import bucket_bounds, cumulative_buckets
from protocol.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockHasher,
    BlockRemoved,
    EventBatch,
    KVCacheEvent,
    external_block_hash,
    parse_topic,
)

# Bounds (seconds) of the delay histogram from a batch's step to its application in the index.
LAG_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0, 5.0)
LAG_LES = bucket_bounds(LAG_BUCKETS)
# The largest message taken from a publisher or a replay socket (zmq drops a longer one, and its connection, before
# buffering it). A batch is decoded whole while the subscriber holds the GIL, so this bounds the longest stall one
# batch can cause (`epp-bench kv-index --cap N`, a batch of N hashes alone: 197 ms at 1,700,000, what 16 MiB let in,
# 54 ms at 450,000; docs/kv-events.md). A step's batch is KBs to ~1 MB: ~60 bytes a block stored (its hash and 16
# token ids), so 2 MiB is ~35,000 blocks, over half a million tokens stored in one engine step.
MAX_MESSAGE_BYTES = 2 << 20
# At most this many batches are asked of a replay socket (twice vLLM's default replay buffer, buffer_steps 10,000):
# a larger gap could not be closed anyway, and what is replayed is held until it is all there.
MAX_REPLAYED_BATCHES = 20_000
# An endpoint's live batches held while its replay is under way (at most `replay_timeout`: a server publishes about
# one a step); beyond this the replay is given up and they are applied as after a gap.
MAX_HELD_BATCHES = 256
# What the replays under way hold, all endpoints together: the batches replayed and the live ones held meanwhile,
# counted as the bytes of their messages (decoded, a batch of hashes takes up to ~5x that). The replay that would go
# over is given up, as after a gap: a new EPP whose pool's servers all replay 10,000 buffered batches (vLLM's
# buffer_steps) must not hold them all at once.
MAX_REPLAY_BYTES = 32 << 20
# Messages one socket queues in this process (zmq's receive high-water mark; its default, 1,000): past it zmq stops
# reading that connection, TCP holds the next ones, and a server that goes on publishing keeps them in its own
# queue (vLLM's hwm, 100,000) or drops them, a gap here. So one endpoint costs at most QUEUED_MESSAGES x
# MAX_MESSAGE_BYTES here however fast it publishes: with the default, one server publishing 2 MB batches faster than
# they were applied took the subscriber from 31 to 1,841 MB, kept after (docs/kv-events.md).
QUEUED_MESSAGES = 16
# One socket is read for at most this long while others are ready: a server that publishes faster than its batches
# are applied must not hold every other server's events back (they waited until it stopped).
READ_TURN_SECONDS = 0.002
# An index update (a batch's blocks stored, removed or cleared, the entries over the cap evicted) runs in chunks of
# CHUNK_BLOCKS blocks (~0.1 ms), and lets the event loop's thread run once a slice of chunks has taken SLICE_SECONDS:
# a batch of 150,000 new blocks at the cap then never stops routing for much longer than a slice. A request that
# arrives meanwhile waits for the slice under way, at each of the few times it needs the GIL: with 1 ms slices its
# p50 was 2-3x its unloaded p50, with 0.25 ms 0.8-1.5x (`epp-bench kv-index`, docs/kv-events.md).
CHUNK_BLOCKS = 256
SLICE_SECONDS = 0.00025
# Entries evicted from one endpoint before the largest is looked for again.
EVICTION_RUN = 256
# Eviction leaves room below the cap for the stores that follow: a store over the cap evicts down to a run below it
# (at most a ROOM-th of it), an idle trim down to a ROOM-th below it (`KVBlockIndex.low_mark`).
ROOM = 64
EVICTED = (None,) * EVICTION_RUN  # what an evicted slot of an endpoint's log holds until the log drops it
# Over its low mark, the index is trimmed a slice at a time once no batch has come for IDLE_MS milliseconds (the wait
# also lets the event loop's thread run between two slices).
IDLE_MS = 1
DEFAULT_MAX_ENTRIES = 2_500_000  # under ~500 MiB at ~208 bytes an entry at the peak: see the module's docstring
# Senders outside the pool warned about once each (then only counted), at most this many.
MAX_WARNED_ENDPOINTS = 64

log = logging.getLogger(__name__)


def pace(started: float) -> float:
    """Between two chunks of an index update: once the update has run SLICE_SECONDS since `started`, let the other
    threads (the event loop) run, and return when the next slice starts. A sleep releases the GIL and, unlike
    sleep(0), lasts long enough for a thread waiting on it to take it: the compiled release build never switches
    threads by itself, so without this a batch of 150,000 blocks stopped routing for as long as it took."""
    if time.perf_counter() - started < SLICE_SECONDS:
        return started
    time.sleep(0.0001)
    return time.perf_counter()


class StoredBlocks(KVCacheEvent, tag="BlockStored"):
    """vLLM's BlockStored as the index reads it: the token ids stay undecoded bytes (msgspec.Raw), since the index
    keys on the hashes and decoding 16 ints per block would be most of the subscriber's work."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: msgspec.Raw
    block_size: int
    lora_id: int | None
    medium: str | None


class IndexedBatch(EventBatch):
    events: list[StoredBlocks | BlockRemoved | AllBlocksCleared]


class _Entries:
    """One endpoint's entries: how many, and its hashes in the order it stored them (`log[head:]`; the slots before
    `head`, evicted, are None until the list drops them). The log may still list hashes the endpoint no longer holds
    (removed; listed twice when stored again): an eviction skips those, and once they outnumber its entries the log
    is compacted. 8 bytes an entry (16 at most with the stale places), where an OrderedDict cost 100-170 more."""

    __slots__ = ("count", "head", "log")

    def __init__(self) -> None:
        self.count = 0
        self.head = 0
        self.log: list[int | None] = []

    @property
    def stale(self) -> int:
        """Hashes listed in the log that are not (or no longer) entries."""
        return len(self.log) - self.head - self.count


class KVBlockIndex:
    """Which endpoints hold each block hash. One thread writes it (the subscriber's; in tests, the caller's), in
    slices between which other threads read it without a lock: a reader may see a batch partly applied."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES):
        self.max_entries = max_entries
        self._holders: dict[int, str | set[str]] = {}  # block hash -> its holder, or the set of them
        self._entries: dict[str, _Entries] = {}  # endpoint -> its entries, oldest first
        self._size = 0
        self.dropped_entries = 0
        self._models: dict[str, str] = {}  # endpoint -> the model its topic names (its base model)
        # the models those topics name, replaced whole when one changes (read on the loop for every prompt; `saw` comes
        # with every batch, from the subscriber's thread)
        self.base_models: frozenset[str] = frozenset()
        # some endpoint sends KV events: read by the scheduler and the prefix scorers on every request, an attribute
        # (a property ran as Python, three calls a request from the compiled plugins)
        self.has_publishers = False
        self.block_size: int | None = None  # the block size of the latest BlockStored (the servers' block size)
        # how this EPP hashes a prompt's blocks (precise-prefix-cache-scorer's): the subscriber checks each
        # server's first blocks against it
        self.hasher: BlockHasher | None = None

    @property
    def size(self) -> int:
        return self._size

    def entries(self, endpoint: str) -> int:
        """Blocks the endpoint (address:port) holds, as its events said."""
        mine = self._entries.get(endpoint)
        return mine.count if mine is not None else 0

    def publishes(self, endpoint: str) -> bool:
        """The endpoint (address:port) sends KV events: what it holds is known here."""
        return endpoint in self._models

    def saw(self, endpoint: str, model: str) -> None:
        if self._models.get(endpoint) != model:
            self._models[endpoint] = model
            self.base_models = frozenset(self._models.values())
            self.has_publishers = True

    def forget(self, endpoint: str) -> None:
        """The endpoint left the pool."""
        if self._models.pop(endpoint, None) is not None:
            self.base_models = frozenset(self._models.values())
            self.has_publishers = bool(self._models)
        self.clear(endpoint)

    def store(self, endpoint: str, block_hashes: list[int]) -> None:
        started = time.perf_counter()
        for start in range(0, len(block_hashes), CHUNK_BLOCKS):
            if start:
                started = pace(started)
            self._store(endpoint, block_hashes[start : start + CHUNK_BLOCKS])
            over = self._size - self.max_entries
            if over > 0:  # the cap is hard: what idle trims did not make room for is evicted now
                self._evict(over + min(EVICTION_RUN, self.max_entries // ROOM))

    @property
    def low_mark(self) -> int:
        """What `trim` brings the index down to: a ROOM-th of the cap below it."""
        return self.max_entries - self.max_entries // ROOM

    def trim(self) -> bool:
        """Evict towards `low_mark` for up to a slice (SLICE_SECONDS); whether some is left. The subscriber calls it
        when no batch has come for a while, so that the batches that follow find room and only insert: a new hash's
        slot is hot, an evicted one's is cold (its int, its place in the hash table), and evicting a batch's worth
        on its own path made it ~1.6x a batch below the cap (docs/kv-events.md). The total work is the same."""
        started = time.perf_counter()
        while self._size > self.low_mark:
            self._evict(min(self._size - self.low_mark, EVICTION_RUN))
            if time.perf_counter() - started >= SLICE_SECONDS:
                break
        return self._size > self.low_mark

    def _store(self, endpoint: str, block_hashes: list[int]) -> None:
        mine = self._entries.get(endpoint)
        if mine is None:
            mine = self._entries[endpoint] = _Entries()
        holders = self._holders
        if holders.keys().isdisjoint(block_hashes):  # every block new (nearly always): one pass in C
            before = len(holders)
            holders.update(zip(block_hashes, repeat(endpoint)))
            added = len(holders) - before  # short of len(block_hashes) only if one is listed twice
            mine.log += block_hashes
        else:
            fresh = []
            for block_hash in block_hashes:
                held = holders.get(block_hash)
                if held is None:
                    holders[block_hash] = endpoint  # one holder: the name itself, no set (most blocks)
                elif type(held) is str:
                    if held == endpoint:
                        continue
                    holders[block_hash] = {held, endpoint}
                elif endpoint in held:
                    continue
                else:
                    held.add(endpoint)
                fresh.append(block_hash)
            added = len(fresh)
            mine.log += fresh
        mine.count += added
        self._size += added

    def _evict(self, over: int) -> None:
        """`over` entries go: the endpoint with the most entries loses its oldest, EVICTION_RUN at a time (so
        finding the largest endpoint costs little per entry; it may end up to a run below the next largest). A
        store over the cap evicts down to a run below it (at most a ROOM-th of it): the stores that follow fill that
        room instead of each evicting its own few blocks (vLLM sends a block at a time while it decodes: one at the
        cap then cost 2.4x one below it)."""
        while over > 0:
            endpoint, mine = max(self._entries.items(), key=lambda item: item[1].count)
            log, head = mine.log, mine.head
            oldest = log[head : head + min(over, EVICTION_RUN)]
            log[head : head + len(oldest)] = EVICTED[: len(oldest)]  # the hashes go with `oldest`
            head += len(oldest)
            if head * 2 >= len(log):  # moves at most one slot per slot evicted
                del log[:head]
                head = 0
            mine.head = head
            gone = self._unlink(endpoint, oldest)
            mine.count -= gone
            self.dropped_entries += gone
            over -= gone

    def remove(self, endpoint: str, block_hashes: list[int]) -> None:
        mine = self._entries.get(endpoint)
        if mine is None:
            return
        started = time.perf_counter()
        for start in range(0, len(block_hashes), CHUNK_BLOCKS):
            if start:
                started = pace(started)
            mine.count -= self._unlink(endpoint, block_hashes[start : start + CHUNK_BLOCKS])
        if mine.stale > mine.count + CHUNK_BLOCKS:
            self._compact(endpoint, mine)

    def clear(self, endpoint: str) -> None:
        mine = self._entries.pop(endpoint, None)
        if mine is None:
            return
        log, started = mine.log, time.perf_counter()
        for start in range(mine.head, len(log), CHUNK_BLOCKS):
            if start > mine.head:
                started = pace(started)
            self._unlink(endpoint, log[start : start + CHUNK_BLOCKS])

    def _unlink(self, endpoint: str, block_hashes: list[int]) -> int:
        """The endpoint no longer holds these hashes (its log's own count is the caller's): how many it held. One
        pass in C where it was their only holder (most blocks); a hash that others hold too, or that this endpoint
        no longer held, is put back (a reader in the meantime finds it missing: a lost hit, never a false one)."""
        holders = self._holders
        held_by = list(map(holders.pop, block_hashes, repeat(None)))
        gone = held_by.count(endpoint)
        if gone < len(block_hashes):
            for block_hash, held in zip(block_hashes, held_by, strict=True):
                if held is None or (type(held) is str and held == endpoint):
                    continue
                if type(held) is set and endpoint in held:
                    held.discard(endpoint)
                    gone += 1
                    holders[block_hash] = next(iter(held)) if len(held) == 1 else held
                else:
                    holders[block_hash] = held  # another endpoint's: this one's was a stale listing
        self._size -= gone
        return gone

    def _compact(self, endpoint: str, mine: _Entries) -> None:
        """Rewrite the endpoint's log with only the hashes it holds, each at the place it was last stored. Runs in
        slices like an update (it is a pass over the log, once per as many removals as the log lists entries); it
        holds a set of the endpoint's hashes meanwhile."""
        log, holders = mine.log, self._holders
        kept: list[int | None] = []
        seen: set[int] = set()
        started = time.perf_counter()
        for end in range(len(log), mine.head, -CHUNK_BLOCKS):
            if end < len(log):
                started = pace(started)
            for block_hash in reversed(log[max(mine.head, end - CHUNK_BLOCKS) : end]):
                if block_hash not in seen:
                    held = holders.get(block_hash)
                    if held == endpoint or (type(held) is set and endpoint in held):
                        seen.add(block_hash)
                        kept.append(block_hash)
        kept.reverse()
        mine.log, mine.head = kept, 0

    def extend_run(self, block_hashes: list[int], run: set[str] | None) -> tuple[int, set[str] | None]:
        """How many of `block_hashes` (a prompt's next blocks, in order) the endpoints of `run` (those that hold
        all the blocks before them; None: any endpoint) go on holding, and which endpoints hold them all. Each hash
        chains its parent's, so no endpoint holds a longer prefix once the count falls short."""
        holders = self._holders
        for depth, block_hash in enumerate(block_hashes):
            held = holders.get(block_hash)
            if held is None:
                return depth, run
            if type(held) is str:
                if run is not None and held not in run:
                    return depth, run
                if run is None or len(run) > 1:
                    run = {held}
            elif run is None or not run <= held:  # (a prefix all of the run holds, an agent's tools: no new set)
                narrowed = set(held) if run is None else run & held  # a copy: the subscriber changes the sets
                if not narrowed:
                    return depth, run
                run = narrowed
        return len(block_hashes), run

    def prefix_blocks(self, block_hashes: list[int], endpoints: list[str]) -> dict[str, int]:
        """For each endpoint, how many of the prompt's leading blocks it holds. An endpoint's count is written once,
        when it drops out of the run (a held 8k-token prompt is ~500 blocks, looked up for every request)."""
        matched = dict.fromkeys(endpoints, 0)
        alive = set(endpoints)
        holders = self._holders
        depth = 0
        for block_hash in block_hashes:
            held = holders.get(block_hash)
            if held is None:
                break
            if type(held) is str:
                if held not in alive:
                    break
                if len(alive) > 1:
                    alive.discard(held)
                    for endpoint in alive:
                        matched[endpoint] = depth
                    alive = {held}
            elif not alive <= held:
                still = alive & held
                for endpoint in alive - still:
                    matched[endpoint] = depth
                alive = still
                if not alive:
                    break
            depth += 1
        for endpoint in alive:
            matched[endpoint] = depth
        return matched


class _Replay:
    """Batches [start, until) asked of an endpoint's replay socket (`KVEventSubscriber._ask_replay`): those received
    so far, and the endpoint's live batches that came meanwhile, applied once the replay ends."""

    __slots__ = (
        "address",
        "bytes",
        "deadline",
        "endpoint",
        "held",
        "model",
        "replayed",
        "socket",
        "start",
        "until",
        "whole",
    )

    def __init__(
        self,
        endpoint: str,
        model: str,
        start: int,
        until: int,
        whole: bool,
        socket: zmq.Socket,
        address: str,
        deadline: float,
    ):
        self.endpoint, self.model, self.start, self.until, self.whole = endpoint, model, start, until, whole
        self.socket, self.address, self.deadline = socket, address, deadline
        self.replayed: list[tuple[int, IndexedBatch]] = []
        self.held: list[tuple[str, int, IndexedBatch, int]] = []  # (model, seq, batch, its bytes) from the live socket
        self.bytes = 0  # the messages of both, counted against MAX_REPLAY_BYTES

    @property
    def complete(self) -> bool:
        return bool(self.replayed) and self.replayed[-1][0] == self.until - 1


class KVEventSubscriber:
    """An endpoint source (`epp.datalayer.source`) fed by the model servers' KV-event publishers; a receiver thread
    applies each batch to the index. An endpoint that leaves the pool loses its entries.

    Where events come from decides whose they are. By default (`publisher_port` or `connect_port_offset`) the EPP
    opens one SUB socket per endpoint, connected to that endpoint's own publisher (the servers bind, as vLLM's
    `tcp://*:5557`): whatever arrives on it is that endpoint's, whatever its topic says, and nothing else can reach
    the EPP's index. With `endpoint` (a bound address) the servers connect in instead, and a message counts only when
    its sender's IP address (ZMQ's Peer-Address) is the one its topic names: weaker (any process on a server's host,
    or another port of it, can speak for it) and for networks where only the servers reach that port."""

    name = "kv-events"

    def __init__(
        self,
        index: KVBlockIndex,
        endpoint: str | None = None,
        *,
        publisher_port: int | None = None,
        connect_port_offset: int | None = None,
        replay_port_offset: int | None = None,
        replay_timeout: float = 1.0,
    ):
        if (endpoint is None) == (publisher_port is None and connect_port_offset is None):
            raise ValueError("KV events: either a bound endpoint or the servers' publisher port (or offset)")
        self.index = index
        self._ctx = zmq.Context()
        # one SUB socket an endpoint (and one a replay under way): zmq's default of 1,023 sockets a context left a pool's
        # endpoints past the 1,023rd without events ("Too many open files"); the process's open-files limit (raised to
        # its hard limit at start) is what bounds them now
        self._ctx.set(zmq.MAX_SOCKETS, self._ctx.get(zmq.SOCKET_LIMIT))
        # The sockets' ZMQ_FDs in the kernel's readiness set (epoll), not a zmq.Poller: zmq_poll asks every socket
        # for its state on each wake, a cost that grew with the pool (a bare loop at 150 messages a second: 259 us
        # a message over 8 sockets, 451 over 64, 1,061 over 256; through epoll 220, 230 and 257).
        self._selector = selectors.DefaultSelector()
        # what to read before the next wait (sockets, and replays: `_watch`), new ones: their FD may not signal
        self._unread: list[zmq.Socket | _Replay] = []
        self._sources: dict[zmq.Socket, str | None] = {}  # socket -> the endpoint it hears (None: the bound one)
        self._connected: dict[str, zmq.Socket] = {}  # endpoint (address:port) -> its publisher's socket
        self.publisher_port = publisher_port
        self.connect_port_offset = connect_port_offset
        self._bound: str | None = None
        self._targets: deque[tuple[bool, str, str]] = deque()  # (join?, endpoint, publisher) from the loop
        if endpoint is not None:
            self._bound = self._socket(endpoint, None, bind=True).getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_port_offset = replay_port_offset
        self.replay_timeout = replay_timeout
        # Replays under way, by endpoint: each waits on its socket beside the live ones, so a replay socket that is
        # slow or absent delays only its own endpoint's batches (they are held until it ends)
        self._replays: dict[str, _Replay] = {}
        self._replay_bytes = 0  # what they hold (`_Replay.bytes`), all together
        self._decode = msgspec.msgpack.Decoder(IndexedBatch).decode
        self._next_seq: dict[str, int] = {}
        self._forget: deque[str] = deque()  # endpoints that left the pool (appended on the loop, read by the thread)
        self.batches = 0
        self.events_applied = 0
        self.gaps = 0
        self.restarts = 0
        self.replays = 0  # gaps closed by a replay
        self.bad_messages = 0
        self.unverified = 0  # bound socket: messages whose sender is not at the address their topic names
        # endpoints whose block hashes this EPP cannot reproduce (another PYTHONHASHSEED or hash algorithm): their
        # events are ignored until they restart, and the approximate index covers them
        self.mismatched: set[str] = set()
        self._verified: set[str] = set()  # endpoints whose first blocks hashed as this EPP hashes them
        # Only the pool's servers are indexed: an entry per topic (a sequence number, a model) for any address:port a
        # sender names would grow without bound. Replaced whole on the loop (start/stop), read by the receiver thread.
        self._pool: frozenset[str] = frozenset()
        self.outside_pool = 0  # messages from servers not in the pool, ignored
        self._warned: set[str] = set()
        self.lag_buckets = [0] * (len(LAG_BUCKETS) + 1)  # per bound of LAG_BUCKETS, then +Inf (not cumulative)
        self.lag_sum = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="kv-events-subscriber")
        self._thread.start()

    @property
    def endpoint(self) -> str | None:
        """The bound address (None when connecting to the servers)."""
        return self._bound

    def publisher(self, endpoint: Endpoint) -> str:
        """Where a server's publisher listens: its address at `publisher_port`, or at its serving port + the offset."""
        spec = endpoint.spec
        port = self.publisher_port if self.connect_port_offset is None else spec.port + self.connect_port_offset
        return f"tcp://{endpoint.hostport.rpartition(':')[0]}:{port}"

    def start(self, endpoint: Endpoint) -> None:
        self._pool = self._pool | {endpoint.hostport}
        if self._bound is None:
            self._targets.append((True, endpoint.hostport, self.publisher(endpoint)))

    def stop(self, endpoint: Endpoint) -> None:
        self._pool = self._pool - {endpoint.hostport}
        self._forget.append(endpoint.hostport)  # the receiver thread owns the index: it clears it there
        if self._bound is None:
            self._targets.append((False, endpoint.hostport, self.publisher(endpoint)))

    def wake(self) -> None:
        pass

    async def close(self) -> None:
        await asyncio.to_thread(self.shutdown)

    def collect(self):
        """Its metrics and its index's (inference_extension_kv_events_*), read when Prometheus scrapes."""
        index = self.index
        gauges = (
            (
                "inference_extension_kv_events_index_entries",
                "(block hash, endpoint) pairs in the KV-event index.",
                index.size,
            ),
            (
                "inference_extension_kv_events_index_max_entries",
                "The KV-event index's cap on entries.",
                index.max_entries,
            ),
            (
                "inference_extension_kv_events_hash_mismatched_endpoints",
                "Endpoints whose KV events hash blocks otherwise than this EPP (another PYTHONHASHSEED or hash "
                "algorithm): their events are ignored.",
                len(self.mismatched),
            ),
        )
        yield from unlabelled(GaugeMetricFamily, gauges)
        counters = (
            (
                "inference_extension_kv_events_index_dropped_entries",
                "Entries the index's cap dropped.",
                index.dropped_entries,
            ),
            ("inference_extension_kv_events_batches", "KV event batches applied to the index.", self.batches),
            ("inference_extension_kv_events_events", "KV events applied to the index.", self.events_applied),
            ("inference_extension_kv_events_gaps", "Sequence gaps that dropped an endpoint's entries.", self.gaps),
            (
                "inference_extension_kv_events_replays",
                "Sequence gaps closed by a replay from the server.",
                self.replays,
            ),
            ("inference_extension_kv_events_restarts", "Servers whose sequence started over.", self.restarts),
            ("inference_extension_kv_events_bad_messages", "Malformed KV event messages ignored.", self.bad_messages),
            (
                "inference_extension_kv_events_outside_pool_messages",
                "KV event messages from servers not in the pool, ignored.",
                self.outside_pool,
            ),
            (
                "inference_extension_kv_events_unverified_messages",
                "KV event messages on the bound socket from another address than their topic names, ignored.",
                self.unverified,
            ),
        )
        yield from unlabelled(CounterMetricFamily, counters)
        lag = HistogramMetricFamily(
            "inference_extension_kv_events_lag_seconds",
            "Seconds from a KV event batch's engine step (its ts) to its application in the index.",
        )
        lag.add_metric([], cumulative_buckets(LAG_LES, list(self.lag_buckets)), self.lag_sum)
        yield lag

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._selector.close()
        for socket in (*self._sources, *(replay.socket for replay in self._replays.values())):
            socket.close(linger=0)
        self._ctx.term()

    def _socket(self, address: str, source: str | None, *, bind: bool = False) -> zmq.Socket:
        socket = self._ctx.socket(zmq.SUB)
        socket.setsockopt(zmq.SUBSCRIBE, b"kv@")
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        socket.setsockopt(zmq.RCVHWM, QUEUED_MESSAGES)
        # a server not up yet is retried less and less often, at most a second apart (what it publishes before the
        # connection is made is replayed from its replay socket, when known: a late joiner's history)
        socket.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        socket.bind(address) if bind else socket.connect(address)
        self._sources[socket] = source
        self._watch(socket, socket)
        return socket

    def _watch(self, socket: zmq.Socket, item: zmq.Socket | _Replay) -> None:
        """Wait on `socket` beside the others: its ZMQ_FD in the selector, `item` what a wake names (the socket, or
        the replay it serves); read once before the next wait, since its FD may not signal what came before."""
        self._selector.register(socket.getsockopt(zmq.FD), selectors.EVENT_READ, item)
        self._unread.append(item)

    def _unwatch(self, socket: zmq.Socket, item: zmq.Socket | _Replay) -> None:
        self._selector.unregister(socket.getsockopt(zmq.FD))
        if item in self._unread:
            self._unread.remove(item)
        socket.close(linger=0)

    def _follow(self) -> None:
        """Open or close the sockets of the endpoints that joined or left (on the thread: sockets are its own)."""
        while self._targets:
            join, endpoint, address = self._targets.popleft()
            socket = self._connected.pop(endpoint, None)
            if socket is not None:
                del self._sources[socket]
                self._unwatch(socket, socket)
            if join:
                try:
                    self._connected[endpoint] = self._socket(address, endpoint)
                except zmq.ZMQError as exc:
                    log.warning("KV events: cannot connect to %s for %s: %s", address, endpoint, exc)

    def _run(self) -> None:
        decode = self._decode
        topics: dict[bytes, tuple[str, str]] = {}
        while not self._stop.is_set():
            while self._forget:
                endpoint = self._forget.popleft()
                replay = self._replays.get(endpoint)
                if replay is not None:
                    self._close_replay(replay)  # what it held goes with the endpoint
                self.index.forget(endpoint)
                self._next_seq.pop(endpoint, None)
                self._verified.discard(endpoint)
                self.mismatched.discard(endpoint)
            self._follow()
            index = self.index
            ready, self._unread = self._unread, []
            if ready:  # new sockets, or some whose turn ran out: those that woke meanwhile are read too
                ready = list(dict.fromkeys([*ready, *(key.data for key, _ in self._selector.select(0))]))
            else:
                # A socket's FD signals that its state may have changed, once: each socket it names is read until
                # it has nothing more (zmq.Again), or no later message would wake this thread; one whose turn ends
                # first is kept in _unread and read again on the next pass.
                wait = IDLE_MS / 1000 if index.size > index.low_mark else 0.1
                if self._replays:
                    wait = min(wait, max(0.0, min(r.deadline for r in self._replays.values()) - time.monotonic()))
                ready = [key.data for key, _ in self._selector.select(wait)]
            if self._replays:
                self._expire_replays()
            if not ready:
                index.trim()  # no batch for a while: a slice of the cap's eviction, off the next batches' path
            for socket in ready:
                if type(socket) is _Replay:
                    self._settle(self._read_replay, socket)
                    continue
                source = self._sources[socket]
                turn_ends = time.perf_counter() + READ_TURN_SECONDS
                while True:  # drain what has arrived: one wake per burst, not per message
                    if time.perf_counter() > turn_ends:
                        self._unread.append(socket)  # the others ready go first
                        break
                    try:
                        frames = socket.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    try:
                        if len(frames) != 3:
                            raise ValueError(f"{len(frames)} frames, not 3")
                        topic_bytes, seq_bytes = frames[0].bytes, frames[1].bytes
                        parsed = topics.get(topic_bytes)
                        if parsed is None:
                            parsed = parse_topic(topic_bytes.decode())
                            if parsed is None:
                                raise ValueError("not a kv@<address:port>@<model> topic")
                            if len(topics) < 65536:  # bounded: topics are per server
                                topics[topic_bytes] = parsed
                        endpoint = source or parsed[0]  # a publisher's own socket speaks for its endpoint only
                        if endpoint not in self._pool:
                            self._outside_pool(endpoint)
                            continue
                        if source is None and frames[0].get("Peer-Address") != endpoint.rpartition(":")[0].strip("[]"):
                            self._unverified(endpoint, frames[0].get("Peer-Address"))
                            continue
                        if len(seq_bytes) != 8:
                            raise ValueError("not an 8-byte sequence number")
                        batch = decode(frames[2].buffer)
                    except (ValueError, UnicodeDecodeError, msgspec.DecodeError) as exc:
                        self.bad_messages += 1  # one bad publisher must not stop the others' events
                        log.debug("ignoring a malformed KV event message: %s", exc)
                        continue
                    try:
                        self._receive(endpoint, parsed[1], int.from_bytes(seq_bytes, "big"), batch, len(frames[2]))
                    except Exception:  # a bug costs this batch (and the endpoint's sync), not every server's events
                        log.exception("KV events: applying a batch from %s failed", endpoint)
                        self._resync(endpoint)

    def _resync(self, endpoint: str) -> None:
        """Start the endpoint over after a bug: its entries dropped, its next batch taken as a late joiner's."""
        self.index.clear(endpoint)
        self._next_seq.pop(endpoint, None)

    def _warn_once(self, key: str, message: str, *args: object) -> None:
        """Log `message` the first time `key` comes (up to MAX_WARNED_ENDPOINTS keys; after that, only counted)."""
        if key not in self._warned and len(self._warned) < MAX_WARNED_ENDPOINTS:
            self._warned.add(key)
            log.warning(message, *args)

    def _unverified(self, endpoint: str, sender: str) -> None:
        self.unverified += 1
        self._warn_once(
            f"unverified {endpoint}",
            "KV events for %s sent from %s are ignored: only its own address may speak for it",
            endpoint,
            sender,
        )

    def _outside_pool(self, endpoint: str) -> None:
        self.outside_pool += 1
        self._warn_once(
            endpoint,
            "KV events from %s, which is not in the pool, are ignored (a topic names the address:port the pool lists "
            "for its server: kv@<address:port>@<model>)",
            endpoint,
        )

    def _receive(self, endpoint: str, model: str, seq: int, batch: IndexedBatch, size: int) -> None:
        """A batch of the endpoint's (its message `size` bytes) from its live socket."""
        replay = self._replays.get(endpoint)
        if replay is not None:  # applied after the replay, in order
            replay.held.append((model, seq, batch, size))
            self._hold(replay, size)
            return
        expected = self._next_seq.get(endpoint)
        if expected is None and seq > 0 and self._ask_replay(endpoint, model, 0, seq, False, batch, size):
            return  # a subscriber that joined late: what the server still buffers of its history comes first
        if expected is not None and seq != expected:
            if seq < expected:
                self.restarts += 1  # its sequence started over: a new process whose cache starts empty
                self.index.clear(endpoint)
                self._verified.discard(endpoint)  # perhaps with another seed
                self.mismatched.discard(endpoint)
            elif self._ask_replay(endpoint, model, expected, seq, True, batch, size):
                return
            else:
                self._gap(endpoint, expected, seq)
        self._apply(endpoint, model, seq, batch)

    def _gap(self, endpoint: str, expected: int, seq: int) -> None:
        """Batches [expected, seq) of the endpoint were missed and not replayed: what we know of it may be stale."""
        self.gaps += 1
        self.index.clear(endpoint)
        self._warn_once(
            f"gap {endpoint}",
            "KV events from %s: batches %d to %d missed (a dropped connection, or a message over %d bytes, which zmq "
            "drops unread): its entries are dropped and relearnt from the events that follow "
            "(inference_extension_kv_events_gaps; warned once per endpoint)",
            endpoint,
            expected,
            seq - 1,
            MAX_MESSAGE_BYTES,
        )

    def _apply(self, endpoint: str, model: str, seq: int, batch: IndexedBatch) -> None:
        self._next_seq[endpoint] = seq + 1
        index = self.index
        if endpoint in self.mismatched:
            return
        if endpoint not in self._verified and index.hasher is not None and not self._hashes_match(endpoint, batch):
            return
        index.saw(endpoint, model)
        for event in batch.events:
            if type(event) is StoredBlocks:
                index.store(endpoint, event.block_hashes)
                index.block_size = event.block_size
            elif type(event) is BlockRemoved:
                index.remove(endpoint, event.block_hashes)
            elif type(event) is AllBlocksCleared:
                index.clear(endpoint)
        self.batches += 1
        self.events_applied += len(batch.events)
        lag = max(0.0, time.time() - batch.ts)
        self.lag_sum += lag
        bucket = 0
        while bucket < len(LAG_BUCKETS) and lag > LAG_BUCKETS[bucket]:
            bucket += 1
        self.lag_buckets[bucket] += 1

    def _hashes_match(self, endpoint: str, batch: IndexedBatch) -> bool:
        """Whether the endpoint hashes blocks as this EPP does, from the first block of a sequence it stored (no
        parent, no adapter: its hash is a function of its tokens and the seed alone). A server started with
        another PYTHONHASHSEED or hash algorithm sends hashes no request's will ever match: its events are
        ignored (and its entries dropped) until it restarts, the approximate index covering it meanwhile."""
        for event in batch.events:
            if type(event) is not StoredBlocks or event.parent_block_hash is not None or event.lora_id is not None:
                continue
            tokens = msgspec.msgpack.decode(event.token_ids, type=list[int])[: event.block_size]
            if len(tokens) < event.block_size or not event.block_hashes:
                continue
            if external_block_hash(self.index.hasher.hash_block(None, tokens)) == event.block_hashes[0]:
                self._verified.add(endpoint)
                return True
            self.mismatched.add(endpoint)
            self.index.forget(endpoint)
            log.warning(
                "KV events from %s: its block hashes are not this EPP's (the server runs with another "
                "PYTHONHASHSEED or --prefix-caching-hash-algo than precise-prefix-cache-scorer's hashSeed / "
                "hashAlgo): its events can never match a request and are ignored until it restarts "
                "(inference_extension_kv_events_hash_mismatched_endpoints)",
                endpoint,
            )
            return False
        return True  # nothing to check in this batch: it is applied, and a later one is checked

    def _ask_replay(
        self, endpoint: str, model: str, start: int, until: int, whole: bool, batch: IndexedBatch, size: int
    ) -> bool:
        """Ask the server's replay socket for batches [start, until); False when none can be asked (no replay socket
        known, a gap larger than any buffer). Otherwise the replay runs beside the live sockets (`_read_replay`),
        `batch` (number `until`, `size` bytes) and the endpoint's later batches are held until it ends
        (`_end_replay`), and only this endpoint waits. With `whole` False (a late joiner's history) the latest run
        the server still buffers will do: a suffix of its history adds no block it evicted, it only misses older
        ones."""
        if self.replay_port_offset is None:
            return False
        if until - start > MAX_REPLAYED_BATCHES:
            if whole:
                return False
            start = until - MAX_REPLAYED_BATCHES
        host, _, port = endpoint.rpartition(":")
        address = f"tcp://{host}:{int(port) + self.replay_port_offset}"
        socket = self._ctx.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        socket.setsockopt(zmq.RCVHWM, QUEUED_MESSAGES)
        try:
            socket.connect(address)
            socket.send_multipart((b"", start.to_bytes(8, "big")), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("KV events: replay from %s failed: %s", address, exc)
            socket.close(linger=0)
            return False
        replay = _Replay(endpoint, model, start, until, whole, socket, address, time.monotonic() + self.replay_timeout)
        replay.held.append((model, until, batch, size))
        self._replays[endpoint] = replay
        self._watch(socket, replay)
        self._hold(replay, size)
        return True

    def _hold(self, replay: _Replay, size: int) -> bool:
        """`size` bytes more held by the replay; whether it goes on. Over MAX_REPLAY_BYTES (all replays together) or
        MAX_HELD_BATCHES live batches it is given up, as after a gap."""
        replay.bytes += size
        self._replay_bytes += size
        if self._replay_bytes <= MAX_REPLAY_BYTES and len(replay.held) <= MAX_HELD_BATCHES:
            return True
        log.warning(
            "KV events: replay from %s given up: it held %d replayed and %d live batches, %d bytes (replays under way "
            "hold at most %d bytes and %d live batches each)",
            replay.address,
            len(replay.replayed),
            len(replay.held),
            replay.bytes,
            MAX_REPLAY_BYTES,
            MAX_HELD_BATCHES,
        )
        self._end_replay(replay, False)
        return False

    def _read_replay(self, replay: _Replay) -> None:
        """What the replay socket sent since the last read; the replay ends at its end marker, or at a batch out of
        order or unreadable."""
        turn_ends = time.perf_counter() + READ_TURN_SECONDS
        while True:
            if time.perf_counter() > turn_ends:
                self._unread.append(replay)  # the others ready go first
                return
            try:
                frames = replay.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[1] == END_SEQ:
                self._end_replay(replay, replay.complete)  # short of `until`: the buffer no longer holds them all
                return
            seq = int.from_bytes(frames[1], "big")
            if seq >= replay.until:
                continue
            # consecutive from `start` (or, for a late joiner's history, from wherever its buffer begins)
            expected = replay.replayed[-1][0] + 1 if replay.replayed else replay.start
            if seq != expected and (replay.whole or replay.replayed or seq < replay.start):
                self._end_replay(replay, False)
                return
            try:
                replay.replayed.append((seq, self._decode(frames[2])))
            except (msgspec.DecodeError, ValueError) as exc:
                log.warning("KV events: replay from %s failed: %s", replay.address, exc)
                self._end_replay(replay, False)
                return
            if not self._hold(replay, len(frames[2])):
                return

    def _expire_replays(self) -> None:
        now = time.monotonic()
        for replay in [r for r in self._replays.values() if now >= r.deadline]:
            log.warning("KV events: replay from %s timed out", replay.address)
            self._settle(self._end_replay, replay, False)

    def _settle(self, step, replay: _Replay, *args) -> None:
        """Run one step of a replay still under way (a wake may name one that ended since); a bug in it (or in
        applying what it brought) costs that endpoint's sync, not every server's events."""
        if self._replays.get(replay.endpoint) is not replay:
            return
        try:
            step(replay, *args)
        except Exception:
            log.exception("KV events: a replay for %s failed", replay.endpoint)
            self._close_replay(replay)
            self._resync(replay.endpoint)

    def _end_replay(self, replay: _Replay, ok: bool) -> None:
        """Apply what was replayed (or, for a gap it could not close, drop the endpoint's entries), then the
        endpoint's batches held meanwhile, in order."""
        self._close_replay(replay)
        endpoint = replay.endpoint
        if ok:
            self.replays += 1
            for seq, batch in replay.replayed:
                self._apply(endpoint, replay.model, seq, batch)
        else:
            if replay.whole:
                self._gap(endpoint, replay.start, replay.until)
            self._next_seq[endpoint] = replay.until  # the held batches go on from there
        for model, seq, batch, size in replay.held:
            self._receive(endpoint, model, seq, batch, size)

    def _close_replay(self, replay: _Replay) -> None:
        if self._replays.get(replay.endpoint) is replay:  # (not closed already)
            del self._replays[replay.endpoint]
            self._replay_bytes -= replay.bytes
            self._unwatch(replay.socket, replay)
