"""Active-active EPP replicas: three EPPs behind one Envoy place a burst as one EPP would (they share their
in-flight load over the replica channel, epp/replicas.py), agree on where prefixes are (each subscribed to every
server's KV events: the servers bind their publishers, the EPPs connect), and one of them killed mid-run loses no
request (FailOpen: Envoy serves a request whose EPP died from the pool, and ejects the dead replica)."""

import asyncio
import os
import re
import signal

import aiohttp
import pytest

from tests.conftest import metric_value
from tests.integration.conftest import FAST_SIM

_QUEUED = re.compile(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} (\S+)$", re.M)
CONTEXT = "You are a helpful assistant. Answer the question concisely and accurately, and explain your reasoning. "


async def epp_metric(session: aiohttp.ClientSession, url: str, name: str) -> float:
    async with session.get(url) as r:
        return metric_value(await r.text(), name)


async def server_loads(session: aiohttp.ClientSession, urls: list[str]) -> list[int]:
    """Requests running or waiting at each server, from its own metrics."""
    loads = []
    for url in urls:
        async with session.get(f"{url}/metrics") as r:
            page = await r.text()
        loads.append(sum(int(float(v)) for v in _QUEUED.findall(page)))
    return loads


@pytest.mark.timing  # the burst's requests 80 ms apart: each replica must hear of the others' picks within that
async def test_three_replicas_place_a_burst_as_one_share_the_index_and_survive_one_killed(make_stack):
    # Scrapes far apart: what the replicas know of a burst between two scrapes is only what they routed and heard
    stack = await make_stack(
        servers=3,
        epp_replicas=3,
        fail_open=True,
        modelserver_args=[*FAST_SIM, "--disable-log-stats"],
        epp_args=["--refresh-metrics-interval", "10s", "--metrics-staleness-threshold", "60s"],
    )
    url = f"{stack.gateway_url}/v1/completions"
    statuses, cached = [], []
    name = "inference_extension_kv_events_index_entries"
    async with aiohttp.ClientSession() as session:
        # A ZMQ subscriber gets only what is published after its subscription reached the publisher: on a loaded
        # machine one replica may still be joining when the first requests run, and the events it missed never come
        # (vLLM's replay buffer is for gaps it can see). So start from one state that every replica saw: clear the
        # servers' caches (AllBlocksCleared), store one prompt, and repeat until all three hold the same entries.
        for attempt in range(40):
            for server in stack.model_server_urls:
                async with session.post(f"{server}/reset_prefix_cache") as r:
                    assert r.status == 200
            warm_up = {"model": stack.config.model, "prompt": CONTEXT * 4 + f"warm-up {attempt}", "max_tokens": 1}
            async with session.post(url, json=warm_up) as r:
                assert r.status == 200
            await asyncio.sleep(0.2)
            entries = [await epp_metric(session, u, name) for u in stack.epp_metrics_urls]
            if entries[0] > 0 and len(set(entries)) == 1:
                break
        else:
            raise AssertionError(f"the replicas never agreed on a warm-up prompt's blocks: {entries}")

        # A burst of 6 long requests, 80 ms apart, 2 through each replica (Envoy's round robin): one EPP puts 2 on
        # each server; replicas that knew only their own would each leave out one server of their choosing (a tie),
        # 2/2/2 only 2 times in 9.
        for _ in range(100):  # each replica has heard from the other two (a heartbeat, every 0.5 s, at the latest)
            peers = [await epp_metric(session, u, "inference_extension_replica_peers") for u in stack.epp_metrics_urls]
            if peers == [2, 2, 2]:
                break
            await asyncio.sleep(0.05)
        assert peers == [2, 2, 2]
        burst = []
        for i in range(6):
            body = {"model": stack.config.model, "prompt": f"Burst {i}. " + CONTEXT, "max_tokens": 800}
            burst.append(asyncio.create_task(session.post(url, json=body)))
            await asyncio.sleep(0.08)
        await asyncio.sleep(0.1)
        assert sorted(await server_loads(session, stack.model_server_urls)) == [2, 2, 2]
        for response in await asyncio.gather(*burst):
            assert response.status == 200
            response.release()

        async def one(tenant: int, question: int) -> None:
            body = {
                "model": stack.config.model,
                "prompt": f"Tenant {tenant}. " + CONTEXT * 12 + f"Question {question}: what is the capital of France?",
                "max_tokens": 4,
            }
            async with session.post(url, json=body) as r:
                statuses.append(r.status)
                if r.status == 200:
                    usage = (await r.json())["usage"]
                    if question > 0:
                        cached.append(usage["prompt_tokens_details"]["cached_tokens"] / usage["prompt_tokens"])

        for question in range(8):
            if question == 3:
                os.kill(stack.processes["epp-1"].pid, signal.SIGKILL)  # one replica dies mid-run
            await asyncio.gather(*(one(tenant, question) for tenant in range(6)))
        assert statuses == [200] * 48
        # each tenant's later requests found its context (random placement: one time in three)
        assert sorted(cached)[len(cached) // 4] > 0.8, cached
        urls = [stack.epp_metrics_urls[0], stack.epp_metrics_urls[2]]
        for _ in range(50):  # the surviving replicas hold the same index: the servers' events, not their own picks
            entries = [await epp_metric(session, u, name) for u in urls]
            if entries[0] == entries[1] > 0:
                break
            await asyncio.sleep(0.05)
        assert entries[0] == entries[1] > 0
