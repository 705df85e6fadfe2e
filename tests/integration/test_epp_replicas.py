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
    async with aiohttp.ClientSession() as session:

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
        name = "inference_extension_kv_events_index_entries"
        for _ in range(50):  # the surviving replicas hold the same index: the servers' events, not their own picks
            entries = [await epp_metric(session, u, name) for u in urls]
            if entries[0] == entries[1] > 0:
                break
            await asyncio.sleep(0.05)
        assert entries[0] == entries[1] > 0
