"""Active-active replicas that agree on load (`--replica-peers`): each EPP tells its peers what it routed and what
finished, so N replicas behind one gateway place a burst as one EPP would (docs/replicas.md).

What is shared, over UDP on `--replica-port` (no external store):
* **Load, as idempotent snapshots.** A replica sends each peer its own in-flight requests and prompt tokens per
  endpoint (`Endpoint.in_flight_requests` / `in_flight_tokens` less what its peers contributed), coalesced: the first
  change schedules a check at the end of the event loop's current pass, which carries everything changed in it (a
  busy loop's passes are longer: the busier, the more one datagram carries). A count that rose (a pick) goes out
  then; counts that only fell wait up to HOLD_SECONDS for the next datagram (`_flush`). A heartbeat resends it
  when none went out for HEARTBEAT_SECONDS. A snapshot replaces the sender's previous one whole, so a lost
  datagram is healed by the next, and a peer that stops (killed, partitioned) stops counting once its last snapshot
  is EXPIRY_SECONDS old.
  The receiver adds the sum of its fresh peers' snapshots to each endpoint's in-flight counts and remembers that sum
  (`peer_in_flight_requests` / `peer_in_flight_tokens`), so every reader of the counts (the load scorers, the queue
  estimates of `epp.datalayer.load`, the saturation detector, the latency predictor's features) sees the pool's
  load with no change of its own, and the director's accounting stays its own.
* **Turns to pick** (`--replica-turns`, on by default): replicas that pick at the same moment do not see each
  other's picks however fast the snapshots travel (a shared memory channel measured no better:
  docs/2026-11-30-replicas-notebook.md, "Sharing at once is not enough; picks in turn are"), so picks take turns. The
  replica with the lowest instance id among those that take turns (their snapshots offer to)
  is the sequencer: it grants one turn at a time, with its own load and every peer's as it knows them, and a replica
  done with its turn gives it back with its load (`turn`). The sequencer picks at once when no turn is out; the
  others wait a round trip, TURN_WAIT_SECONDS at most, then pick as without turns, and pass over a sequencer that
  let a turn run out until they hear it again (one that died is waited for once).
* **The approximate prefix index's learning, as deltas**: the block hashes a pick recorded (`SharedPrefixIndex`:
  prefix-cache-scorer), which each peer records for the same endpoint. A lost delta is a missed hint, not an error.
  Endpoints that publish KV events need none of this: every replica subscribes to their events.
* **Access-log records** of requests another replica routed: the gateway sends a request's record (its TTFT, status
  and served endpoint) to any replica, and a replica forwards the records that match none of its requests, so the
  latency predictor of the replica that routed a request learns from it (`Director.forward_record`, `match_record`).
* **The latency predictor's observations** (a request's features at the pick, its TTFT and TPOT), which every peer's
  predictor learns from too (`LatencyPredictor.observed`): each learns from every request, as one EPP's would.
* **The model servers' pages** (`--replica-share-pages`, on by default): each endpoint's metrics page is read by one
  live replica (`owns`: rendezvous hashing with bounded shares over the instance ids of this replica and its fresh
  peers), which sends
  what it read (`EndpointMetrics` and the inter-token latency totals) to its peers; the scraper reads every endpoint
  on common ticks, so a replica's share of a tick goes in one datagram (PAGE_HOLD_SECONDS). A peer's page younger
  than two scrape intervals stands for a replica's own scrape (`peer_page`); a later one (its reader died, its
  scrapes fail, a datagram was lost) makes the replica read the page itself, so no endpoint goes unread, and once
  a dead reader expires its endpoints move to the others. Scraping was most of each replica's CPU (three replicas
  read every page three times; docs/2026-11-30-replicas-notebook.md, "What a replica costs in the background").

Peers: `--replica-peers` is a comma list of host:port; a host that resolves to several addresses (a headless
Service) means all of them, resolved again every RESOLVE_SECONDS. A replica finds itself among them when a datagram
carrying its own instance id comes back, and stops sending there.

Trust: a datagram counts only when it comes from a resolved peer address (any other source is dropped unparsed), is
at most MAX_DATAGRAM_BYTES, parses whole within its limits, and is newer than the sender's last one. UDP sources can
be spoofed from within the network, so the channel relies on the NetworkPolicy letting only the EPP's own pods reach
the port; `--replica-secret-file` adds an HMAC-SHA256 tag (16 bytes) keyed by a shared secret, checked before
anything is parsed. The most a forger who passes those checks can do is add load to endpoints for EXPIRY_SECONDS or
entries to the prefix index, never crash the EPP or make it hold more than MAX_PEERS snapshots.

Wire: a datagram is a HEADER and its sections (SECTION: a snapshot, a kind of delta's entries, a turn's message), so
one datagram carries a snapshot and every delta waiting. Every datagram wakes each peer's event loop, which costs it
more than the Python that reads the datagram: what sharing costs in CPU follows the datagrams (`epp-bench
replica-channel`; docs/2026-11-30-replicas-notebook.md, "What sharing costs in CPU", has the counts). So only a
pick goes out at once; falls and prefix picks wait up to HOLD_SECONDS, what trains the peers' predictors waits for
the next datagram (`_queue`).

Cost: on the request path, one call per change (`load_changed`: a flag check, a callback when none is pending) and
an encoded entry per recorded pick (`learned`); encoding and sending run in that one callback once the loop's pass is
done (or in the timer of what waits), and merging when a datagram comes, both on the event loop and never blocking
(a send buffer over MAX_PENDING_SEND_BYTES drops deltas, never snapshots). The channel counts its own CPU by part
(CPU_PARTS; a clock read before and after each callback, ~1 us), so what sharing costs is read off a running EPP
(inference_extension_replica_cpu_seconds_total) and `epp-bench compare` reports it per request.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import math
import os
import socket
import struct
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from time import thread_time

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from xxhash import xxh64_intdigest

from epp.datalayer.datastore import Datastore
from epp.datalayer.endpoint import Endpoint
from epp.metrics import one_label, unlabelled
from epp.predictor import LatencyPredictor
from epp.predictor.features import Features
from epp.scheduling.framework import SharedPrefixIndex
from protocol.metrics import EndpointMetrics

log = logging.getLogger("epp.replicas")

DEFAULT_REPLICA_PORT = 9005
# Each peer hears a snapshot at least this often: the heartbeat sends one when no other datagram carried one since.
HEARTBEAT_SECONDS = 0.5
# What is not a pick (counts that only fell, deltas: prefix picks, access-log records, predictor observations) goes
# out at most this long after it was made, with the next datagram if it is sooner. Every datagram wakes each peer
# (the CPU sharing costs follows the datagrams: docs/2026-11-30-replicas-notebook.md, "What sharing costs in CPU"):
# at 10 ms the falls went alone, 2.9 datagrams a request and peer at 24 req/s over 3 replicas; at 50 ms most ride
# with the next pick or each other.
HOLD_SECONDS = 0.05
# A peer's snapshot counts for this long after it came (4 heartbeats: one or two lost datagrams do not matter).
EXPIRY_SECONDS = 2.0
# A peer routes (it has a place in replica-stripe-picker's stripes) while its last pick is at most this old: a replica
# the gateway sends nothing, or hardly anything, must not leave the others each on a part of the pool.
ROUTING_SECONDS = 1.0
RESOLVE_SECONDS = 5.0
MAX_PEERS = 64  # peer addresses sent to and believed; a resolution that yields more keeps the first ones
# One datagram: what fits unfragmented on loopback and, fragmented by IP, across a pod network; a snapshot larger
# than this (thousands of busy endpoints) keeps its busiest endpoints.
MAX_DATAGRAM_BYTES = 60_000
# Deltas waiting in the socket's send buffer: beyond this the next ones are dropped (a peer that reads nothing, a
# loop that runs behind).
MAX_PENDING_SEND_BYTES = 1 << 20
TAG_BYTES = 16
MAGIC = b"EPPr"
HEADER = struct.Struct("!4sQQB")  # magic, sender's instance id, sequence, sections that follow
SECTION = struct.Struct("!BH")  # a section's kind and its body's length
SNAPSHOT, LEARNED, RECORDS, OBSERVED, PAGES, TURN, RELAYED = 1, 2, 3, 4, 5, 6, 7
# A turn's messages (TURN sections: the op and the turn's id): a replica asks the sequencer for the turn to pick, the
# sequencer grants it with the pool's load as it knows it, the replica says it is done with its own load. And every
# snapshot of a replica that takes turns offers to: only those are sequencers (not one with --no-replica-turns, nor
# one of a version before turns, whose peers would otherwise wait out every turn during a rolling update).
OFFER, ASK, GRANT, DONE = 0, 1, 2, 3
_TURN = struct.Struct("!BQ")
_INSTANCE = struct.Struct("!Q")
# A replica waits this long for its turn, then picks without it (the sequencer is gone or slow).
TURN_WAIT_SECONDS = 0.01
# A replica asks for turns while a peer has picked within this long; one whose peers have not (they stand by, or the
# gateway sends them nothing) routes alone and picks at once.
TURN_ROUTING_SECONDS = 30.0
# The sequencer takes a turn back this long after granting it when the replica has not said it is done.
TURN_HOLD_SECONDS = 0.01
LOCAL = "local"  # the sequencer's own picks, in its queue of turns
# How this replica's turns went (inference_extension_replica_turns_total): a peer granted it, it waited
# TURN_WAIT_SECONDS and picked without one, it sequences and picked at once (no turn out), it sequences and its picks
# waited for a peer's turn; the turns it granted its peers; and the picks it made without asking because no peer had
# picked within TURN_ROUTING_SECONDS (it routes alone).
TURN_OUTCOMES = ("granted", "timed_out", "free", "queued", "given", "alone")
# A page this replica read for its peers waits this long for the others of the same scrape tick (the scraper reads
# every endpoint on the same ticks when pages are shared), so a tick's pages go in one datagram.
PAGE_HOLD_SECONDS = 0.005
_COUNT = struct.Struct("!H")
# The most one section's body holds: a datagram with that one section alone stays within MAX_DATAGRAM_BYTES.
SECTION_ROOM = MAX_DATAGRAM_BYTES - HEADER.size - TAG_BYTES - SECTION.size
_LOAD = struct.Struct("!II")  # in-flight requests, in-flight prompt tokens
_F64 = struct.Struct("!d")
_BYTE = struct.Struct("!B")
# an observation's waiting, running, in-flight tokens, prompt tokens, cached tokens, KV usage, backlog tokens,
# adapter loaded, TTFT, TPOT (NaN: none)
_FEATURES = struct.Struct("!IIIIIdd?dd")
_U32 = 0xFFFFFFFF
# a page's waiting, running, KV usage, block size, GPU blocks (0: none), LoRA slots (-1: none), age in
# microseconds, inter-token latency totals: seconds and gaps (NaN: not read at this scrape)
_PAGE = struct.Struct("!IIdIIiIdd")
MAX_PAGE_ADAPTERS = 100  # adapter names of each kind a page carries: two lists of 255-byte names stay in a datagram
MAX_HEADS = 65536
# What the channel's CPU is counted by (`ReplicaChannel.cpu`): sending (the end-of-pass check, the timers of what
# waits and the heartbeat, encoding, the sends), receiving (checking, decoding and merging peers' datagrams: their
# snapshots, prefix picks and access-log records) and the latency predictor learning from the peers' observations.
CPU_PARTS = ("send", "receive", "peer_learning")
_HEADS: dict[str, bytes] = {}  # hostport -> its encoded entry head (_entry_head)


@dataclass
class Peer:
    """What one peer (a source address) last said: its instance (a new one after a restart), its last sequence
    number, when its last snapshot came and its last one with a pick (a count that rose), the snapshot: endpoint
    hostport -> (requests, prompt tokens), and whether it takes turns to pick."""

    instance: int
    sequence: int = 0
    seen_at: float = 0.0
    picked_at: float = -math.inf
    load: dict[str, tuple[int, int]] = field(default_factory=dict)
    turns: bool = False  # it takes turns to pick (its snapshots offer to)
    # when a turn asked of it ran out (0: none did since its last snapshot): it is not asked again until it is heard
    unanswered_at: float = 0.0


class MalformedDatagram(ValueError):
    pass


def _rose(load: dict[str, tuple[int, int]], before: dict[str, tuple[int, int]]) -> bool:
    """Whether any endpoint's requests or tokens in `load` are above `before` (a pick since)."""
    for hostport, (requests, tokens) in load.items():
        was = before.get(hostport)
        if was is None or requests > was[0] or tokens > was[1]:
            return True
    return False


