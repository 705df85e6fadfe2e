"""The live table reads each server in its engine's metric names: an SGLang server is not shown as down."""

import aiohttp
import pytest
from aiohttp import web

from harness.demo import _snapshot

SGLANG_PAGE = """# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 3.0
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 5.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.25
"""


@pytest.mark.asyncio
async def test_a_sglang_server_row_comes_from_its_own_metric_names():
    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=SGLANG_PAGE)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession() as session:
            row = await _snapshot(session, f"http://127.0.0.1:{port}", "sglang")
            as_vllm = await _snapshot(session, f"http://127.0.0.1:{port}", "vllm")
    finally:
        await runner.cleanup()
    assert (row["waiting"], row["running"], row["kv"]) == (3, 5, 0.25)
    assert (row["served"], row["hit"]) == ("-", "-")  # vLLM's counters only
    assert (as_vllm.get("waiting"), as_vllm.get("running")) != (3, 5)  # read in the wrong names, it is not this row
