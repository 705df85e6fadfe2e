"""The EPP's /metrics page (epp.metrics.MetricsPage): one render at a time, shared, and at most a tenth of the time
spent rendering however often it is asked."""

import asyncio
import time

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily

from epp.metrics import RENDER_GAP_FACTOR, MetricsPage

RENDER_SECONDS = 0.01


class SlowGauge:
    """One gauge whose collection takes RENDER_SECONDS, holding the GIL like a large page's rendering."""

    def __init__(self) -> None:
        self.value = 0.0

    def collect(self):
        end = time.perf_counter() + RENDER_SECONDS
        while time.perf_counter() < end:
            pass
        yield GaugeMetricFamily("slow_gauge", "A gauge slow to collect.", value=self.value)


def make_page() -> tuple[MetricsPage, SlowGauge]:
    registry, gauge = CollectorRegistry(), SlowGauge()
    registry.register(gauge)
    return MetricsPage(registry), gauge


async def test_requests_during_a_render_share_it():
    page, _ = make_page()
    pages = await asyncio.gather(*(page.get() for _ in range(20)))
    assert page.renders == 1 and len(set(pages)) == 1 and b"slow_gauge 0.0" in pages[0]


async def test_a_flood_spends_at_most_a_tenth_of_the_time_rendering_and_new_values_still_show():
    page, gauge = make_page()
    loop = asyncio.get_running_loop()
    started, served = loop.time(), 0
    while loop.time() - started < 0.5:  # a scraper in a loop, as fast as the page comes
        await page.get()
        served += 1
    assert served > 1000
    # each render is followed by RENDER_GAP_FACTOR times its duration without one
    assert page.renders <= 2 + 0.5 / (RENDER_SECONDS * (1 + RENDER_GAP_FACTOR))
    gauge.value = 7.0
    # the page is reused for RENDER_GAP_FACTOR times the last render's own time, longer on a loaded machine
    deadline = loop.time() + 100 * RENDER_SECONDS * RENDER_GAP_FACTOR
    while b"slow_gauge 7.0" not in await page.get():
        assert loop.time() < deadline, "a new value never showed"
        await asyncio.sleep(RENDER_SECONDS)


async def test_a_client_that_goes_away_does_not_cancel_the_render_others_wait_for():
    page, _ = make_page()
    leaving, staying = asyncio.ensure_future(page.get()), asyncio.ensure_future(page.get())
    await asyncio.sleep(0)
    leaving.cancel()
    assert b"slow_gauge 0.0" in await staying
    assert page.renders == 1 and page.rendering is None
