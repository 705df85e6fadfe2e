"""Flow control through a real Envoy: a request that waits in the EPP longer than Envoy's ext_proc message
timeout still gets its answer (the EPP extends the timeout), and one whose TTL runs out gets 429 with retry-after.

One sim server running one request at a time and a saturation threshold of one waiting request: the first request
runs, the second waits at the server, the third waits in the EPP until the first finishes (~1.5 s)."""

import asyncio
import re
import time
from collections.abc import Mapping

import aiohttp
import pytest

from epp.config.loader import DEFAULT_CONFIG
from tests.integration.conftest import FAST_SIM

MODEL = "sim-llama-8b"
ONE_AT_A_TIME = ["--max-num-seqs", "1", "--sim-decode-base", "0.03"]  # 50 tokens: ~1.5 s per request
MESSAGE_TIMEOUT = 0.5


def config(ttl: float) -> str:
    return (
        DEFAULT_CONFIG + f"saturationDetector: {{queueDepthThreshold: 1}}\nflowControl: {{defaultRequestTTL: {ttl}}}\n"
    )


async def timed(session: aiohttp.ClientSession, url: str, **headers) -> tuple[int, float, Mapping, dict]:
    body = {"model": MODEL, "prompt": "wait for it", "max_tokens": 50, "ignore_eos": True}
    started = time.monotonic()
    async with session.post(f"{url}/v1/completions", json=body, headers=headers) as r:
        payload = await r.json(content_type=None)
        return r.status, time.monotonic() - started, r.headers.copy(), payload


async def epp_metrics(stack) -> str:
    async with aiohttp.ClientSession() as session, session.get(stack.epp_metrics_url) as r:
        return await r.text()


def outcome_count(page: str, outcome: str) -> float:
    pattern = rf'inference_extension_flow_control_request_queue_duration_seconds_count\{{[^}}]*outcome="{outcome}"[^}}]*\}} (\S+)'
    return sum(float(v) for v in re.findall(pattern, page))


async def test_a_request_queued_longer_than_the_message_timeout_is_answered(make_stack):
    stack = await make_stack(
        servers=1,
        config_text=config(ttl=20),
        message_timeout=MESSAGE_TIMEOUT,
        extra_modelserver_args=[*FAST_SIM, *ONE_AT_A_TIME],
    )
    async with aiohttp.ClientSession() as session:
        first = asyncio.create_task(timed(session, stack.gateway_url))
        await asyncio.sleep(0.2)
        second = asyncio.create_task(timed(session, stack.gateway_url))
        await asyncio.sleep(0.2)
        queued = await timed(session, stack.gateway_url, **{"x-gateway-inference-fairness-id": "tenant-a"})
        results = [await first, await second, queued]
    assert [status for status, *_ in results] == [200, 200, 200], results
    assert queued[1] > 1.0  # it waited for the first request to finish: well past Envoy's message timeout
    page = await epp_metrics(stack)
    assert outcome_count(page, "Dispatched") == 3
    waited_long = (
        r'_bucket\{fairness_id="tenant-a",inference_pool="pool",le="0.5",outcome="Dispatched",priority="0"\} 0.0'
    )
    assert re.search(waited_long, page)  # its wait is in the histogram, under its tenant


@pytest.mark.timing
async def test_a_request_whose_ttl_runs_out_gets_429_with_retry_after(make_stack):
    stack = await make_stack(
        servers=1,
        config_text=config(ttl=0.3),
        message_timeout=MESSAGE_TIMEOUT,
        extra_modelserver_args=[*FAST_SIM, *ONE_AT_A_TIME],
    )
    async with aiohttp.ClientSession() as session:
        first = asyncio.create_task(timed(session, stack.gateway_url))
        await asyncio.sleep(0.2)
        second = asyncio.create_task(timed(session, stack.gateway_url))
        await asyncio.sleep(0.2)
        status, waited, headers, payload = await timed(session, stack.gateway_url)
        assert [(await first)[0], (await second)[0]] == [200, 200]
    assert status == 429, payload
    assert headers.get("retry-after") == "1"
    assert payload["error"]["type"] and "EvictedTTL" in payload["error"]["message"]
    assert 0.25 < waited < 1.0
    page = await epp_metrics(stack)
    assert outcome_count(page, "EvictedTTL") == 1 and outcome_count(page, "Dispatched") == 2
