"""`epp-bench kv-index`: the prefix indexes' memory per entry, the cost of a batch at their cap and below it, and
what a huge KV event batch costs the event loop.

Five measurements, side by side in one process:

* memory: bytes per (block hash, endpoint) entry, by tracemalloc, of the KV-event index (`KVBlockIndex`: 8 servers,
  each hash held by one of them, as vLLM's chained hashes make it) and of the approximate index
  (`prefix-cache-scorer`'s per-endpoint LRUs), each filled with `entries` entries;
* steady batches: 500-hash batches applied straight to a KV-event index below its cap and to one at its cap (each
  batch evicts 500), as one event of 500 blocks and as 500 events of one (vLLM's while it decodes), the thread's CPU
  time per batch (mean and worst: the machine's other load moves wall time more), and apart the CPU of the index's
  idle trims after each batch (what the subscriber runs between batches);
* the floor: the bare C dict operations of those batches below the cap (inserts) and at it (inserts, and pops and
  frees of as many of the oldest hashes), and the same for an OrderedDict (the approximate index's LRU): what an
  index evicting on a batch's own path cannot go below;
* steady picks: the approximate index's records of picks of 256-block prompts below its cap and at it (each pick
  evicts 256), CPU time per pick, likewise (a pick runs on the event loop: the longest is its stall), and an
  endpoint's whole LRU dropped when it leaves the pool;
* stall: a real `KVEventSubscriber` (its thread, a PUB socket in this process) at a cap of `cap` entries, already
  full, receives one batch of `cap` new hashes (every entry evicted). Meanwhile the event loop runs a loop-lag probe
  (a 1 ms timer: how late it fires) and serves a request (a prefix look-up of a 500-block prompt, the index's
  newest entries, held until the batch's last chunk evicts them, behind a TCP round trip, from a client process)
  every 2 ms; the request's latency is compared with its p50 before the batch.

The stall test runs with the interpreter's thread switch interval at `switch_interval` (default 1,000 s): the
release build's compiled code never gives the GIL up by itself, and so, with that interval, neither does the
pure-Python subscriber; only the index's own yields let the event loop run.

`against` (another checkout of this repository) measures its `epp/datalayer/kv_events.py` and
`epp/scheduling/plugins/prefix_cache_scorer.py`, loaded beside this checkout's, in the same run: the two
alternate, `rounds` times each, so that the machine's load falls on both alike.
"""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import json
import random
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections import OrderedDict
from itertools import repeat
from pathlib import Path
from types import ModuleType

import msgspec
import zmq

from epp.datalayer import kv_events
from epp.datalayer.endpoint import Endpoint, EndpointSpec
from epp.scheduling.plugins import prefix_cache_scorer
from epp.scheduling.types import CycleState, SchedulingRequest, SchedulingResult
from protocol.kv_events import BlockStored, KVEventBatch

SERVERS = 8
PROMPT_BLOCKS = 500
PICK_BLOCKS = 256
# The client process: one request at a time every 2 ms over one connection, latencies (s) printed as JSON.
CLIENT = """
import json, socket, sys, time
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
out, until = [], time.monotonic() + float(sys.argv[2])
while time.monotonic() < until:
    started = time.monotonic()
    s.sendall(b"?")
    s.recv(16)
    out.append((started, time.monotonic() - started))
    time.sleep(0.002)
print(json.dumps(out))
"""


def _hashes(count: int, rng: random.Random) -> list[int]:
    return [rng.getrandbits(64) for _ in range(count)]


def load(checkout: Path) -> tuple[ModuleType, ModuleType]:
    """Another checkout's KV-event index and approximate index modules, beside this one's (they import the rest of
    the `epp` package from this checkout)."""
    modules = []
    for name, path in (
        ("kv_events", "epp/datalayer/kv_events.py"),
        ("prefix_cache_scorer", "epp/scheduling/plugins/prefix_cache_scorer.py"),
    ):
        if not (checkout / path).is_file():
            raise ValueError(f"no {path} in {checkout}")
        spec = importlib.util.spec_from_file_location(f"against_{name}", checkout / path)
        module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        modules.append(module)
    return modules[0], modules[1]


