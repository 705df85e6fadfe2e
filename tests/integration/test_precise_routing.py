"""Precise prefix routing end to end: sim servers publish their KV events to the EPP (epp-local's default wiring),
the EPP tokenizes and hashes each prompt exactly as the servers do, and a prompt goes where its prefix is cached."""

import asyncio
import re

import aiohttp

from tests.conftest import metric_value
from tests.integration.conftest import FAST_SIM

PRECISE_ONLY = """\
plugins:
- type: precise-prefix-cache-scorer
schedulingProfiles:
- name: precise
  plugins:
  - pluginRef: precise-prefix-cache-scorer
"""
CONTEXT = "You are a helpful assistant. Answer the question concisely and accurately, and explain your reasoning. "


async def epp_metric(session: aiohttp.ClientSession, stack, name: str) -> float:
    async with session.get(stack.epp_metrics_url) as r:
        return metric_value(await r.text(), name)


async def epp_running(session: aiohttp.ClientSession, stack) -> float:
    async with session.get(stack.epp_metrics_url) as r:
        running = re.findall(r"^inference_objective_running_requests\{[^}]*\} (\S+)$", await r.text(), re.M)
    return sum(float(v) for v in running)


async def complete(session, stack, prompt: str) -> dict:
    body = {"model": stack.config.model, "prompt": prompt, "max_tokens": 2}
    async with session.post(f"{stack.gateway_url}/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return (await r.json())["usage"]


async def wait_for_every_publisher(session: aiohttp.ClientSession, stack) -> None:
    """Until each server's events reach the EPP. A ZMQ subscriber gets only what is published after its subscription
    reached the publisher: on a loaded machine a server may still be joining when the first request runs, and the
    batch it published before then comes back only with its next one (the late joiner's replay). So each server
    stores prompts sent to it directly (each new from its first block) until the EPP's index grows."""
    name = "inference_extension_kv_events_index_entries"
    for server in stack.model_server_urls:
        for attempt in range(100):
            entries = await epp_metric(session, stack, name)
            body = {
                "model": stack.config.model,
                "prompt": f"Warm-up {attempt} of {server}. " + CONTEXT * 2,
                "max_tokens": 1,
            }
            async with session.post(f"{server}/v1/completions", json=body) as r:
                assert r.status == 200
            await asyncio.sleep(0.05)
            if await epp_metric(session, stack, name) > entries:
                break
        else:
            raise AssertionError(f"{server}'s KV events never reached the EPP")


async def test_a_prompt_goes_where_the_servers_events_say_its_prefix_is(make_stack):
    stack = await make_stack(servers=3, config_text=PRECISE_ONLY, modelserver_args=[*FAST_SIM, "--disable-log-stats"])
    async with aiohttp.ClientSession() as session:
        await wait_for_every_publisher(session, stack)
        hits = []
        for tenant in range(6):
            context = f"Tenant {tenant}. " + CONTEXT * (12 if tenant % 2 else 100)  # 100: over threadPromptChars
            entries = await epp_metric(session, stack, "inference_extension_kv_events_index_entries")
            await complete(session, stack, context + "What is the capital of France?")
            for _ in range(100):  # the first request's blocks reach the EPP's index (events, then applied)
                if await epp_metric(session, stack, "inference_extension_kv_events_index_entries") > entries:
                    break
                await asyncio.sleep(0.02)
            for _ in range(100):  # and the EPP has seen the first response end (when Envoy closes its ext_proc
                # stream, just after the client's last byte): else the holder counts one request in flight and the
                # load guard may send the second elsewhere
                if await epp_running(session, stack) == 0:
                    break
                await asyncio.sleep(0.01)
            usage = await complete(session, stack, context + "How many days are there in a year?")
            hits.append(usage["prompt_tokens_details"]["cached_tokens"] / usage["prompt_tokens"])
        # Random placement would find the context on the second request's server one time in three.
        assert min(hits) > 0.8, hits
        assert await epp_metric(session, stack, "inference_extension_kv_events_batches_total") > 0
        assert await epp_metric(session, stack, "inference_extension_kv_events_gaps_total") == 0
