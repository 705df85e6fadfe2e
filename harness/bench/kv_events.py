"""`epp-bench kv-events`: what the model servers' KV events cost the EPP, and how fresh its index is.

One EPP process (the default profile, so its KV-event subscriber runs) with a pool of N endpoints; this process
plays N vLLM servers: each publishes on its own topic `kv@<address:port>@<model>` (a PUB socket bound beside the
server's port, to which the EPP subscribes; vLLM's wire format) what a server does at `rate` requests per second of `prompt_tokens`-token prompts:
every engine step (`step_ms`) one batch with a BlockStored per request that finished its prefill in that step (its
blocks, parent hash and token ids, as vLLM sends them) and, once its `num_gpu_blocks` are full, a BlockRemoved of
as many old blocks. Measured side by side in one EPP: its CPU over a window without events, then with them (the
difference is the events' cost), and the delay from each batch's `ts` (stamped when the step ends) to its
application in the index (the EPP's inference_extension_kv_events_lag_seconds histogram, read before and after).

`late_join` instead: the servers ran before this EPP (each sends one batch, numbered LATE_SEQ) and it asks each one's
replay socket for its history (`--kv-events-replay-port-offset`), which does not answer: measured, how long after
the first of those batches was sent all of them were in the index. Replays that wait one after another took a replay
timeout (1 s) per server; side by side, about one in all.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import msgspec
import yaml
import zmq

from harness.bench.overhead import bucket_quantile, cpu_seconds, histogram_buckets
from harness.bench.ports import free_port_block, free_ports
from harness.local import epp_command, wait_until_serving
from protocol.kv_events import BlockRemoved, BlockStored, KVEventBatch, request_block_hashes

LAG = "inference_extension_kv_events_lag_seconds"
HASH_SEED = "0"
LATE_SEQ = 1000  # a late joiner's first sequence number heard from each server
_GAUGE = re.compile(r"^(inference_extension_kv_events_\w+) (\S+)$", re.M)


def _scrape(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def _lag_quantile(before: str, after: str, q: float) -> float:
    """The upper bound (seconds) of the histogram bucket holding quantile q of the observations between scrapes."""
    start, end = histogram_buckets(before, LAG), histogram_buckets(after, LAG)
    return bucket_quantile({bound: count - start.get(bound, 0.0) for bound, count in end.items()}, q)


def _publisher(
    endpoint: str,
    topic: str,
    rate: float,
    prompt_tokens: int,
    num_gpu_blocks: int,
    step: float,
    until: float,
    seed: int,
    first_seq: int = 0,
    sent: list[float] | None = None,
) -> None:
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.bind(endpoint)  # as vLLM's tcp://*:5557: the EPP subscribes to each server's publisher
    time.sleep(1.5)  # the EPP's connection (it retries a missing publisher up to a second apart), then messages
    rng = random.Random(seed)
    encode = msgspec.msgpack.Encoder().encode
    blocks_per_request = prompt_tokens // 16
    tokens = [rng.randrange(32000) for _ in range(blocks_per_request * 16)]  # what they are does not matter here
    # but a sequence's first block hashes as the EPP (PYTHONHASHSEED 0) hashes it: it checks a server's seed on it
    first = request_block_hashes(tokens[:16], 16, hash_seed=HASH_SEED)[0]
    held: list[int] = []
    seq, next_arrival = first_seq, time.monotonic()
    while time.monotonic() < until:
        started = time.monotonic()
        events: list = []
        while next_arrival <= started:
            next_arrival += rng.expovariate(rate)
            hashes = [first] + [rng.getrandbits(64) for _ in range(blocks_per_request - 1)]
            events.append(BlockStored(hashes, None, tokens, 16, None, "GPU"))
            held += hashes
            if len(held) > num_gpu_blocks:
                evicted, held = held[: len(held) - num_gpu_blocks], held[len(held) - num_gpu_blocks :]
                events.append(BlockRemoved(evicted, "GPU"))
        if events:
            pub.send_multipart((topic.encode(), seq.to_bytes(8, "big"), encode(KVEventBatch(time.time(), events))))
            seq += 1
            if sent is not None:  # a late joiner's test: this one batch, heard in mid-sequence
                sent.append(time.monotonic())
                break
        time.sleep(max(0.0, step - (time.monotonic() - started)))
    time.sleep(max(0.0, until - time.monotonic()))
    pub.close(linger=1000)


def measure(
    servers: int,
    rate: float,
    prompt_tokens: int,
    seconds: float,
    num_gpu_blocks: int,
    step_ms: float,
    late_join: bool = False,
) -> dict:
    with tempfile.TemporaryDirectory(prefix="epp-kv-events-") as tmp:
        workdir = Path(tmp)
        grpc, health, metrics = free_ports(3)
        first = free_port_block(servers)
        server_ports = list(range(first, first + servers))  # nothing listens there: only the pool names them
        publisher_offset = free_port_block(servers) - first  # each server's publisher: its port + the offset
        pool = workdir / "pool.yaml"
        pool.write_text(
            yaml.safe_dump(
                {
                    "endpoints": [
                        {"name": f"ms-{i}", "address": "127.0.0.1", "port": p} for i, p in enumerate(server_ports)
                    ]
                }
            )
        )
        log = (workdir / "epp.log").open("wb")
        argv = epp_command(str(pool), "127.0.0.1", grpc, health, metrics, 1)
        # Nothing serves the pool's metrics pages: read every 50 ms, their refused connections were most of the EPP's
        # CPU with 256 endpoints (58-68 % of a core without events) and drowned the events' cost in their noise.
        argv += ["--kv-events-connect-port-offset", str(publisher_offset), "--refresh-metrics-interval", "5s"]
        if late_join:  # where nothing listens: each replay runs to its timeout
            argv += ["--kv-events-replay-port-offset", str(free_port_block(servers) - first)]
        epp = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONHASHSEED": HASH_SEED}
        )
        log.close()
        url = f"http://127.0.0.1:{metrics}/metrics"
        try:
            wait_until_serving(epp, url, workdir / "epp.log", timeout=30)
            time.sleep(1.0)
            cpu_before, started = cpu_seconds(epp.pid), time.monotonic()
            time.sleep(0.0 if late_join else seconds)  # (a late joiner's test measures no CPU)
            idle_cpu = (cpu_seconds(epp.pid) - cpu_before) / (time.monotonic() - started)
            until = time.monotonic() + 2.0 + seconds  # after the 2 s the publishers take to be connected to
            sent: list[float] = []
            threads = [
                threading.Thread(
                    target=_publisher,
                    args=(
                        f"tcp://127.0.0.1:{p + publisher_offset}",
                        f"kv@127.0.0.1:{p}@m",
                        rate,
                        prompt_tokens,
                        num_gpu_blocks,
                        step_ms / 1e3,
                        until,
                        i,
                        LATE_SEQ if late_join else 0,
                        sent if late_join else None,
                    ),
                )
                for i, p in enumerate(server_ports)
            ]
            for t in threads:
                t.start()
            time.sleep(2.0)  # the publishers bound and connected to
            all_in = _first_batches_applied(url, servers, until) if late_join else None
            before = _scrape(url)
            cpu_before, started = cpu_seconds(epp.pid), time.monotonic()
            for t in threads:
                t.join()
            elapsed = time.monotonic() - started
            events_cpu = (cpu_seconds(epp.pid) - cpu_before) / elapsed
            time.sleep(0.2)
            after = _scrape(url)
            values = {name: float(v) for name, v in _GAUGE.findall(after)}
            previous = {name: float(v) for name, v in _GAUGE.findall(before)}
            return {
                "servers": servers,
                "rate_per_server": rate,
                "prompt_tokens": prompt_tokens,
                "seconds": elapsed,
                "batches_per_s": (
                    values["inference_extension_kv_events_batches_total"]
                    - previous["inference_extension_kv_events_batches_total"]
                )
                / elapsed,
                "events_per_s": (
                    values["inference_extension_kv_events_events_total"]
                    - previous["inference_extension_kv_events_events_total"]
                )
                / elapsed,
                "gaps": values["inference_extension_kv_events_gaps_total"],
                "index_entries": values["inference_extension_kv_events_index_entries"],
                "cpu_idle_core_share": idle_cpu,
                "cpu_with_events_core_share": events_cpu,
                "cpu_events_core_share": events_cpu - idle_cpu,
                "lag_p50_le_s": _lag_quantile(before, after, 0.5),
                "lag_p99_le_s": _lag_quantile(before, after, 0.99),
                "late_join": late_join,
                "first_batches_applied_s": None if all_in is None or not sent else all_in - min(sent),
            }
        finally:
            epp.terminate()
            epp.wait(10)


def _first_batches_applied(url: str, servers: int, until: float) -> float | None:
    """When (time.monotonic()) the EPP had applied `servers` batches, one from each server in a late joiner's test
    (its batches counter polled every 10 ms); None if not before `until`."""
    while time.monotonic() < until:
        found = dict(_GAUGE.findall(_scrape(url)))
        if float(found.get("inference_extension_kv_events_batches_total", 0)) >= servers:
            return time.monotonic()
        time.sleep(0.01)
    return None


def report(r: dict) -> None:
    """What `measure` found, printed."""
    if r["late_join"]:
        took = r["first_batches_applied_s"]
        print(
            f"late join, {r['servers']} servers, no replay socket answering: their first batches all in the index "
            + ("not within the run" if took is None else f"{took:.2f} s after the first was sent")
        )
        return
    print(
        f"{r['servers']} servers x {r['rate_per_server']:g} req/s of {r['prompt_tokens']}-token prompts for "
        f"{r['seconds']:.1f} s: {r['batches_per_s']:.0f} batches/s, {r['events_per_s']:.0f} events/s, gaps "
        f"{r['gaps']:.0f}, index {r['index_entries']:.0f} entries\n"
        f"EPP CPU: {100 * r['cpu_idle_core_share']:.1f} % of a core without events, "
        f"{100 * r['cpu_with_events_core_share']:.1f} % with them: the events cost "
        f"{100 * r['cpu_events_core_share']:.1f} % of a core\n"
        f"step -> index delay: p50 <= {1e3 * r['lag_p50_le_s']:g} ms, p99 <= {1e3 * r['lag_p99_le_s']:g} ms "
        "(histogram bucket bounds)"
    )
