"""`epp-bench replica-channel`: what sharing costs a replica per request, the replica channel alone
(epp/replicas.py: encode, HMAC, send, receive, verify, decode, apply; the event loop's wakeups for it).

N processes play N EPP replicas, each on its own event loop (uvloop, as the EPP), with the parts of an EPP the
channel reads and feeds: a pool of `servers` endpoints, the approximate prefix index (prefix-cache-scorer) and the
latency predictor. Each routes its share of a Poisson stream of `rate` requests a second as the director does, minus
the scheduling: a pick (in-flight request and prompt tokens on the least loaded endpoint, its `blocks` block hashes
recorded in the prefix index, the predictor's `routed`), the first byte FIRST_BYTE_SECONDS later (the prompt's tokens
released), the end END_SECONDS later (the request released, the predictor's `observe`), and for two requests in
three an access-log record forwarded to the peers (the gateway sends it to any replica). The same stream runs twice,
the replicas sharing (ReplicaChannel on loopback UDP, signed) and not: the difference of their CPU (user + system,
all N summed) per request is what sharing costs, with the receivers' work on what their peers send (the peers'
block hashes in each prefix index, their observations in each predictor, their load in the endpoints' counts).
Reported beside it: datagrams and bytes sent per request and per peer.

What it leaves out: scheduling and the ext_proc stream (the same with or without sharing), and what the predictor
costs once trained from every request (one EPP pays that too; unshared replicas of a small pool may never train).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import random
import resource
import time
from dataclasses import dataclass

from epp.datalayer.datastore import Datastore
from epp.datalayer.endpoint import Endpoint, EndpointSpec, PoolState
from epp.predictor import LatencyPredictor
from epp.replicas import ReplicaChannel
from epp.scheduling.plugins.prefix_cache_scorer import PrefixCacheScorer
from harness.bench.ports import free_ports

FIRST_BYTE_SECONDS = 0.04
END_SECONDS = 0.25
PROMPT_TOKENS = 3000
START_SECONDS = 1.0  # once all are up, for the replicas to hear each other (and themselves) before the measured run
SECRET = b"epp-bench replica-channel"


@dataclass
class Replica:
    """One replica's measured run: requests it routed, its CPU seconds, datagrams and bytes it sent, accepted."""

    requests: int = 0
    cpu: float = 0.0
    sent: int = 0
    sent_bytes: int = 0
    accepted: int = 0


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _replica(
    index: int, ports: list[int], sharing: bool, rate: float, duration: float, servers: int, blocks: int, ready
):
    datastore = Datastore([])
    datastore.apply(PoolState(endpoints=tuple(EndpointSpec(f"e{i}", "127.0.0.1", 8000 + i) for i in range(servers))))
    prefix, predictor = PrefixCacheScorer({}), LatencyPredictor()
    channel = None
    if sharing:
        peers = [("127.0.0.1", port) for port in ports]
        channel = ReplicaChannel(datastore, prefix, ports[index], peers, "127.0.0.1", SECRET)
        predictor.observed = channel.observed
        await channel.start()
    # every replica's socket bound before any measures: a process that started late (a busy host) missed what its
    # peers sent it meanwhile
    await asyncio.to_thread(ready.wait, 60)
    loop = asyncio.get_running_loop()
    rng = random.Random(index)
    conversations = [[rng.getrandbits(64) for _ in range(blocks)] for _ in range(16)]

    def changed() -> None:
        if channel is not None:
            channel.load_changed()

    def first_byte(e: Endpoint) -> None:
        e.in_flight_tokens -= PROMPT_TOKENS
        changed()

    def end(e: Endpoint, features, number: int) -> None:
        e.in_flight_requests -= 1
        changed()
        predictor.observe(features, FIRST_BYTE_SECONDS, 0.01)
        if channel is not None and number % 3:
            channel.forward_record(f"r{index}-{number}", FIRST_BYTE_SECONDS, "200", e.hostport)

    await asyncio.sleep(START_SECONDS)
    result = Replica()
    own_rate = rate / len(ports)
    before, started = _cpu(), time.monotonic()
    at = started + rng.expovariate(own_rate)
    while at < started + duration:
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        e = min(datastore.endpoints, key=lambda e: (e.in_flight_requests, rng.random()))
        e.in_flight_requests += 1
        e.in_flight_tokens += PROMPT_TOKENS
        changed()
        hashes = conversations[rng.randrange(16)]
        hashes.append(rng.getrandbits(64))  # a conversation's next turn: its prompt grows by a block
        prefix.learn(e, hashes[-blocks:])  # the pick recorded (pre_request), sharing or not
        if prefix.learned is not None:
            prefix.learned(e.hostport, hashes[-blocks:])
        features = predictor.routed(e, PROMPT_TOKENS, 0, None)
        loop.call_later(FIRST_BYTE_SECONDS, first_byte, e)
        loop.call_later(END_SECONDS, end, e, features, result.requests)
        result.requests += 1
        at += rng.expovariate(own_rate)
    await asyncio.sleep(END_SECONDS + 0.1)  # the last ones end, and what they sent is received
    result.cpu = _cpu() - before
    if channel is not None:
        result.sent, result.sent_bytes, result.accepted = channel.sent, channel.sent_bytes, channel.received["accepted"]
        await channel.stop()
    return result


def _process(index, ports, sharing, rate, duration, servers, blocks, ready, results) -> None:
    import uvloop

    results.put((index, uvloop.run(_replica(index, ports, sharing, rate, duration, servers, blocks, ready))))


def run(replicas: int, sharing: bool, rate: float, duration: float, servers: int, blocks: int) -> list[Replica]:
    """One measured run: `replicas` processes, sharing or not; each one's Replica."""
    context = multiprocessing.get_context("spawn")
    results, ready = context.Queue(), context.Barrier(replicas)
    ports = free_ports(replicas)
    processes = [
        context.Process(target=_process, args=(i, ports, sharing, rate, duration, servers, blocks, ready, results))
        for i in range(replicas)
    ]
    for p in processes:
        p.start()
    out = dict(results.get(timeout=duration + 60) for _ in processes)
    for p in processes:
        p.join(10)
    return [out[i] for i in range(replicas)]


def main(replicas: int, rates: list[float], duration: float, servers: int, blocks: int, rounds: int) -> None:
    """Each rate: `rounds` pairs of runs (not sharing, sharing), and the added CPU per request of each pair."""
    print(
        f"{replicas} replicas, {servers} endpoints, {blocks} block hashes a prompt, {duration:g} s a run; "
        "CPU summed over the replicas, per request routed"
    )
    print("| rate | round | not sharing | sharing | added | datagrams a request a peer | bytes a request a peer |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for rate in rates:
        for round_ in range(rounds):
            alone, shared = (run(replicas, sharing, rate, duration, servers, blocks) for sharing in (False, True))
            per_request = [1e3 * sum(r.cpu for r in rs) / max(1, sum(r.requests for r in rs)) for rs in (alone, shared)]
            requests, peers = sum(r.requests for r in shared), replicas - 1
            print(
                f"| {rate:g} | {round_ + 1} | {per_request[0]:.3f} ms | {per_request[1]:.3f} ms | "
                f"+{per_request[1] - per_request[0]:.3f} ms | {sum(r.sent for r in shared) / requests / peers:.2f} | "
                f"{sum(r.sent_bytes for r in shared) / requests / peers:.0f} |"
            )