def _pool() -> list[Endpoint]:
    return [Endpoint(EndpointSpec(f"10.0.0.{i}:8000", f"10.0.0.{i}", 8000)) for i in range(SERVERS)]


def _pick(scorer, endpoint: Endpoint, hashes: list[int]) -> None:
    """`scorer` records a pick of `endpoint` for a prompt of `hashes` (through its own module's state key)."""
    state = CycleState()
    state.write(sys.modules[type(scorer).__module__].PREFIX_HASHES, hashes)
    scorer.pre_request(SchedulingRequest("r", "m"), SchedulingResult([endpoint], cycle_state=state))


def memory_per_entry(entries: int, index_module: ModuleType, scorer_module: ModuleType) -> dict[str, float]:
    """Bytes per entry of each index at its cap of `entries`, hashes included (the index keeps the ints the events
    decoded): once filled, and then after as many again went through it (each entry evicted once: a hash table's
    deleted slots and growth), with the peak over both (a table briefly exists twice while it is rebuilt)."""
    rng = random.Random(1)
    pool = _pool()
    index = index_module.KVBlockIndex(max_entries=entries)
    scorer = scorer_module.PrefixCacheScorer(
        {"maxIndexEntries": entries, "lruCapacityPerServer": entries, "autoTune": False}
    )
    out = {}
    for name, fill, size, per_call in (
        ("kv_index", lambda i: index.store(pool[i % SERVERS].hostport, _hashes(1000, rng)), lambda: index.size, 1000),
        (
            "approximate_index",
            lambda i: _pick(scorer, pool[i % SERVERS], _hashes(PICK_BLOCKS, rng)),
            lambda: scorer.index_size,
            PICK_BLOCKS,
        ),
    ):
        gc.collect()
        tracemalloc.start()
        start = tracemalloc.get_traced_memory()[0]
        for i in range(entries // per_call):
            fill(i)
        out[f"{name}_bytes_per_entry"] = (tracemalloc.get_traced_memory()[0] - start) / size()
        for i in range(entries // per_call):
            fill(i)
        current, peak = tracemalloc.get_traced_memory()
        out[f"{name}_bytes_per_entry_at_cap"] = (current - start) / size()
        out[f"{name}_peak_bytes_per_entry"] = (peak - start) / size()
        tracemalloc.stop()
    return out


def _cpu_per_call(call, arguments: list) -> tuple[float, float]:
    """Mean and worst CPU seconds of `call(*a)` over `arguments`."""
    times = []
    for a in arguments:
        started = time.thread_time()
        call(*a)
        times.append(time.thread_time() - started)
    return statistics.fmean(times), max(times)


def _apply(index, endpoint: str, hashes: list[int], event_blocks: int) -> None:
    for start in range(0, len(hashes), event_blocks):
        index.store(endpoint, hashes[start : start + event_blocks])


def steady_batches(cap: int, batches: int, index_module: ModuleType, event_blocks: int = 500) -> dict[str, float]:
    """CPU seconds per batch of 500 new hashes (mean, max) below the cap and at it, in events of `event_blocks`
    blocks (500: one BlockStored; 1: vLLM's while it decodes, a block at a time); and, apart, the CPU seconds of the
    trims after each batch (`KVBlockIndex.trim`, which the subscriber runs when no batch has come for a while; an
    index without it evicts on the batch's own path)."""
    rng = random.Random(2)
    out = {}
    for name, max_entries in (("below", 10 * cap), ("at", cap)):
        index = index_module.KVBlockIndex(max_entries=max_entries)
        for i in range(cap // 1000):
            index.store(f"e{i % SERVERS}", _hashes(1000, rng))
        trim = getattr(index, "trim", lambda: False)
        while trim():
            pass
        work = [(index, f"e{i % SERVERS}", _hashes(500, rng), event_blocks) for i in range(batches)]
        times, trims = [], []
        for arguments in work:
            started = time.thread_time()
            _apply(*arguments)
            applied = time.thread_time()
            while trim():
                pass
            times.append(applied - started)
            trims.append(time.thread_time() - applied)
        out[f"steady_{name}_cap_mean_s"], out[f"steady_{name}_cap_max_s"] = statistics.fmean(times), max(times)
        out[f"steady_{name}_cap_trim_mean_s"] = statistics.fmean(trims)
        out[f"steady_{name}_cap_dropped"] = index.dropped_entries
    return out


def floor(cap: int, batches: int) -> dict[str, float]:
    """What an index cannot go below at its cap: the bare C operations on a table of `cap` hashes, CPU seconds per
    batch (the sizes, hashes and cap of steady_batches and steady_picks). Below the cap a batch is its inserts; at
    the cap, its inserts and the eviction of as many of the oldest, whose memory is cold by then (a dict: popped,
    their ints freed; an OrderedDict, the approximate index's LRU: popitem of the oldest). The KV-event index's
    ratio at / below, evicting on the batches' own path, can come near `floor_kv_ratio` and no lower; the
    approximate index's near `floor_lru_ratio`."""
    out = {}
    for kind, table, size in (("kv", dict, 500), ("lru", OrderedDict, PICK_BLOCKS)):
        for name in ("below", "at"):
            rng = random.Random(5)
            held, order = table(), []
            for i in range(cap // 1000):
                hashes = _hashes(1000, rng)
                held.update(zip(hashes, repeat(f"e{i % SERVERS}")))
                order += hashes
            if kind == "lru":
                order = None  # the LRU's own order: an evicted int is freed as it goes
            work = [(_hashes(size, rng), f"e{i % SERVERS}") for i in range(batches)]
            times, head = [], 0
            for hashes, endpoint in work:
                started = time.thread_time()
                held.update(zip(hashes, repeat(endpoint)))
                if name == "at" and kind == "kv":
                    oldest = order[head : head + size]
                    order[head : head + size] = repeat(None, size)
                    head += size
                    list(map(held.pop, oldest))
                    del oldest
                elif name == "at":
                    for _ in range(size):
                        held.popitem(last=False)
                if kind == "kv":
                    order += hashes
                times.append(time.thread_time() - started)
            out[f"floor_{kind}_{name}_cap_mean_s"] = statistics.fmean(times)
        out[f"floor_{kind}_ratio"] = out[f"floor_{kind}_at_cap_mean_s"] / out[f"floor_{kind}_below_cap_mean_s"]
    return out


def steady_picks(cap: int, picks: int, scorer_module: ModuleType) -> dict[str, float]:
    """The approximate index: CPU seconds per pick of a new 256-block prompt (mean, max) below its cap and at it (on
    the event loop: the longest is a stall), and those of an endpoint leaving the pool at the cap."""
    rng = random.Random(4)
    out = {}
    pool = _pool()
    for name, max_entries in (("below", 10 * cap), ("at", cap)):
        scorer = scorer_module.PrefixCacheScorer(
            {"maxIndexEntries": max_entries, "lruCapacityPerServer": max_entries, "autoTune": False}
        )
        for i in range(cap // PICK_BLOCKS):
            _pick(scorer, pool[i % SERVERS], _hashes(PICK_BLOCKS, rng))
        size = scorer.index_size
        work = [(scorer, pool[i % SERVERS], _hashes(PICK_BLOCKS, rng)) for i in range(picks)]
        out[f"picks_{name}_cap_mean_s"], out[f"picks_{name}_cap_max_s"] = _cpu_per_call(_pick, work)
        out[f"picks_{name}_cap_dropped"] = size + picks * PICK_BLOCKS - scorer.index_size
    held = scorer.entries(pool[0])
    started = time.thread_time()
    scorer.pool_changed(pool[1:])  # one event-loop call: the endpoint's whole LRU goes
    out["picks_leave_s"], out["picks_leave_entries"] = time.thread_time() - started, held
    return out


async def _stall(cap: int, index_module: ModuleType) -> dict[str, float]:
    rng = random.Random(3)
    index = index_module.KVBlockIndex(max_entries=cap)
    hostport = "127.0.0.1:8000"
    prompt = _hashes(PROMPT_BLOCKS, rng)
    index.store(hostport, _hashes(cap - PROMPT_BLOCKS, rng))  # full: the batch below evicts all of these,
    index.store(hostport, prompt)  # the requests' prompt last, so that their look-ups walk it until the batch ends
    # filled before the subscriber's thread starts: it is the index's one writer from then on (its idle trims)
    subscriber = index_module.KVEventSubscriber(index, "tcp://127.0.0.1:*")
    subscriber.start(Endpoint(EndpointSpec(hostport, "127.0.0.1", 8000)))
    endpoints = [hostport]

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read(1):
            index.prefix_blocks(prompt, endpoints)
            writer.write(b"!")

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    lags: list[tuple[float, float]] = []
    stop = asyncio.Event()

    async def probe() -> None:
        while not stop.is_set():
            started = time.monotonic()
            await asyncio.sleep(0.001)
            lags.append((started, time.monotonic() - started - 0.001))

    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.connect(subscriber.endpoint)
    batch = msgspec.msgpack.encode(
        KVEventBatch(time.time(), [BlockStored(_hashes(cap, rng), None, [0] * 16, 16, None, "GPU")])
    )
    seconds = 4.0
    client = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CLIENT, str(port), str(seconds), stdout=subprocess.PIPE
    )
    probing = asyncio.create_task(probe())
    await asyncio.sleep(1.5)  # unloaded: the requests' p50
    sent = time.monotonic()
    pub.send_multipart([f"kv@{hostport}@m".encode(), (0).to_bytes(8, "big"), batch])
    while subscriber.batches == 0:
        await asyncio.sleep(0.005)
    applied = time.monotonic()
    out, _ = await client.communicate()
    stop.set()
    await probing
    server.close()
    pub.close(linger=0)
    ctx.term()
    await subscriber.close()
    requests = json.loads(out)
    unloaded = [latency for started, latency in requests if started < sent]
    during = [latency for started, latency in requests if sent <= started <= applied] or [0.0]
    return {
        "stall_batch_hashes": cap,
        "stall_apply_s": applied - sent,
        "stall_dropped": index.dropped_entries,
        "stall_max_loop_lag_s": max(lag for started, lag in lags if started >= sent - 0.01),
        "stall_max_loop_lag_unloaded_s": max(lag for started, lag in lags if started < sent),
        "stall_request_p50_unloaded_s": statistics.median(unloaded),
        "stall_request_max_during_s": max(during),
        "stall_request_p50_during_s": statistics.median(during),
        "stall_requests_during": len(during),
    }


def measure(
    cap: int,
    entries: int,
    batches: int,
    switch_interval: float,
    modules: tuple[ModuleType, ModuleType] = (kv_events, prefix_cache_scorer),
) -> dict[str, float]:
    index_module, scorer_module = modules
    result = memory_per_entry(entries, index_module, scorer_module)
    result.update(steady_batches(cap, batches, index_module))
    result.update({f"{key}_1": value for key, value in steady_batches(cap, batches, index_module, 1).items()})
    result.update(steady_picks(cap, batches, scorer_module))
    result.update(floor(cap, batches))
    before = sys.getswitchinterval()
    sys.setswitchinterval(switch_interval)
    try:
        result.update(asyncio.run(_stall(cap, index_module)))
    finally:
        sys.setswitchinterval(before)
    return result


def report(name: str, r: dict[str, float], cap: int, entries: int) -> str:
    ms = 1e3

    def with_trims(events: str) -> float:
        """A batch at the cap and the idle trims after it, over a batch below the cap."""
        at = r[f"steady_at_cap_mean_s{events}"] + r[f"steady_at_cap_trim_mean_s{events}"]
        return at / r[f"steady_below_cap_mean_s{events}"]

    return (
        f"{name}: memory per entry (cap {entries}, {SERVERS} servers), filled / after as many again / peak: "
        f"KV-event index {r['kv_index_bytes_per_entry']:.0f} / {r['kv_index_bytes_per_entry_at_cap']:.0f} / "
        f"{r['kv_index_peak_bytes_per_entry']:.0f} B, approximate index {r['approximate_index_bytes_per_entry']:.0f} / "
        f"{r['approximate_index_bytes_per_entry_at_cap']:.0f} / {r['approximate_index_peak_bytes_per_entry']:.0f} B\n"
        f"  KV-event index, 500-hash batches (CPU): below the cap {ms * r['steady_below_cap_mean_s']:.3f} ms mean "
        f"({ms * r['steady_below_cap_max_s']:.2f} max), at the cap {ms * r['steady_at_cap_mean_s']:.3f} ms mean "
        f"({ms * r['steady_at_cap_max_s']:.2f} max, {r['steady_at_cap_dropped']} evicted): at / below "
        f"{r['steady_at_cap_mean_s'] / r['steady_below_cap_mean_s']:.2f}; with the idle trims between batches "
        f"({ms * r['steady_at_cap_trim_mean_s']:.3f} ms a batch) "
        f"{with_trims(''):.2f}; floor "
        f"(bare dict: 500 inserts and 500 evictions / 500 inserts, {ms * r['floor_kv_at_cap_mean_s']:.3f} / "
        f"{ms * r['floor_kv_below_cap_mean_s']:.3f} ms) {r['floor_kv_ratio']:.2f}\n"
        f"  the same as 500 one-block events (vLLM decoding): below the cap {ms * r['steady_below_cap_mean_s_1']:.3f} "
        f"ms mean ({ms * r['steady_below_cap_max_s_1']:.2f} max), at the cap {ms * r['steady_at_cap_mean_s_1']:.3f} ms "
        f"mean ({ms * r['steady_at_cap_max_s_1']:.2f} max): at / below "
        f"{r['steady_at_cap_mean_s_1'] / r['steady_below_cap_mean_s_1']:.2f}; with the idle trims "
        f"{with_trims('_1'):.2f}\n"
        f"  approximate index, picks of {PICK_BLOCKS} new blocks (CPU, on the event loop): below the cap "
        f"{ms * r['picks_below_cap_mean_s']:.3f} ms mean ({ms * r['picks_below_cap_max_s']:.2f} max), at the cap "
        f"{ms * r['picks_at_cap_mean_s']:.3f} ms mean ({ms * r['picks_at_cap_max_s']:.2f} max, "
        f"{r['picks_at_cap_dropped']} evicted): at / below "
        f"{r['picks_at_cap_mean_s'] / r['picks_below_cap_mean_s']:.2f}; floor (bare OrderedDict, "
        f"{PICK_BLOCKS} inserts and popitems / inserts) {r['floor_lru_ratio']:.2f}; an endpoint of "
        f"{r['picks_leave_entries']} entries leaving the pool {ms * r['picks_leave_s']:.2f} ms\n"
        f"  one batch of {cap} new hashes at cap {cap}: applied in {r['stall_apply_s']:.3f} s "
        f"({r['stall_dropped']} evicted); longest loop stall {ms * r['stall_max_loop_lag_s']:.1f} ms "
        f"(unloaded {ms * r['stall_max_loop_lag_unloaded_s']:.1f} ms); request latency p50 unloaded "
        f"{ms * r['stall_request_p50_unloaded_s']:.2f} ms, meanwhile p50 {ms * r['stall_request_p50_during_s']:.2f} "
        f"ms ({r['stall_request_p50_during_s'] / r['stall_request_p50_unloaded_s']:.2f}x) max "
        f"{ms * r['stall_request_max_during_s']:.2f} ms ({r['stall_requests_during']} requests)"
    )


def main(
    cap: int,
    entries: int,
    batches: int,
    switch_interval: float,
    other: tuple[str, tuple[ModuleType, ModuleType]] | None = None,
    rounds: int = 2,
) -> None:
    """This checkout's indexes measured, or, with `other` (a name and its modules, `load`), both `rounds` times
    each, alternating."""
    print(
        f"epp/datalayer/kv_events compiled: {kv_events.__file__.endswith('.so')}; thread switch interval during the "
        f"stall test {switch_interval:g} s; load {_load()}"
    )
    targets = [("this checkout", (kv_events, prefix_cache_scorer))]
    if other is not None:
        targets.append(other)
    for round_ in range(rounds if other is not None else 1):
        for name, modules in targets if round_ % 2 == 0 else targets[::-1]:
            print(report(name, measure(cap, entries, batches, switch_interval, modules), cap, entries), flush=True)
    print(f"load {_load()}")


def _load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])