def parse_peers(text: str) -> list[tuple[str, int]]:
    """`--replica-peers`: "host:port,host:port" ("[ipv6]:port" too) -> [(host, port)]; ValueError naming the bad one."""
    peers = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        host, _, port = item.rpartition(":")
        host = host.removeprefix("[").removesuffix("]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"not host:port: {item!r}")
        peers.append((host, int(port)))
    return peers


def _entry_head(hostport: str) -> bytes:
    """A hostport as a snapshot entry starts: its length and its bytes (b"" when longer than 255 bytes), encoded
    once per hostport (at most MAX_HEADS remembered)."""
    head = _HEADS.get(hostport)
    if head is None:
        name = hostport.encode()
        head = bytes((len(name),)) + name if len(name) < 256 else b""
        if len(_HEADS) < MAX_HEADS:
            _HEADS[hostport] = head
    return head


def encode_load(load: dict[str, tuple[int, int]]) -> bytes:
    """A snapshot's body: entry count, then (hostport length, hostport, requests, tokens) per endpoint; the busiest
    endpoints first when they may not all fit in one datagram."""
    room = SECTION_ROOM - _COUNT.size
    parts, count = [], 0
    items = load.items()
    if len(load) * (256 + _LOAD.size) > room:
        items = sorted(items, key=lambda item: -item[1][0])
    append, pack = parts.append, _LOAD.pack
    for hostport, (requests, tokens) in items:
        head = _entry_head(hostport)
        size = len(head) + _LOAD.size
        if not head or size > room:
            continue
        room -= size
        append(head)
        append(pack(requests if requests < _U32 else _U32, tokens if tokens < _U32 else _U32))
        count += 1
    return _COUNT.pack(count) + b"".join(parts)


def decode_load(body: memoryview) -> dict[str, tuple[int, int]]:
    """The inverse of encode_load; MalformedDatagram for anything that does not parse exactly."""
    try:
        (count,), offset = _COUNT.unpack_from(body), _COUNT.size
        load = {}
        unpack = _LOAD.unpack_from
        for _ in range(count):
            end = offset + 1 + body[offset]
            hostport = str(body[offset + 1 : end], "utf-8")
            load[hostport] = unpack(body, end)
            offset = end + 8
    except (IndexError, struct.error, UnicodeDecodeError):
        raise MalformedDatagram("truncated snapshot") from None
    if offset != len(body):
        raise MalformedDatagram("trailing bytes after a snapshot")
    return load


def _text(value: str) -> bytes:
    """A string as an entry holds it: its length (one byte) and its UTF-8 bytes, cut at 255."""
    data = value.encode("utf-8", "surrogatepass")[:255]
    return bytes((len(data),)) + data


def _optional(value: float | None) -> float:
    return math.nan if value is None else value


def learned_entry(hostport: str, hashes: list[int]) -> bytes:
    """A pick the prefix index recorded: the endpoint and the prompt's block hashes (as many as fit a datagram)."""
    hashes = hashes[: (SECTION_ROOM - _COUNT.size - 256 - _COUNT.size) // 8]
    return _text(hostport) + _COUNT.pack(len(hashes)) + struct.pack(f"!{len(hashes)}Q", *hashes)


def record_entry(request_id: str, ttft: float | None, status: str, served: str | None) -> bytes:
    """An access-log record: request id, TTFT (NaN: none), status, served endpoint ("" none)."""
    return _text(request_id) + _F64.pack(_optional(ttft)) + _text(status) + _text(served or "")


def observation_entry(features: Features, ttft: float, tpot: float | None) -> bytes:
    """What the latency predictor learnt from a request: its features at the pick, its TTFT and TPOT (NaN: none)."""
    f = features
    numbers = _FEATURES.pack(
        *(min(max(v, 0), _U32) for v in (f.waiting, f.running, f.in_flight_tokens, f.prompt_tokens, f.cached_tokens)),
        f.kv_usage,
        f.backlog_tokens,
        f.adapter_loaded,
        ttft,
        _optional(tpot),
    )
    return numbers + _text(f.endpoint)


def page_entry(hostport: str, m: EndpointMetrics, age: float, totals: tuple[float, float] | None) -> bytes:
    """A page this replica read: the endpoint, its metrics, how old they are, the inter-token latency totals read
    with them (None: not at this scrape), its LoRA adapters running and waiting (the first MAX_PAGE_ADAPTERS of
    each, by name)."""
    seconds, gaps = totals if totals is not None else (math.nan, math.nan)
    numbers = _PAGE.pack(
        min(m.waiting, _U32),
        min(m.running, _U32),
        m.kv_usage,
        min(m.block_size or 0, _U32),
        min(m.num_gpu_blocks or 0, _U32),
        -1 if m.max_lora is None else min(m.max_lora, 0x7FFFFFFF),
        min(int(max(age, 0.0) * 1e6), _U32),
        seconds,
        gaps,
    )
    adapters = b"".join(
        bytes((min(len(names), MAX_PAGE_ADAPTERS),)) + b"".join(_text(n) for n in sorted(names)[:MAX_PAGE_ADAPTERS])
        for names in (m.running_adapters, m.waiting_adapters)
    )
    return _text(hostport) + numbers + adapters


def bodies(entries: Sequence[bytes]) -> list[bytes]:
    """Entries as section bodies: each an entry count and entries, as many bodies as keep each within
    SECTION_ROOM."""
    room = SECTION_ROOM - _COUNT.size
    out, batch, used = [], [], 0
    for entry in entries:
        if used + len(entry) > room and batch:
            out.append(_COUNT.pack(len(batch)) + b"".join(batch))
            batch, used = [], 0
        batch.append(entry)
        used += len(entry)
    if batch:
        out.append(_COUNT.pack(len(batch)) + b"".join(batch))
    return out


class _Reader:
    """Reads a body's fields in order; IndexError or struct.error past its end."""

    def __init__(self, body: memoryview):
        self.body, self.offset = body, 0

    def text(self) -> str:
        end = self.offset + 1 + self.body[self.offset]
        if end > len(self.body):
            raise IndexError("text past the end")
        value = str(self.body[self.offset + 1 : end], "utf-8")
        self.offset = end
        return value

    def unpack(self, layout: struct.Struct) -> tuple:
        values = layout.unpack_from(self.body, self.offset)
        self.offset += layout.size
        return values

    def hashes(self) -> list[int]:
        (n,) = self.unpack(_COUNT)
        return list(self.unpack(struct.Struct(f"!{n}Q")))


def _learned(r: _Reader) -> tuple[str, list[int]]:
    return r.text(), r.hashes()


def _record(r: _Reader) -> tuple[str, float | None, str, str | None]:
    request_id, (ttft,), status, served = r.text(), r.unpack(_F64), r.text(), r.text()
    return request_id, None if math.isnan(ttft) else ttft, status, served or None


def _observation(r: _Reader) -> tuple[Features, float, float | None]:
    waiting, running, tokens, prompt, cached, kv, backlog, loaded, ttft, tpot = r.unpack(_FEATURES)
    if not (all(math.isfinite(v) for v in (kv, backlog, ttft)) and ttft > 0 and (math.isnan(tpot) or tpot > 0)):
        raise ValueError("a number out of range")
    features = Features(waiting, running, kv, tokens, prompt, cached, loaded, backlog, r.text())  # or ValueError
    return features, ttft, None if math.isnan(tpot) else tpot


def _page(r: _Reader) -> tuple[str, EndpointMetrics, float, tuple[float, float] | None]:
    hostport = r.text()
    waiting, running, kv, block_size, blocks, max_lora, age, seconds, gaps = r.unpack(_PAGE)
    if not (math.isfinite(kv) and kv >= 0.0) or math.isnan(seconds) != math.isnan(gaps):
        raise ValueError("a number out of range")
    if not math.isnan(seconds) and not (math.isfinite(seconds) and math.isfinite(gaps) and seconds >= 0 <= gaps):
        raise ValueError("inter-token totals out of range")
    running_adapters, waiting_adapters = (frozenset(r.text() for _ in range(r.unpack(_BYTE)[0])) for _ in range(2))
    metrics = EndpointMetrics(
        waiting,
        running,
        kv,
        block_size or None,
        blocks or None,
        None if max_lora < 0 else max_lora,
        running_adapters,
        waiting_adapters,
    )
    return hostport, metrics, age / 1e6, None if math.isnan(seconds) else (seconds, gaps)


def decode(body: memoryview, entry) -> list:
    """A body's entries, each read by `entry` (`_learned`, `_record`, `_observation`); MalformedDatagram for anything
    that does not parse exactly."""
    reader = _Reader(body)
    try:
        (count,) = reader.unpack(_COUNT)
        entries = [entry(reader) for _ in range(count)]
    except (IndexError, ValueError, struct.error, UnicodeDecodeError) as exc:
        raise MalformedDatagram(f"truncated or invalid entries ({exc})") from None
    if reader.offset != len(body):
        raise MalformedDatagram("trailing bytes after the entries")
    return entries


# What each kind of delta section holds, read by
ENTRIES = {LEARNED: _learned, RECORDS: _record, OBSERVED: _observation, PAGES: _page}


def pack(sections: Sequence[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
    """Sections (kind, body; each body at most SECTION_ROOM) as the payloads of as few datagrams as keep each within
    MAX_DATAGRAM_BYTES, in order: (its count of sections, for HEADER; each section's kind, length and body)."""
    room = MAX_DATAGRAM_BYTES - HEADER.size - TAG_BYTES
    out, parts, used = [], [], 0
    for kind, body in sections:
        size = SECTION.size + len(body)
        if parts and (used + size > room or len(parts) == 2 * 255):
            out.append((len(parts) // 2, b"".join(parts)))
            parts, used = [], 0
        parts += (SECTION.pack(kind, len(body)), body)
        used += size
    if parts:
        out.append((len(parts) // 2, b"".join(parts)))
    return out


def unpack(view: memoryview, count: int) -> list[tuple[int, object]]:
    """`count` sections of a datagram's payload, each decoded: (SNAPSHOT, load) or (kind, entries), those of a kind
    it does not know left out; MalformedDatagram for anything that does not parse exactly."""
    sections, offset = [], 0
    for _ in range(count):
        try:
            kind, length = SECTION.unpack_from(view, offset)
        except struct.error:
            raise MalformedDatagram("truncated section") from None
        offset += SECTION.size
        body = view[offset : offset + length]
        offset += length
        if len(body) != length:
            raise MalformedDatagram("truncated section")
        if kind == SNAPSHOT:
            sections.append((kind, decode_load(body)))
        elif kind == TURN:
            if len(body) != _TURN.size:
                raise MalformedDatagram("a turn of the wrong size")
            sections.append((kind, _TURN.unpack(body)))
        elif kind == RELAYED:
            if len(body) < _INSTANCE.size:
                raise MalformedDatagram("truncated relayed snapshot")
            sections.append((kind, (_INSTANCE.unpack_from(body)[0], decode_load(body[_INSTANCE.size :]))))
        elif kind in ENTRIES:
            sections.append((kind, decode(body, ENTRIES[kind])))
        # else: a kind a newer replica sends, skipped whole (its length is known), so that during a rolling update
        # the rest of its datagram (the load, above all) still counts
    if offset != len(view):
        raise MalformedDatagram("trailing bytes after the sections (--replica-secret-file on one side only?)")
    return sections


def _waiter(loop: asyncio.AbstractEventLoop, waiters: list[asyncio.Future]) -> asyncio.Future:
    waiter = loop.create_future()
    waiters.append(waiter)
    return waiter


def _wake(waiters: list[asyncio.Future]) -> None:
    """The picks waiting for a turn go ahead (those whose request was cancelled meanwhile are skipped)."""
    for waiter in waiters:
        if not waiter.done():
            waiter.set_result(None)
    waiters.clear()


class ReplicaChannel(asyncio.DatagramProtocol):
    """This replica's side of the channel: binds `port`, sends to and hears from `peers` ((host, port) pairs),
    merges what they say into the datastore's endpoints and the scheduler's shared prefix index. `load_changed`
    (the director, on every change of its in-flight counts) and `learned` (the prefix index, on every pick it
    records) are its inputs from the request path."""

    def __init__(
        self,
        datastore: Datastore,
        prefix_index: SharedPrefixIndex | None,
        port: int,
        peers: Sequence[tuple[str, int]],
        bind_address: str = "0.0.0.0",
        secret: bytes | None = None,
    ):
        self.datastore, self.prefix_index = datastore, prefix_index
        self.port, self.peers_wanted, self.bind_address = port, list(peers), bind_address
        self.family = socket.AF_INET6 if ":" in bind_address else socket.AF_INET
        self.secret = secret
        self.instance = int.from_bytes(os.urandom(8), "big")
        self.sequence = 0
        self.addresses: list[tuple[str, int]] = []  # resolved peers, this replica's own address(es) left out
        self.allowed: set[tuple[str, int]] = set()  # resolved peers: the only sources heard
        self.own_addresses: set[tuple[str, int]] = set()  # where datagrams with our own instance id came from
        self._resolved: dict[tuple[str, int], list[tuple[str, int]]] = {}  # peer -> its last good resolution
        self._unresolved: set[tuple[str, int]] = set()  # peers whose resolution failed (logged once)
        self.peers: dict[tuple[str, int], Peer] = {}  # source address -> what it said
        self._transport: asyncio.DatagramTransport | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._flush_pending = False
        # the director's release of prompts whose prefill should be over; it returns when the next is due
        self.release_prefilled: Callable[[], float] | None = None
        self._release_at = 0.0  # when the flush that releases the next one is scheduled (0: none)
        self._sent_load: dict[str, tuple[int, int]] | None = {}  # None: send the next snapshot, changed or not
        # kind -> entries to send
        self._deltas: dict[int, list[bytes]] = {LEARNED: [], RECORDS: [], OBSERVED: [], PAGES: []}
        self._send_timer: asyncio.TimerHandle | None = None  # the send of what waits (fallen counts, deltas)
        self._send_at = 0.0  # when it is due
        self._snapshot_at = -math.inf  # when the last snapshot went out
        # the director's match of an access-log record with a request it saw end (a peer forwarded the record)
        self.match_record: Callable[[str, float | None, str, str | None], bool] | None = None
        self.predictor: LatencyPredictor | None = None  # learns from the peers' observations too
        # the scraper's taking of a peer's page as its own (`Scraper.apply_page`): pages are shared when it is set
        self.apply_page: Callable[[Endpoint, EndpointMetrics, tuple[float, float] | None], None] | None = None
        self._page_at: dict[str, float] = {}  # endpoint hostport -> when a peer's page of it last came
        self._owned: dict[str, bool] = {}  # endpoint hostport -> whether this replica reads it for the live replicas
        self.pages = {"sent": 0, "received": 0}  # pages read for the peers, and taken from them
        self._tasks: list[asyncio.Task] = []
        self._rejected_logged: set[tuple[str, str]] = set()
        self.sent = self.sent_bytes = 0
        self.received: dict[str, int] = dict.fromkeys(
            ("accepted", "unknown_peer", "bad_signature", "malformed", "stale", "oversized"), 0
        )
        self.learned_dropped = 0
        # CPU seconds of this thread the channel took, by part (inference_extension_replica_cpu_seconds_total)
        self.cpu: dict[str, float] = dict.fromkeys(CPU_PARTS, 0.0)
        if prefix_index is not None:
            prefix_index.learned = self.learned
        # picks in turns (`turn`, --replica-turns), granted by the sequencer (`_sequencer`)
        self.turns = False
        self._turn_waiters: list[asyncio.Future] = []  # this replica's picks waiting for the turn it asked for
        self._turn_id = 0
        self._turn_from: tuple[str, int] | None = None  # the sequencer it was asked of
        self._turn_timer: asyncio.TimerHandle | None = None
        self._holder: object = None  # sequencer: LOCAL or (source, turn id) of the turn granted
        self._holder_timer: asyncio.TimerHandle | None = None
        self._asks: deque = deque()  # sequencer: the turns asked for, in order (LOCAL: its own picks)
        self._local_waiters: list[asyncio.Future] = []  # sequencer: its own picks waiting for their turn
        self.turn_counts = dict.fromkeys(TURN_OUTCOMES, 0)

    # -- the request path's inputs -------------------------------------------------------------------------------
    def load_changed(self) -> None:
        """This replica's in-flight counts changed: once the event loop's current pass is done, a snapshot goes out
        if a count rose (`_flush`)."""
        if not self._flush_pending and self._loop is not None:
            self._flush_pending = True
            self._loop.call_soon(self._flush)

    def learned(self, hostport: str, hashes: list[int]) -> None:
        """The prefix index recorded a pick of `hostport` for these block hashes: peers record it too."""
        self._queue(LEARNED, learned_entry, hostport, hashes)

    def forward_record(self, request_id: str, ttft: float | None, status: str, served: str | None) -> None:
        """An access-log record that matched none of this replica's requests: peers get it, as it may be theirs
        (the gateway sends its records to any replica); the replica that routed the request learns from it."""
        self._queue(RECORDS, record_entry, request_id, ttft, status, served)

    def observed(self, features: Features, ttft: float, tpot: float | None) -> None:
        """The latency predictor learnt from a request this replica routed: peers' predictors learn from it too, so
        each learns from every request, as one EPP's would."""
        self._queue(OBSERVED, observation_entry, features, ttft, tpot)

    def owns(self, hostport: str) -> bool:
        """Whether this replica reads `hostport`'s page for the live replicas (itself and the peers whose snapshot
        is fresh). Rendezvous hashing with bounded shares: the pool's endpoints, in order, each go to the first
        replica in their own hash order of the instance ids that has fewer than its even share (ceil(n / replicas)),
        so each endpoint has one reader, replicas that hear the same peers and pool agree on which, and the shares
        differ by one at most (plain rendezvous split 8 servers 1/3/4). Recomputed when the live replicas change, when
        an endpoint it has not placed asks (one that joined the pool), and at the heartbeat after endpoints left."""
        owned = self._owned.get(hostport)
        if owned is None:
            ids = [self.instance, *(peer.instance for peer in self.peers.values())]
            hostports = sorted({hostport, *(e.hostport for e in self.datastore.endpoints)})
            share, placed = -(-len(hostports) // len(ids)), dict.fromkeys(ids, 0)
            self._owned = {}
            for h in hostports:
                name = h.encode()
                reader = next(i for i in sorted(ids, key=lambda i: -xxh64_intdigest(name, i)) if placed[i] < share)
                placed[reader] += 1
                self._owned[h] = reader == self.instance
            owned = self._owned[hostport]
        return owned

    def peer_page(self, endpoint: Endpoint, within: float) -> bool:
        """Whether a peer's page of `endpoint`, at most `within` seconds old, stands for this replica's scrape: an
        endpoint another live replica reads. When that page is late (its reader died or its scrapes fail), this
        replica reads the page itself until its reader is heard again or expires and the endpoint moves."""
        hostport = endpoint.hostport
        return not self.owns(hostport) and time.monotonic() - self._page_at.get(hostport, -math.inf) <= within

    def page_read(self, endpoint: Endpoint) -> None:
        """This replica's scraper read `endpoint`'s page: the peers get it when this replica reads it for them."""
        if self.apply_page is None or not self.owns(endpoint.hostport) or endpoint.metrics is None:
            return
        m = endpoint.metrics
        totals = endpoint.inter_token_totals
        read = totals[-1][1:] if totals and totals[-1][0] == m.scraped_at else None
        self._queue(PAGES, page_entry, endpoint.hostport, m, time.monotonic() - m.scraped_at, read)
        self.pages["sent"] += 1

    def peers_busy(self) -> bool:
        """Whether a peer has requests in flight: the pages this replica reads for it must stay fresh."""
        return any(peer.load for peer in self.peers.values())

    def _queue(self, kind: int, entry: Callable[..., bytes], *fields) -> None:
        """Deltas ride in the next datagram for free. A prefix pick waits HOLD_SECONDS at most (a peer's next
        decision may read it). Access-log records and observations wait for the next datagram, the heartbeat
        (HEARTBEAT_SECONDS) at the latest: they only train the peers' predictors, which no decision waits for, and
        sent on their own they were a datagram, and a wakeup of every peer, per request."""
        if self._loop is not None and self.addresses:
            self._deltas[kind].append(entry(*fields))
            if kind == LEARNED:
                self._send_within(HOLD_SECONDS)
            elif kind == PAGES:
                self._send_within(PAGE_HOLD_SECONDS)

    def position(self) -> tuple[int, int]:
        """This replica's rank, by instance id, among itself (it is picking) and the peers heard picking within
        ROUTING_SECONDS, and their count: every routing replica of a pool works out the same ranks
        (`replica-stripe-picker`'s stripes), and one that routes alone, its peers idle or standing by, is not held to
        a stripe."""
        peers = self.peers
        if not peers:
            return 0, 1
        own, since = self.instance, time.monotonic() - ROUTING_SECONDS
        rank = routing = 0
        for p in peers.values():
            if p.picked_at >= since:
                routing += 1
                if p.instance < own:
                    rank += 1
        return rank, routing + 1

    # -- turns ---------------------------------------------------------------------------------------------------
    def _sequencer(self) -> tuple[str, int] | None:
        """The address of the replica that grants turns (the lowest instance id among this one and its fresh peers
        that take turns), None when it is this one. A sequencer that let a turn run out is passed over until its next
        snapshot: one that died is not waited for at every pick until it expires."""
        lowest, address = self.instance, None
        for source, peer in self.peers.items():
            if peer.turns and peer.instance < lowest and peer.unanswered_at <= peer.seen_at:
                lowest, address = peer.instance, source
        return address

    def turn(self) -> asyncio.Future | None:
        """Called by the director before each pick (--replica-turns): None when this replica may pick now, else a
        future its picks await. The sequencer picks at once while no peer holds the turn; any other replica asks the
        sequencer, which grants turns one at a time with the pool's load as it knows it, so each replica's picks see
        every pick granted before them. A replica none of whose peers picked within TURN_ROUTING_SECONDS routes alone
        and does not ask (a standby's or a shadow's sequencer would only add its round trip; a pool's first picks, or
        its first after that long a quiet, go as without turns). Picks that arrive while a turn is asked for share
        it. A turn not granted within TURN_WAIT_SECONDS (the sequencer gone, or slow) is taken anyway: the picks go
        ahead as without turns.
        Each pick gets a future of its own, so one whose request is cancelled leaves the others waiting; the
        caller awaits it directly, so its pick is made in the loop pass that grants the turn, before the turn goes
        back (`_turn_came`)."""
        if not self.turns or not self.peers or self._loop is None:
            return None
        sequencer = self._sequencer()
        if sequencer is not None and not self._turn_waiters and not self._peers_routing():
            self.turn_counts["alone"] += 1
            return None
        if sequencer is None:
            if self._holder is None and not self._asks:
                self.turn_counts["free"] += 1
                return None
            if not self._local_waiters:
                self._asks.append(LOCAL)
                self.turn_counts["queued"] += 1
            return _waiter(self._loop, self._local_waiters)
        if not self._turn_waiters:
            started = thread_time()
            self._turn_id += 1
            self._turn_from = sequencer
            self._send_to(sequencer, [(TURN, _TURN.pack(ASK, self._turn_id))])
            self._turn_timer = self._loop.call_later(TURN_WAIT_SECONDS, self._turn_came, self._turn_id, False)
            self.cpu["send"] += thread_time() - started
        return _waiter(self._loop, self._turn_waiters)

    def _peers_routing(self) -> bool:
        """Whether a peer picked within TURN_ROUTING_SECONDS (a count in its snapshot rose)."""
        since = time.monotonic() - TURN_ROUTING_SECONDS
        return any(peer.picked_at >= since for peer in self.peers.values())

    def _turn_came(self, turn_id: int, granted: bool) -> None:
        """This replica's turn `turn_id` was granted, or its wait ran out (`granted` False)."""
        if turn_id != self._turn_id or not self._turn_waiters:
            if granted and self._turn_from is not None:  # granted after this replica stopped waiting: give it back
                self._send_to(self._turn_from, [(TURN, _TURN.pack(DONE, turn_id))])
            return
        if self._turn_timer is not None:
            self._turn_timer.cancel()
        _wake(self._turn_waiters)
        self.turn_counts["granted" if granted else "timed_out"] += 1
        sequencer = self.peers.get(self._turn_from)
        if not granted and sequencer is not None:
            sequencer.unanswered_at = time.monotonic()
        if granted:  # after the picks that waited for it: the loop's next pass runs them first, in order
            self._loop.call_soon(self._turn_done, turn_id)

    def _turn_done(self, turn_id: int) -> None:
        """This replica's picks in its turn are made: the sequencer gets its load with them, and the turn back."""
        started = thread_time()
        self._send_to(self._turn_from, [(SNAPSHOT, encode_load(self.own_load())), (TURN, _TURN.pack(DONE, turn_id))])
        self.cpu["send"] += thread_time() - started

    def _asked(self, source: tuple[str, int], turn_id: int) -> None:
        """Sequencer: a peer asks for a turn (whoever asks is answered, even while this replica's view of who
        sequences differs from the asker's: the turns it grants are still one at a time)."""
        for index, ask in enumerate(self._asks):
            if ask != LOCAL and ask[0] == source:  # one place per peer: its newer ask (its last one timed out) takes it
                self._asks[index] = (source, turn_id)
                break
        else:
            if len(self._asks) < MAX_PEERS:
                self._asks.append((source, turn_id))
        self._grant_next()

    def _grant_next(self) -> None:
        """Sequencer: the next turn asked for, once the last is over. A peer's grant carries this replica's own load
        and every other peer's as this replica knows it (the last peers' turns' included), so the peer picks seeing
        every pick granted before; the sequencer's own picks take their turn in the same queue."""
        if self._holder is not None or not self._asks:
            return
        holder = self._holder = self._asks.popleft()
        if holder == LOCAL:
            _wake(self._local_waiters)
            self._loop.call_soon(self._turn_over, holder)  # after the picks that waited for it
            return
        source, turn_id = holder
        sections = [(SNAPSHOT, encode_load(self.own_load()))]
        for address, peer in self.peers.items():
            if address != source and peer.load:
                sections.append((RELAYED, _INSTANCE.pack(peer.instance) + encode_load(peer.load)))
        self._send_to(source, [*sections, (TURN, _TURN.pack(GRANT, turn_id))])
        self.turn_counts["given"] += 1
        self._holder_timer = self._loop.call_later(TURN_HOLD_SECONDS, self._turn_over, holder)

    def _turn_over(self, holder) -> None:
        """Sequencer: the turn `holder` held is over (done, or TURN_HOLD_SECONDS gone): the next one's."""
        if self._holder != holder:
            return
        self._holder = None
        if self._holder_timer is not None:
            self._holder_timer.cancel()
            self._holder_timer = None
        self._grant_next()

    # -- sending -------------------------------------------------------------------------------------------------
    def own_load(self) -> dict[str, tuple[int, int]]:
        """This replica's own in-flight requests and prompt tokens per endpoint (the non-zero ones)."""
        load = {}
        for e in self.datastore.endpoints:
            requests = e.in_flight_requests - e.peer_in_flight_requests
            tokens = e.in_flight_tokens - e.peer_in_flight_tokens
            if requests > 0 or tokens > 0:
                load[e.spec.hostport] = (requests if requests > 0 else 0, tokens if tokens > 0 else 0)
        return load

    def _flush(self) -> None:
        """The end of a loop pass that changed the counts. A count that rose (a pick) goes out now, with whatever
        waits: the replicas decide a burst's requests within a millisecond or two of each other, and a pick held
        back arrives after the decisions it was for. Counts that only fell (a first response byte, a prefill due,
        an end) wait up to HOLD_SECONDS for the next datagram: a peer that sees an endpoint busy a few milliseconds
        too long barely moves, and most of them then ride with a pick or each other (`_send_all`)."""
        started = thread_time()
        self._flush_now()
        self.cpu["send"] += thread_time() - started

    def _flush_now(self) -> None:
        self._flush_pending = False
        if self.release_prefilled is not None:
            self._schedule_release(self.release_prefilled())
        load = self.own_load()
        sent = self._sent_load
        if load == sent:
            return
        if sent is not None and not _rose(load, sent):
            self._send_within(HOLD_SECONDS)
            return
        self._send_all(load)

    def _send_within(self, seconds: float) -> None:
        """What waits (fallen counts, deltas) goes out `seconds` from now at the latest."""
        at = time.monotonic() + seconds
        if self._send_timer is None or at < self._send_at:
            if self._send_timer is not None:
                self._send_timer.cancel()
            self._send_at = at
            self._send_timer = self._loop.call_later(seconds, self._send_waiting)

    def _send_waiting(self) -> None:
        started = thread_time()
        self._send_timer = None
        self._send_all(self.own_load())
        self.cpu["send"] += thread_time() - started

    def _send_all(self, load: dict[str, tuple[int, int]], heartbeat: bool = False) -> None:
        """One datagram (more only past MAX_DATAGRAM_BYTES) to each peer: the snapshot if it changed (or on a
        heartbeat), and every waiting delta."""
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        sections = []
        if heartbeat or load != self._sent_load:
            self._sent_load, self._snapshot_at = load, time.monotonic()
            sections.append((SNAPSHOT, encode_load(load)))
            if self.turns:
                sections.append((TURN, _TURN.pack(OFFER, 0)))
        for kind, entries in self._deltas.items():
            if not entries:
                continue
            self._deltas[kind] = []
            if self._transport is not None and self._transport.get_write_buffer_size() > MAX_PENDING_SEND_BYTES:
                self.learned_dropped += len(entries)
                continue
            sections += [(kind, body) for body in bodies(entries)]
        for count, payload in pack(sections):
            self._send(count, payload)

    def _schedule_release(self, due: float) -> None:
        """A release HOLD_SECONDS after the next prompt's prefill is due: peers see it released then, not at this
        replica's next decision (a single EPP releases them when a decision starts, which is all that reads them).
        A release is a fall, which may wait HOLD_SECONDS: one wakeup then sends it, where a wakeup when due and
        another for the fall's hold were two (a datagram in between carries it sooner)."""
        if due and (not self._release_at or due < self._release_at) and self._loop is not None:
            self._release_at = due
            self._loop.call_later(max(0.0, due - time.monotonic()) + HOLD_SECONDS, self._released)

    def _released(self) -> None:
        """The releases due HOLD_SECONDS ago (and since) go out now, with whatever waits."""
        started = thread_time()
        self._release_at = 0.0
        self._schedule_release(self.release_prefilled())
        load = self.own_load()
        if load != self._sent_load:
            self._send_all(load)
        self.cpu["send"] += thread_time() - started

    def _send_to(self, address: tuple[str, int], sections: list[tuple[int, bytes]]) -> None:
        """Sections to one peer (a turn's messages)."""
        for count, payload in pack(sections):
            self._send(count, payload, [address])

    def _send(self, count: int, payload: bytes, addresses: list[tuple[str, int]] | None = None) -> None:
        """One datagram to `addresses` (default: every peer)."""
        transport = self._transport
        addresses = self.addresses if addresses is None else addresses
        if transport is None or not addresses:
            return
        self.sequence += 1
        datagram = HEADER.pack(MAGIC, self.instance, self.sequence, count) + payload
        if self.secret is not None:
            datagram += hmac.digest(self.secret, datagram, hashlib.sha256)[:TAG_BYTES]
        for address in addresses:
            transport.sendto(datagram, address)
        self.sent += len(addresses)
        self.sent_bytes += len(addresses) * len(datagram)

    # -- receiving -----------------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport

    def error_received(self, exc: Exception) -> None:
        pass  # a peer that is not there (yet): its snapshots simply stop counting

    def datagram_received(self, data: bytes, address: tuple) -> None:
        started = thread_time()
        learning = self._receive(data, address)
        self.cpu["receive"] += thread_time() - started - learning
        self.cpu["peer_learning"] += learning

    def _receive(self, data: bytes, address: tuple) -> float:
        """One datagram: checked, then merged; the seconds of CPU its peers' observations took to learn from."""
        source = (address[0], address[1])
        if source not in self.allowed:
            self.received["unknown_peer"] += 1
            return 0.0
        if len(data) > MAX_DATAGRAM_BYTES:
            self.received["oversized"] += 1
            return 0.0
        view = memoryview(data)
        if self.secret is not None:
            if len(data) < HEADER.size + TAG_BYTES or not hmac.compare_digest(
                hmac.digest(self.secret, view[:-TAG_BYTES], hashlib.sha256)[:TAG_BYTES], view[-TAG_BYTES:]
            ):
                self._reject(source, "bad_signature", "its tag does not match --replica-secret-file")
                return 0.0
            view = view[:-TAG_BYTES]
        if len(view) < HEADER.size:
            self._reject(source, "malformed", "too short")
            return 0.0
        magic, instance, sequence, count = HEADER.unpack_from(view)
        if magic != MAGIC:
            self._reject(source, "malformed", "not a replica datagram (another program)")
            return 0.0
        if instance == self.instance:
            self._found_self(source)
            return 0.0
        peer = self.peers.get(source)
        if peer is not None and peer.instance == instance and sequence <= peer.sequence:
            self.received["stale"] += 1
            return 0.0
        try:
            sections = unpack(view[HEADER.size :], count)
        except MalformedDatagram as exc:
            self._reject(source, "malformed", str(exc))
            return 0.0
        if peer is None or peer.instance != instance:
            if peer is None and len(self.peers) >= MAX_PEERS:
                self.received["unknown_peer"] += 1
                return 0.0
            old = peer.load if peer is not None else {}
            peer = self.peers[source] = Peer(instance)
            self._owned.clear()  # the live replicas changed: so may who reads which page
            if old:
                self._apply(old.keys())  # a restarted peer: what its old self had in flight is gone
            self._sent_load = None  # a new peer hears this replica's load now, not at the next heartbeat
            self.load_changed()
        peer.sequence = sequence
        self.received["accepted"] += 1
        learning = 0.0
        for kind, content in sections:
            if kind == SNAPSHOT:
                old, peer.load, peer.seen_at = peer.load, content, time.monotonic()
                if _rose(content, old):
                    peer.picked_at = peer.seen_at
                self._apply([h for h in old.keys() | content.keys() if old.get(h) != content.get(h)])
            elif kind == RELAYED and source == self._turn_from:  # in a grant of the sequencer asked
                instance, load = content
                for other in self.peers.values():
                    if other.instance == instance and other is not peer:
                        old, other.load = other.load, load
                        self._apply([h for h in old.keys() | load.keys() if old.get(h) != load.get(h)])
            elif kind == TURN:
                op, turn_id = content
                if op == OFFER:
                    peer.turns = True
                elif op == ASK:
                    self._asked(source, turn_id)
                elif op == GRANT and source == self._turn_from:
                    self._turn_came(turn_id, True)
                elif op == DONE:
                    self._turn_over((source, turn_id))
            elif kind == LEARNED and self.prefix_index is not None:
                by_hostport = self.datastore.by_hostport
                for hostport, hashes in content:
                    endpoint = by_hostport(hostport)
                    if endpoint is not None and hashes:
                        self.prefix_index.learn(endpoint, hashes)
            elif kind == RECORDS and self.match_record is not None:
                for record in content:
                    self.match_record(*record)
            elif kind == PAGES and self.apply_page is not None:
                now, by_hostport = time.monotonic(), self.datastore.by_hostport
                for hostport, metrics, age, totals in content:
                    endpoint = by_hostport(hostport)
                    if endpoint is not None:
                        metrics.scraped_at = now - age
                        self._page_at[hostport] = now
                        self.apply_page(endpoint, metrics, totals)
                        self.pages["received"] += 1
            elif kind == OBSERVED and self.predictor is not None:
                learning_started = thread_time()
                for features, ttft, tpot in content:
                    self.predictor.observe(features, ttft, tpot, own=False)
                learning += thread_time() - learning_started
        return learning

    def _reject(self, source: tuple[str, int], outcome: str, why: str) -> None:
        self.received[outcome] += 1
        if (source[0], outcome) not in self._rejected_logged and len(self._rejected_logged) < MAX_PEERS:
            self._rejected_logged.add((source[0], outcome))
            log.warning("replica datagram from %s:%d ignored: %s", source[0], source[1], why)

    def _found_self(self, source: tuple[str, int]) -> None:
        if source not in self.own_addresses:
            self.own_addresses.add(source)
            self.addresses = [a for a in self.addresses if a != source]
            log.info("replica channel: %s:%d is this replica; %d peers", *source, len(self.addresses))

    def _apply(self, hostports) -> None:
        """Set each endpoint's share of its peers' load to the sum of their fresh snapshots."""
        peers = self.peers.values()
        by_hostport = self.datastore.by_hostport
        for hostport in hostports:
            endpoint = by_hostport(hostport)
            if endpoint is None:
                continue
            requests = tokens = 0
            for peer in peers:
                load = peer.load.get(hostport)
                if load is not None:
                    requests += load[0]
                    tokens += load[1]
            endpoint.in_flight_requests += requests - endpoint.peer_in_flight_requests
            endpoint.peer_in_flight_requests = requests
            endpoint.in_flight_tokens += tokens - endpoint.peer_in_flight_tokens
            endpoint.peer_in_flight_tokens = tokens

    # -- upkeep --------------------------------------------------------------------------------------------------
    def heartbeat(self) -> None:
        """Drop peers whose last snapshot is too old, bring every endpoint's peer share up to date (endpoints that
        joined since), and resend this replica's snapshot unless one went out within HEARTBEAT_SECONDS (under load
        the picks' datagrams carry it: a heartbeat on top would be one more datagram, and wakeup, for each peer)."""
        started = thread_time()
        now = time.monotonic()
        for source in [s for s, p in self.peers.items() if now - p.seen_at > EXPIRY_SECONDS]:
            del self.peers[source]
            self._owned.clear()
        if len(self._owned) > len(self.datastore.endpoints):  # endpoints left the pool: the shares are dealt again
            self._owned.clear()
        if len(self._page_at) > len(self.datastore.endpoints):  # endpoints that left the pool
            self._page_at = {
                e.hostport: self._page_at[e.hostport] for e in self.datastore.endpoints if e.hostport in self._page_at
            }
        self._apply([e.hostport for e in self.datastore.endpoints])
        if self.release_prefilled is not None:
            self._schedule_release(self.release_prefilled())
        if now - self._snapshot_at >= 0.9 * HEARTBEAT_SECONDS:  # (the loop's timers may fire a millisecond early)
            self._send_all(self.own_load(), heartbeat=True)
        self.cpu["send"] += thread_time() - started

    async def resolve(self) -> None:
        """Each peer's addresses now; a peer that does not resolve keeps its last addresses (logged once)."""
        loop = asyncio.get_running_loop()
        for peer in self.peers_wanted:
            try:
                infos = await loop.getaddrinfo(*peer, family=self.family, type=socket.SOCK_DGRAM)
            except (OSError, UnicodeError) as exc:
                if peer not in self._unresolved:
                    self._unresolved.add(peer)
                    log.warning(
                        "replica peer %s:%d does not resolve (%s); retrying every %gs", *peer, exc, RESOLVE_SECONDS
                    )
                continue
            self._unresolved.discard(peer)
            self._resolved[peer] = sorted({(info[4][0], info[4][1]) for info in infos})
        resolved = list(dict.fromkeys(a for addresses in self._resolved.values() for a in addresses))[:MAX_PEERS]
        if set(resolved) != self.allowed:
            log.info("replica peers: %s", ", ".join(f"{h}:{p}" for h, p in resolved) or "none")
        self.allowed = set(resolved)
        self.addresses = [a for a in resolved if a not in self.own_addresses]
        for source in [s for s in self.peers if s not in self.allowed]:
            self._apply(self.peers.pop(source).load.keys())
            self._owned.clear()

    async def _run(self) -> None:
        next_resolve = 0.0
        while True:
            if time.monotonic() >= next_resolve:
                await self.resolve()
                next_resolve = time.monotonic() + RESOLVE_SECONDS
            self.heartbeat()
            await asyncio.sleep(max(0.001, self._snapshot_at + HEARTBEAT_SECONDS - time.monotonic()))

    async def start(self) -> None:
        await self.resolve()  # first: a peer's datagram that comes as soon as the port is bound counts
        self._loop = asyncio.get_running_loop()
        await self._loop.create_datagram_endpoint(
            lambda: self, local_addr=(self.bind_address, self.port), family=self.family
        )
        self._tasks.append(asyncio.create_task(self._run()))
        log.info("replica channel on udp %s:%d, %d peer addresses", self.bind_address, self.port, len(self.addresses))

    async def stop(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._transport is not None:
            self._transport.close()
        self._loop = None

    def collect(self):
        """inference_extension_replica_*: fresh peers, datagrams sent and received by outcome, deltas dropped."""
        yield from unlabelled(
            GaugeMetricFamily,
            [("inference_extension_replica_peers", "Peer EPP replicas whose load snapshot is fresh.", len(self.peers))],
        )
        yield from unlabelled(
            CounterMetricFamily,
            [
                ("inference_extension_replica_datagrams_sent", "Datagrams sent to peer replicas.", self.sent),
                (
                    "inference_extension_replica_bytes_sent",
                    "Bytes of the datagrams sent to peer replicas (UDP payloads).",
                    self.sent_bytes,
                ),
            ],
        )
        yield one_label(
            CounterMetricFamily,
            "inference_extension_replica_datagrams_received",
            "Datagrams from the replica port, by outcome (accepted; or ignored: unknown_peer, bad_signature, "
            "malformed, stale, oversized).",
            "outcome",
            self.received,
        )
        yield one_label(
            CounterMetricFamily,
            "inference_extension_replica_pages",
            "Model servers' pages this replica read and sent its peers (sent), and took from them (received).",
            "direction",
            self.pages,
        )
        yield one_label(
            CounterMetricFamily,
            "inference_extension_replica_turns",
            "This replica's turns to pick (--replica-turns), by outcome: granted by the sequencer, timed_out (picked "
            "without one), free (the sequencer picked at once), queued (the sequencer's picks waited for a peer's "
            "turn), given (turns the sequencer granted its peers).",
            "outcome",
            self.turn_counts,
        )
        yield one_label(
            CounterMetricFamily,
            "inference_extension_replica_cpu_seconds",
            "CPU seconds the replica channel took on the event loop, by part (send; receive: checking, decoding and "
            "merging peers' datagrams; peer_learning: the latency predictor learning from the peers' observations).",
            "part",
            self.cpu,
        )
        yield from unlabelled(
            CounterMetricFamily,
            [
                (
                    "inference_extension_replica_learned_dropped",
                    "Prefix-index deltas and access-log records not sent: the socket's send buffer was full.",
                    self.learned_dropped,
                )
            ],
        )
