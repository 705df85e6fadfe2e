"""`epp-bench kv-index`: the prefix indexes' memory per entry, and what a huge KV event batch costs the event loop.

Three measurements, side by side in one process:

* memory: bytes per (block hash, endpoint) entry, by tracemalloc, of the KV-event index (`KVBlockIndex`: 8 servers,
  each hash held by one of them, as vLLM's chained hashes make it) and of the approximate index
  (`prefix-cache-scorer`'s per-endpoint LRUs), each filled with `entries` entries;
* stall: a real `KVEventSubscriber` (its thread, a PUB socket in this process) at a cap of `cap` entries, already
  full, receives one batch of `cap` new hashes (every entry evicted). Meanwhile the event loop runs a loop-lag probe
  (a 1 ms timer: how late it fires) and serves a request (a prefix look-up of a 500-block prompt behind a TCP
  round trip, from a client process) every 5 ms; the request's latency is compared with its p50 before the batch;
* steady batches: 500-hash batches applied straight to an index below its cap and to one at its cap (each batch
  evicts 500), mean and worst time per batch.

The stall test runs with the interpreter's thread switch interval at `switch_interval` (default 1,000 s): the
release build's compiled code never gives the GIL up by itself, and so, with that interval, neither does the
pure-Python subscriber; only the index's own yields let the event loop run.
"""

from __future__ import annotations

import asyncio
import gc
import json
import random
import statistics
import subprocess
import sys
import time
import tracemalloc

import msgspec
import zmq

from epp.datalayer import kv_events
from epp.datalayer.endpoint import Endpoint, EndpointSpec
from epp.datalayer.kv_events import KVBlockIndex, KVEventSubscriber
from epp.scheduling.plugins.prefix_cache_scorer import PREFIX_HASHES, PrefixCacheScorer
from epp.scheduling.types import CycleState, SchedulingRequest, SchedulingResult
from protocol.kv_events import BlockStored, KVEventBatch

SERVERS = 8
PROMPT_BLOCKS = 500
# The client process: one request at a time every 5 ms over one connection, latencies (s) printed as JSON.
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
    time.sleep(0.005)
print(json.dumps(out))
"""


def _hashes(count: int, rng: random.Random) -> list[int]:
    return [rng.getrandbits(64) for _ in range(count)]


def memory_per_entry(entries: int) -> dict[str, float]:
    """Bytes per entry of each index, hashes included (the index keeps the ints the events decoded)."""
    rng = random.Random(1)
    endpoints = [f"10.0.0.{i}:8000" for i in range(SERVERS)]
    gc.collect()
    tracemalloc.start()
    start = tracemalloc.get_traced_memory()[0]
    index = KVBlockIndex(max_entries=entries)
    for i in range(entries // 1000):
        index.store(endpoints[i % SERVERS], _hashes(1000, rng))
    precise = (tracemalloc.get_traced_memory()[0] - start) / index.size
    del index
    gc.collect()
    start = tracemalloc.get_traced_memory()[0]
    scorer = PrefixCacheScorer({"lruCapacityPerServer": entries, "autoTune": False})
    pool = [Endpoint(EndpointSpec(name, name.split(":")[0], 8000)) for name in endpoints]
    for i in range(entries // 256):
        state = CycleState()
        state.write(PREFIX_HASHES, _hashes(256, rng))
        scorer.pre_request(SchedulingRequest("r", "m"), SchedulingResult([pool[i % SERVERS]], cycle_state=state))
    approximate = (tracemalloc.get_traced_memory()[0] - start) / scorer.index_size
    tracemalloc.stop()
    return {"kv_index_bytes_per_entry": precise, "approximate_index_bytes_per_entry": approximate}


def steady_batches(cap: int, batches: int) -> dict[str, float]:
    """Seconds per 500-hash batch (mean, max) below the cap and at it."""
    rng = random.Random(2)
    out = {}
    for name, max_entries in (("below", 10 * cap), ("at", cap)):
        index = KVBlockIndex(max_entries=max_entries)
        for i in range(cap // 1000):
            index.store(f"e{i % SERVERS}", _hashes(1000, rng))
        times = []
        for i in range(batches):
            hashes = _hashes(500, rng)
            started = time.perf_counter()
            index.store(f"e{i % SERVERS}", hashes)
            times.append(time.perf_counter() - started)
        out[f"steady_{name}_cap_mean_s"] = statistics.fmean(times)
        out[f"steady_{name}_cap_max_s"] = max(times)
        out[f"steady_{name}_cap_dropped"] = index.dropped_entries
    return out


async def _stall(cap: int) -> dict[str, float]:
    rng = random.Random(3)
    index = KVBlockIndex(max_entries=cap)
    hostport = "127.0.0.1:8000"
    subscriber = KVEventSubscriber(index, "tcp://127.0.0.1:*")
    subscriber.start(Endpoint(EndpointSpec(hostport, "127.0.0.1", 8000)))
    prompt = _hashes(PROMPT_BLOCKS, rng)
    index.store(hostport, prompt)
    index.store(hostport, _hashes(cap - PROMPT_BLOCKS, rng))  # full: the batch below evicts all of these
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


def measure(cap: int, entries: int, batches: int, switch_interval: float) -> dict[str, float]:
    result = memory_per_entry(entries)
    result.update(steady_batches(cap, batches))
    before = sys.getswitchinterval()
    sys.setswitchinterval(switch_interval)
    try:
        result.update(asyncio.run(_stall(cap)))
    finally:
        sys.setswitchinterval(before)
    return result


def main(cap: int, entries: int, batches: int, switch_interval: float) -> None:
    r = measure(cap, entries, batches, switch_interval)
    compiled = kv_events.__file__.endswith(".so")
    print(
        f"epp/datalayer/kv_events compiled: {compiled}; thread switch interval during the stall test "
        f"{switch_interval:g} s\n"
        f"memory per entry ({entries} entries, {SERVERS} servers): KV-event index "
        f"{r['kv_index_bytes_per_entry']:.0f} B, approximate index {r['approximate_index_bytes_per_entry']:.0f} B\n"
        f"500-hash batches: below the cap {1e3 * r['steady_below_cap_mean_s']:.2f} ms mean "
        f"({1e3 * r['steady_below_cap_max_s']:.2f} max), at the cap {1e3 * r['steady_at_cap_mean_s']:.2f} ms mean "
        f"({1e3 * r['steady_at_cap_max_s']:.2f} max, {r['steady_at_cap_dropped']} evicted)\n"
        f"one batch of {cap} new hashes at cap {cap}: applied in {r['stall_apply_s']:.3f} s "
        f"({r['stall_dropped']} evicted); longest loop stall {1e3 * r['stall_max_loop_lag_s']:.1f} ms "
        f"(unloaded {1e3 * r['stall_max_loop_lag_unloaded_s']:.1f} ms); request latency p50 unloaded "
        f"{1e3 * r['stall_request_p50_unloaded_s']:.2f} ms, meanwhile p50 {1e3 * r['stall_request_p50_during_s']:.2f} "
        f"ms max {1e3 * r['stall_request_max_during_s']:.2f} ms ({r['stall_requests_during']} requests)"
    )
