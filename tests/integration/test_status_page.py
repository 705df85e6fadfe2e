"""The EPP's status page (epp/status.py) in a real headless browser: Debian's chromium driven by Playwright.

Against a running stack (sim model servers, the EPP, Envoy) the page loads, updates as requests arrive without a
reload and shows a decision, the same as the request's trace says; against a status page in this process holding 64 endpoints and 1,000 decisions of the
default profile, it renders within the goal (1 s, docs/observability.md)."""

import asyncio
import shutil

import aiohttp
import pytest
from aiohttp import web

from epp.config.loader import DEFAULT_CONFIG
from epp.datalayer.datastore import Datastore
from epp.datalayer.endpoint import EndpointSpec, PoolState
from epp.flowcontrol import FlowControlConfig, FlowController
from epp.scheduling.decisions import DecisionLog
from epp.scheduling.scheduler import Scheduler
from epp.scheduling.types import SchedulingRequest
from epp.status import StatusPage
from harness.otlp import TraceCollector
from protocol.metrics import EndpointMetrics
from tests.conftest import free_ports

playwright = pytest.importorskip("playwright.async_api", reason="Playwright is not installed (the test extra has it)")
CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="Debian's chromium is not installed (`make system-deps` installs it)"
)
# The goal: the page shows 64 endpoints and 1,000 decisions (the latest one in full) within a second of navigation.
RENDER_GOAL_SECONDS = 1.0
# What this test allows on a loaded 2-core machine (other tests' servers beside it): twice the goal.
RENDER_BOUND_SECONDS = 2 * RENDER_GOAL_SECONDS


async def browser_page(p):
    browser = await p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
    page = await browser.new_page()
    return browser, page


async def test_the_page_follows_a_running_stack_and_matches_the_trace(make_stack):
    (port,) = free_ports(1)
    collector = TraceCollector(f"127.0.0.1:{port}")
    await collector.start()
    try:
        stack = await make_stack(
            servers=2, epp_args=["--refresh-metrics-interval", "20ms", "--otlp-traces-endpoint", f"127.0.0.1:{port}"]
        )
        await follow_the_stack(stack, collector)
    finally:
        await collector.stop()


async def follow_the_stack(stack, collector: TraceCollector) -> None:
    async with playwright.async_playwright() as p:
        browser, page = await browser_page(p)
        try:
            await page.goto(stack.epp_metrics_url.removesuffix("/metrics") + "/")
            await page.wait_for_function("document.querySelectorAll('#endpoints tbody tr').length === 2")
            await page.wait_for_function("document.getElementById('ready-count').textContent === '2'")
            assert await page.text_content("#detail") == "no decision yet"
            request_ids = [f"page-test-{i}" for i in range(3)]
            async with aiohttp.ClientSession() as session:
                for request_id in request_ids:
                    body = {"model": "sim-llama-8b", "prompt": "hello page", "max_tokens": 2}
                    async with session.post(
                        f"{stack.gateway_url}/v1/completions", json=body, headers={"x-request-id": request_id}
                    ) as r:
                        assert r.status == 200
                async with session.get(stack.epp_metrics_url.removesuffix("/metrics") + "/status.json") as r:
                    decisions = {d["request_id"]: d for d in (await r.json())["decisions"]["entries"]}
            # no reload: the page polls and shows the new decisions, the latest one in full
            await page.wait_for_function("document.querySelectorAll('#decisions tbody tr').length >= 3")
            await page.wait_for_function(
                f"document.querySelector('#detail h3')?.textContent.includes('{request_ids[-1]}')"
            )
            latest = decisions[request_ids[-1]]
            assert await page.text_content("#detail-pick") == latest["pick"]
            assert await page.text_content("#detail-reason") == latest["reason"]
            rows = await page.locator("#detail-scores tbody tr").count()
            assert rows == latest["candidates"] == 2

            # the same decision in the request's trace: the scheduling span under the request's span
            def scheduling_span():
                spans = collector.spans
                request = next((s for s in spans if s.attributes.get("gateway.request_id") == request_ids[-1]), None)
                return next((s for s in spans if request and s.parent_id == request.span_id), None)

            for _ in range(100):
                if scheduling_span() is not None:
                    break
                await asyncio.sleep(0.1)
            traced = scheduling_span().attributes
            assert traced["gateway.pick"] == latest["pick_address"]
            assert traced["gateway.fallbacks"] == latest["fallbacks"]
            assert max(traced["gateway.totals"]) == pytest.approx(latest["total"])
            # a click on an earlier decision shows that one
            await page.click(f"#decisions tbody tr[data-seq='{decisions[request_ids[0]]['seq']}']")
            await page.wait_for_function(
                f"document.querySelector('#detail h3')?.textContent.includes('{request_ids[0]}')"
            )
        finally:
            await browser.close()


def full_status_page(endpoints: int, decisions: int) -> StatusPage:
    """A status page over `endpoints` scraped endpoints and `decisions` decisions of the default profile."""
    scheduler = Scheduler.from_config(DEFAULT_CONFIG)
    scheduler.decisions = DecisionLog(decisions, per_second=0)  # every decision: a full ring
    datastore = Datastore([], scheduler.on_pool_changed)
    datastore.apply(PoolState(tuple(EndpointSpec(f"pod-{i}", "10.0.0.1", 8000 + i) for i in range(endpoints))))
    for i, e in enumerate(datastore.endpoints):
        e.stale = i % 16 == 15  # a few not ready, with their reason
        e.stale_reason = "TimeoutError: " if e.stale else ""
        e.metrics = EndpointMetrics(
            waiting=i % 5, running=i % 9, kv_usage=(i % 10) / 10, block_size=16, num_gpu_blocks=1000, scraped_at=1.0
        )
    for i in range(decisions):
        request = SchedulingRequest(f"req-{i}", "sim-llama-8b", prompt=f"conversation {i % 40} " * 60)
        result = scheduler.schedule(request, datastore.endpoints)
        scheduler.on_routed(request, result)  # the prefix index learns: its scores differ between candidates
    flow = FlowController(FlowControlConfig(), lambda in_flight: True, poll_interval=60)
    return StatusPage("bench-pool", datastore, scheduler, flow, scheduler.decisions)


async def test_64_endpoints_and_1000_decisions_render_within_the_goal():
    status = full_status_page(64, 1000)
    app = web.Application()
    status.add_routes(app)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    (port,) = free_ports(1)
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with playwright.async_playwright() as p:
            browser, page = await browser_page(p)
            try:
                await page.goto(f"http://127.0.0.1:{port}/")
                # the page notes when its first poll had everything on screen, in ms since the navigation began
                await page.wait_for_function("document.getElementById('first-render').textContent !== '…'")
                assert await page.locator("#decisions tbody tr").count() == 1000
                assert await page.locator("#endpoints tbody tr").count() == 64
                assert await page.locator("#detail-scores tbody tr").count() == 60  # the candidates: 4 not ready
                seconds = int(await page.text_content("#first-render")) / 1000
                print(f"64 endpoints, 1,000 decisions rendered {seconds:.3f} s after navigation")
                assert seconds < RENDER_BOUND_SECONDS
                assert await page.text_content("#decision-kept") == "1000"
                assert await page.locator("#endpoints tr.notready").count() == 4
            finally:
                await browser.close()
    finally:
        await runner.cleanup()
        await asyncio.sleep(0)
