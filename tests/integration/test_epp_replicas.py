"""Active-active EPP replicas: three EPPs behind one Envoy, each subscribed to every server's KV events (the servers
bind their publishers, the EPPs connect), agree on where prefixes are without talking to each other, and one of them
killed mid-run loses no request (FailOpen: Envoy serves a request whose EPP died from the pool, and ejects the
dead replica)."""

import asyncio
import os
import re
import signal

import aiohttp

from tests.integration.conftest import FAST_SIM

CONTEXT = "You are a helpful assistant. Answer the question concisely and accurately, and explain your reasoning. "


async def epp_metric(session: aiohttp.ClientSession, url: str, name: str) -> float:
    async with session.get(url) as r:
        match = re.search(rf"^{name} (\S+)$", await r.text(), re.M)
    return float(match.group(1)) if match else 0.0


async def test_three_replicas_share_the_index_and_survive_one_killed(make_stack):
    stack = await make_stack(
        servers=3, epp_replicas=3, fail_open=True, modelserver_args=[*FAST_SIM, "--disable-log-stats"]
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
