"""Pool file parsing and reload, the datastore's reconciliation, and the scraper against a real HTTP server."""

import asyncio
import contextlib
import time
from types import SimpleNamespace

import pytest
from aiohttp import web

from epp.datalayer.datastore import Datastore
from epp.datalayer.endpoint import MAX_ADAPTER_SLOTS, Endpoint, EndpointSpec, PoolState
from epp.datalayer.pool_file import PoolFileError, PoolFileSource, parse_pool
from epp.datalayer.scraper import Scraper
from epp.datalayer.source import PrometheusExtractor
from protocol.metrics import ENGINES
from tests.conftest import free_ports

PAGE = "vllm:num_requests_waiting 3\nvllm:num_requests_running 1\nvllm:kv_cache_usage_perc 0.5\n"


def test_extractor_records_the_in_flight_count_at_the_scrape_and_learns_the_batch_slots():
    e = Endpoint(EndpointSpec("a", "127.0.0.1", 1))
    e.in_flight_requests = 2
    PrometheusExtractor().extract(
        "vllm:num_requests_waiting 0\nvllm:num_requests_running 2\nvllm:kv_cache_usage_perc 0\n", e
    )
    assert (e.in_flight_at_scrape, e.batch_slots) == (2, None)  # not full: its batch size is not known
    e.in_flight_requests = 6
    PrometheusExtractor().extract(
        "vllm:num_requests_waiting 2\nvllm:num_requests_running 4\nvllm:kv_cache_usage_perc 0\n", e
    )
    assert (e.in_flight_at_scrape, e.batch_slots) == (6, 4)  # requests wait while 4 run: 4 slots
    PrometheusExtractor().extract(
        "vllm:num_requests_waiting 1\nvllm:num_requests_running 3\nvllm:kv_cache_usage_perc 0\n", e
    )
    assert e.batch_slots == 4  # a scrape between a completion and the next admission does not lower it
    PrometheusExtractor().extract(
        "vllm:num_requests_waiting 0\nvllm:num_requests_running 3\nvllm:kv_cache_usage_perc 0\n", e
    )
    assert e.batch_slots == 4  # a slot free: nothing learnt
    for running in (4, 5):
        PrometheusExtractor().extract(
            f"vllm:num_requests_waiting 0\nvllm:num_requests_running {running}\nvllm:kv_cache_usage_perc 0\n", e
        )
        # every slot busy and nothing waiting: 4 was not its batch size (flow control never sends more than the
        # slots, so without this a low limit would hold for good)
        assert e.batch_slots == running + 1


def test_extractor_remembers_the_adapters_an_endpoint_ran_lately_as_its_engine_keeps_them_loaded():
    """vllm:lora_requests_info names only adapters with requests; an engine keeps the last max_lora it used in their
    slots, so those count as loaded (the latency predictor's feature and lora-affinity-scorer read it)."""
    e = Endpoint(EndpointSpec("a", "127.0.0.1", 1))

    def scrape(running: str) -> None:
        info = f'vllm:lora_requests_info{{max_lora="2",running_lora_adapters="{running}",waiting_lora_adapters=""}} 1\n'
        PrometheusExtractor().extract(PAGE + info, e)

    scrape("sql")
    assert e.adapter_loaded("sql") and not e.adapter_loaded("chat")
    scrape("")  # its requests are done: it idles in its slot
    assert e.adapter_loaded("sql") and e.metrics.running_adapters == frozenset()
    scrape("chat")
    scrape("")
    assert list(e.recent_adapters) == ["sql", "chat"]
    scrape("sql")
    scrape("code")  # a third adapter in two slots: the least recently used one ("chat") made room
    assert list(e.recent_adapters) == ["sql", "code"] and not e.adapter_loaded("chat")
    PrometheusExtractor().extract(PAGE, e)  # an engine without LoRA (or restarted without it): nothing is loaded
    assert not e.recent_adapters
    names = ",".join(f"a{i}" for i in range(3 * MAX_ADAPTER_SLOTS))
    info = f'vllm:lora_requests_info{{max_lora="1000000",running_lora_adapters="{names}"}} 1\n'
    PrometheusExtractor().extract(PAGE + info, e)  # a page that claims a million slots: memory stays bounded
    assert len(e.recent_adapters) == MAX_ADAPTER_SLOTS


def test_inter_token_latency_over_a_span_comes_from_the_scraped_totals_inside_it():
    endpoint = Endpoint(EndpointSpec("a", "127.0.0.1", 8000))
    for at, seconds, tokens in ((0.0, 0.0, 0), (0.25, 1.0, 100), (0.5, 2.0, 150), (1.0, 4.0, 250)):
        endpoint.record_inter_token_totals(at, seconds, tokens)
    assert endpoint.inter_token_sample_due(1.1) and not endpoint.inter_token_sample_due(1.05)
    # from the first sample in the span to the last: (4.0 - 1.0) s over 150 tokens
    assert endpoint.inter_token_latency(0.2, 1.1) == pytest.approx(0.02)
    assert endpoint.inter_token_latency(0.0, 0.5) == pytest.approx(2.0 / 150)
    assert endpoint.inter_token_latency(0.6, 1.1) is None  # one sample inside: no span
    assert endpoint.inter_token_latency(0.3, 3.0) is None  # samples cover 0.5 s of 2.7
    endpoint.record_inter_token_totals(1.5, 4.0, 252)
    assert endpoint.inter_token_latency(1.0, 1.5) is None  # 2 tokens say too little
    endpoint.record_inter_token_totals(2.0, 0.1, 10)  # the server restarted: its totals began again
    assert list(endpoint.inter_token_totals) == [(2.0, 0.1, 10)]


def test_extractor_samples_the_inter_token_totals_while_busy_and_at_most_so_often(monkeypatch):
    """Tokens come only while requests run: an idle endpoint's histogram is not read, except at the scrape after
    its last request ended; a busy one's at most every INTER_TOKEN_SAMPLE_SECONDS, the last INTER_TOKEN_SAMPLES."""
    import protocol.metrics
    from epp.datalayer.endpoint import INTER_TOKEN_SAMPLES

    clock = [0.0]
    monkeypatch.setattr(protocol.metrics, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    endpoint, extractor = Endpoint(EndpointSpec("a", "127.0.0.1", 8000)), PrometheusExtractor()

    def scrape(at: float, running: int, tokens: int) -> None:
        clock[0] = at
        extractor.extract(
            f"vllm:num_requests_waiting 0\nvllm:num_requests_running {running}\nvllm:kv_cache_usage_perc 0.1\n"
            f"vllm:inter_token_latency_seconds_count {tokens}\nvllm:inter_token_latency_seconds_sum {tokens / 50}\n",
            endpoint,
        )

    scrape(0.0, 0, 0)
    scrape(0.25, 0, 0)
    assert not endpoint.inter_token_totals  # idle: not read
    scrape(0.5, 1, 0)
    scrape(0.55, 1, 5)  # not due: 0.05 s after the last sample
    scrape(0.65, 1, 10)
    scrape(0.8, 0, 15)  # the last request ended: read once more
    scrape(1.0, 0, 15)
    assert [(sample[0], sample[2]) for sample in endpoint.inter_token_totals] == [(0.5, 0), (0.65, 10), (0.8, 15)]
    step = 0.125  # above INTER_TOKEN_SAMPLE_SECONDS, and exact in binary
    for i in range(3 * INTER_TOKEN_SAMPLES):
        scrape(1.0 + (i + 1) * step, 1, 20 + i)
    assert len(endpoint.inter_token_totals) == INTER_TOKEN_SAMPLES
    end = 1.0 + 3 * INTER_TOKEN_SAMPLES * step
    assert endpoint.inter_token_latency(end - 10, end) == pytest.approx(0.02)
    clock[0] = end + 1
    extractor.extract(
        "vllm:num_requests_waiting 0\nvllm:num_requests_running 1\nvllm:kv_cache_usage_perc 0\n", endpoint
    )
    assert len(endpoint.inter_token_totals) == INTER_TOKEN_SAMPLES  # an engine without the histogram: nothing lost


def test_parse_pool_file():
    state = parse_pool(
        {
            "endpoints": [
                {"address": "10.0.0.1", "port": 8000, "engine": "sglang", "labels": {"zone": "a"}},
                {"name": "b", "address": "10.0.0.2", "port": 8001},
            ],
            "objectives": [{"name": "batch", "priority": -1}],
            "models": ["m"],
            "rewrites": [{"model": "m", "targets": [{"model": "m2", "weight": 3}]}],
        }
    )
    assert [e.name for e in state.endpoints] == ["10.0.0.1:8000", "b"]
    assert state.endpoints[0].engine == "sglang" and state.endpoints[0].labels == (("zone", "a"),)
    assert state.objectives == {"batch": -1}
    assert state.models == {"m"}
    assert state.rewrites[0].targets == (("m2", 3),)


def test_a_pool_file_host_name_is_resolved_to_the_ip_the_proxy_connects_to():
    # Envoy's ORIGINAL_DST cluster connects to the picked "ip:port" and takes no host name ("no healthy upstream")
    (spec,) = parse_pool({"endpoints": [{"address": "localhost", "port": 8000}]}).endpoints
    assert (spec.name, spec.address) == ("localhost:8000", "127.0.0.1")
    with pytest.raises(PoolFileError, match=r"endpoints\[0\]\.address 'no-such-host.invalid' does not resolve"):
        parse_pool({"endpoints": [{"address": "no-such-host.invalid", "port": 8000}]})


def test_a_pool_file_pod_with_several_ports_is_one_endpoint_per_rank():
    state = parse_pool(
        {
            "endpoints": [
                {"address": "10.0.0.1", "ports": [3000, 3002, 3004], "labels": {"zone": "a"}},
                {"name": "pod-b", "address": "10.0.0.2", "ports": [3000]},
            ]
        }
    )
    assert [(e.name, e.hostport) for e in state.endpoints] == [
        ("10.0.0.1-rank-0", "10.0.0.1:3000"),
        ("10.0.0.1-rank-1", "10.0.0.1:3002"),
        ("10.0.0.1-rank-2", "10.0.0.1:3004"),
        ("pod-b-rank-0", "10.0.0.2:3000"),
    ]
    assert {e.labels for e in state.endpoints[:3]} == {(("zone", "a"),)}


@pytest.mark.parametrize(
    "data",
    [
        [],
        {"endpoints": [{"address": "a"}]},
        {"endpoints": [{"address": "a", "port": 1, "ports": [2]}]},
        {"endpoints": [{"address": "a", "ports": []}]},
        {"endpoints": [{"address": "a", "ports": [1, 1]}]},
        {"endpoints": [{"address": "a", "ports": [1, 70000]}]},
        {"endpoints": [{"address": "a", "ports": 1}]},
        {"endpoints": [{"port": 1}]},
        {"endpoints": [{"address": "a", "port": 0}]},
        {"endpoints": [{"address": "a", "port": True}]},
        {"endpoints": [{"address": "a", "port": 1, "engine": "tgi"}]},
        {"endpoints": [{"address": "a", "port": 1}, {"address": "a", "port": 1}]},
        {"objectives": [{"name": "x", "priority": "high"}]},
        {"models": "m"},
        {"rewrites": [{"model": "m"}]},
    ],
)
def test_bad_pool_files(data):
    with pytest.raises(PoolFileError):
        parse_pool(data)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        # `endpoint:` once started "ready ... 0 endpoints"
        (
            {"endpoint": [{"address": "a", "port": 1}]},
            "the pool file: unknown field `endpoint` (did you mean `endpoints`?)",
        ),
        ({"endpoints": [{"adress": "a", "port": 1}]}, "endpoints[0]: unknown field `adress` (did you mean `address`?)"),
        ({"endpoints": [{"address": "a", "port": 1, "zone": "b"}]}, "unknown field `zone` (the fields are address"),
        ({"objectives": [{"name": "x", "prio": 1}]}, "objectives[0]: unknown field `prio` (did you mean `priority`?)"),
        ({"rewrites": [{"model": "m", "target": []}]}, "rewrites[0]: unknown field `target` (did you mean `targets`?)"),
        (
            {"rewrites": [{"model": "m", "targets": [{"model": "n", "weigth": 1}]}]},
            "targets[0]: unknown field `weigth`",
        ),
        ({"endpoints": {"address": "a"}}, "`endpoints` must be a list"),
    ],
)
def test_unknown_pool_file_fields_are_refused_naming_the_closest_known_one(data, message):
    with pytest.raises(PoolFileError) as error:
        parse_pool(data)
    assert message in str(error.value)


def test_a_pool_file_error_names_the_file(tmp_path):
    path = tmp_path / "pool.yaml"
    path.write_text("endpoint:\n- {address: 127.0.0.1, port: 8000}\n")
    with pytest.raises(PoolFileError, match=f"{path}: the pool file: unknown field `endpoint`"):
        PoolFileSource(path).initial()
    with pytest.raises(PoolFileError, match=r"cannot read the pool file .*nowhere\.yaml: No such file"):
        PoolFileSource(tmp_path / "nowhere.yaml").initial()


async def test_pool_file_reload_keeps_the_old_pool_on_a_broken_edit(tmp_path):
    path = tmp_path / "pool.yaml"
    path.write_text("endpoints: [{address: 10.0.0.1, port: 1}]\n")
    source = PoolFileSource(path, poll_interval=0.02)
    updates = []
    task = asyncio.create_task(source.run(updates.append))
    try:
        await asyncio.sleep(0.05)
        path.write_text("endpoints: [{address: 10.0.0.1, port: 1}, {address: 10.0.0.2, port: 2}]\n")
        await asyncio.sleep(0.1)
        path.write_text("endpoints: [{address: 10.0.0.3, port: 0}]\n")  # invalid
        await asyncio.sleep(0.1)
    finally:
        task.cancel()
    assert len(updates) == 1 and len(updates[0].endpoints) == 2


class RecordingScraper:
    def __init__(self):
        self.started, self.stopped = [], []

    def start(self, endpoint):
        self.started.append(endpoint.name)

    def stop(self, endpoint):
        self.stopped.append(endpoint.name)

    async def close(self):
        return None


def test_datastore_reconciles_and_keeps_unchanged_endpoints():
    scraper = RecordingScraper()
    changes = []
    store = Datastore([scraper], changes.append)
    a, b = EndpointSpec("a", "10.0.0.1", 1), EndpointSpec("b", "10.0.0.2", 1)
    store.apply(PoolState(endpoints=(a, b), objectives={"x": 2}))
    kept = store.endpoints[0]
    kept.in_flight_requests = 3
    store.apply(PoolState(endpoints=(a, EndpointSpec("b", "10.0.0.9", 1))))  # b's address changed
    assert store.endpoints[0] is kept and kept.in_flight_requests == 3
    assert scraper.started == ["a", "b", "b"] and scraper.stopped == ["b"]
    assert store.by_hostport("10.0.0.9:1") is store.endpoints[1]
    assert store.priority("x") == 0 and store.priority(None) == 0
    assert len(changes) == 2


async def test_scraper_updates_marks_stale_and_recovers():
    port = free_ports(1)[0]
    state = {"page": PAGE, "status": 200}

    async def metrics(request):
        return web.Response(text=state["page"], status=state["status"])

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    scraper = Scraper(interval=0.01, timeout=0.5, staleness=0.05)
    store = Datastore([scraper])
    try:
        store.apply(PoolState(endpoints=(EndpointSpec("e", "127.0.0.1", port),)))
        endpoint = store.endpoints[0]
        await asyncio.sleep(0.1)
        assert not endpoint.stale and endpoint.metrics.waiting == 3
        state["page"] = "garbage"
        await asyncio.sleep(0.15)
        assert endpoint.stale and endpoint.metrics.waiting == 3  # last good metrics kept
        state["page"] = PAGE.replace(" 3", " 7")
        await asyncio.sleep(0.1)
        assert not endpoint.stale and endpoint.metrics.waiting == 7
        await runner.cleanup()  # the server goes away: refused connections mark it stale at once
        await asyncio.sleep(0.1)
        assert endpoint.stale
        assert scraper.failures > 0
    finally:
        await store.close()
        await runner.cleanup()


@contextlib.asynccontextmanager
async def metrics_server(handler):
    """A server answering GET /metrics with `handler`; its port."""
    port = free_ports(1)[0]
    app = web.Application()
    app.router.add_get("/metrics", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield port
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def page_server(state: dict):
    """A /metrics server answering `state["page"]` and counting scrapes in `state["scrapes"]`; its port."""

    async def metrics(request):
        state["scrapes"] = state.get("scrapes", 0) + 1
        return web.Response(text=state["page"])

    async with metrics_server(metrics) as port:
        yield port


FILTERED = "vllm:num_requests_waiting 2\nvllm:num_requests_running 1\nvllm:kv_cache_usage_perc 0.25\n"


@pytest.mark.parametrize(
    "server, reads_whole",
    [
        ("filters", False),  # prometheus_client's exposition (vLLM, SGLang): only the samples asked for
        ("ignores", False),  # the whole page to any query: it reads the same
        ("refuses", True),  # 400 for a query it does not know
        ("redirects", True),  # a redirect for the query (the scraper follows none)
        ("misreads", True),  # a 200 without the gauges asked for
        ("fails", False),  # 503 with or without the query: not the filter's fault, so no change
        ("missing", False),  # 404 with or without it (no page at that path): the whole page tried once
    ],
)
async def test_the_scraper_asks_for_only_the_samples_it_reads_and_reads_whole_pages_where_it_must(
    server, reads_whole, caplog
):
    caplog.set_level("INFO", logger="epp.scraper")
    asked = []

    async def metrics(request):
        names = request.query.getall("name[]", None)
        asked.append(names)
        if server in ("fails", "missing"):
            return web.Response(status=503 if server == "fails" else 404)
        if names is None or server == "ignores":
            return web.Response(text=PAGE)
        return {
            "filters": web.Response(text=FILTERED),
            "refuses": web.Response(status=400, text="unknown parameter"),
            "redirects": web.Response(status=307, headers={"Location": "/metrics/"}),
            "misreads": web.Response(text="# nothing here\n"),
        }[server]

    scraper = Scraper(interval=0.01, timeout=0.5, staleness=5.0)
    async with metrics_server(metrics) as port:
        endpoint = Endpoint(EndpointSpec("e", "127.0.0.1", port))
        try:
            for _ in range(3):
                await scraper.scrape_once(endpoint)
        finally:
            await scraper.close()
    wanted = list(ENGINES["vllm"].sample_names())
    assert asked[0] == wanted  # the first scrape asks for the samples parse_metrics reads, alternatives included
    if server == "fails":
        assert endpoint.stale and asked == [wanted, wanted, wanted]
        return
    if server == "missing":  # one whole-page try, then not again within WHOLE_PAGE_RETRY
        assert endpoint.stale and asked == [wanted, None, wanted, wanted]
        return
    assert not endpoint.stale
    assert endpoint.metrics.waiting == (2 if server == "filters" else 3)
    if reads_whole:  # one retry of the whole page, then whole pages only
        assert asked == [wanted, None, None, None]
        assert "its whole page is read instead" in caplog.text
    else:
        assert asked == [wanted] * 3


async def test_a_server_without_a_page_gets_a_whole_page_try_again_after_the_retry_interval(monkeypatch):
    import epp.datalayer.scraper as scraper_module

    asked = []

    async def missing(request):
        asked.append(request.query.getall("name[]", None) is None)
        return web.Response(status=404)

    monkeypatch.setattr(scraper_module, "WHOLE_PAGE_RETRY", 0.05)
    scraper = Scraper(interval=0.01, timeout=0.5, staleness=5.0)
    async with metrics_server(missing) as port:
        endpoint = Endpoint(EndpointSpec("e", "127.0.0.1", port))
        try:
            for _ in range(2):
                assert not await scraper.scrape_once(endpoint)
            await asyncio.sleep(0.06)
            assert not await scraper.scrape_once(endpoint)
        finally:
            await scraper.close()
    assert asked == [False, True, False, False, True]  # True: the whole page


async def test_endpoints_are_scraped_slowly_while_this_epp_has_no_traffic():
    IDLE = "vllm:num_requests_waiting 0\nvllm:num_requests_running 0\nvllm:kv_cache_usage_perc 0.0\n"
    state = {"page": IDLE, "scrapes": 0}
    scraper = Scraper(interval=0.01, timeout=0.5, staleness=2.0, idle_interval=0.3)
    store = Datastore([scraper])
    async with page_server(state) as port:
        try:
            store.apply(PoolState(endpoints=(EndpointSpec("e", "127.0.0.1", port),)))
            endpoint = store.endpoints[0]
            await asyncio.sleep(0.1)
            assert scraper.quiet(endpoint), endpoint.metrics
            state["scrapes"] = 0
            await asyncio.sleep(0.5)
            assert state["scrapes"] <= 3  # one every 0.3 s, not one every 10 ms
            state["page"] = PAGE  # the server got busy meanwhile (another client); a request reaches this EPP:
            store.note_request()
            await asyncio.sleep(0.05)
            assert endpoint.metrics.waiting == 3 and not scraper.quiet(endpoint)
            state["page"] = IDLE  # idle again, but a request arrived within the idle interval: still the fast one
            store.note_request()
            state["scrapes"] = 0
            await asyncio.sleep(0.2)
            assert state["scrapes"] >= 8 and not scraper.quiet(endpoint)
            await asyncio.sleep(0.2)  # no request for longer than the idle interval: quiet
            assert scraper.quiet(endpoint)
            endpoint.in_flight_requests = 1  # in flight from this EPP: not quiet even if the page says idle
            assert not scraper.quiet(endpoint)
            endpoint.peer_in_flight_requests = 1  # ... from a peer replica (epp.replicas) only: quiet, as another
            assert scraper.quiet(endpoint)  # client's load is (a replica routing nothing scrapes slowly)
            endpoint.in_flight_requests = 2
            assert not scraper.quiet(endpoint)
            endpoint.in_flight_requests = endpoint.peer_in_flight_requests = 0
            state["page"] = PAGE  # another client's load, but no request of this EPP: scraped slowly all the same
            state["scrapes"] = 0
            await asyncio.sleep(0.5)
            assert endpoint.metrics.waiting == 3 and scraper.quiet(endpoint) and state["scrapes"] <= 3
            scraper.pending = lambda: 1  # a request of this EPP waits in flow control for a page that shows room
            assert not scraper.quiet(endpoint)
        finally:
            await store.close()


async def test_invalid_values_make_an_endpoint_stale_at_once_logged_once_and_scraping_survives(caplog):
    state = {"page": PAGE}
    scraper = Scraper(interval=0.01, timeout=0.5, staleness=5.0)
    store = Datastore([scraper])
    caplog.set_level("INFO", logger="epp.scraper")
    async with page_server(state) as port:
        try:
            store.apply(PoolState(endpoints=(EndpointSpec("e", "127.0.0.1", port),)))
            endpoint = store.endpoints[0]
            await asyncio.sleep(0.1)
            assert not endpoint.stale
            for bad in ("+Inf", "NaN", "-1"):
                state["page"] = PAGE.replace(" 3", f" {bad}")
                await asyncio.sleep(0.1)
                assert endpoint.stale, bad  # at once, not after the 5 s staleness threshold
                state["page"] = PAGE
                await asyncio.sleep(0.1)
                assert not endpoint.stale and endpoint.metrics.waiting == 3
            stale_lines = [r for r in caplog.records if "is stale" in r.getMessage()]
            assert len(stale_lines) == 3 and all(r.levelname == "WARNING" for r in stale_lines)  # once per change
            assert sum("is ready" in r.getMessage() for r in caplog.records) == 4

            class BrokenExtractor:
                def extract(self, raw, endpoint):
                    raise RuntimeError("a bug")

            working, scraper.extractor = scraper.extractor, BrokenExtractor()
            await asyncio.sleep(0.1)
            assert endpoint.stale
            scraper.extractor = working
            await asyncio.sleep(0.1)
            assert not endpoint.stale  # the scraping task survived the unexpected error
        finally:
            await store.close()


async def test_an_endpoint_that_never_served_a_page_is_named_in_a_warning_once_per_answer(caplog):
    """A wrong port (a web server answering 404) used to be logged only at -v 1: now a WARNING says what it answered,
    once, and again only when the answer changes; its first good page makes it ready."""
    state = {"status": 404}

    async def metrics(request):
        if state["status"] != 200:
            return web.Response(status=state["status"], text="<html>no</html>", content_type="text/html")
        return web.Response(text=PAGE)

    scraper = Scraper(interval=0.01, timeout=0.5, staleness=5.0)
    store = Datastore([scraper])
    caplog.set_level("INFO", logger="epp.scraper")
    async with metrics_server(metrics) as port:
        try:
            store.apply(PoolState(endpoints=(EndpointSpec("web", "127.0.0.1", port),)))
            endpoint = store.endpoints[0]
            await asyncio.sleep(0.2)
            state["status"] = 500
            await asyncio.sleep(0.2)
            warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
            assert len(warnings) == 2, warnings  # many failed scrapes, two answers
            assert f"endpoint web (127.0.0.1:{port}) has served no valid metrics page at /metrics" in warnings[0]
            assert "HTTP 404" in warnings[0] and "HTTP 500" in warnings[1]
            assert endpoint.stale and endpoint.metrics is None
            state["status"] = 200
            await asyncio.sleep(0.1)
            assert not endpoint.stale
        finally:
            await store.close()


class RecordingSource:
    """An endpoint source that records what the datastore told it."""

    name = "recording"

    def __init__(self):
        self.calls: list[str] = []

    def start(self, endpoint):
        self.calls.append(f"start {endpoint.name}")

    def stop(self, endpoint):
        self.calls.append(f"stop {endpoint.name}")

    def wake(self):
        self.calls.append("wake")

    async def close(self):
        self.calls.append("close")


async def test_every_endpoint_source_follows_the_pool():
    first, second = RecordingSource(), RecordingSource()
    store = Datastore([first, second])
    store.apply(PoolState(endpoints=(EndpointSpec("a", "10.0.0.1", 8000), EndpointSpec("b", "10.0.0.2", 8000))))
    store.apply(PoolState(endpoints=(EndpointSpec("b", "10.0.0.2", 8000),)))
    store.note_request()
    await store.close()
    assert first.calls == second.calls == ["start a", "start b", "stop a", "wake", "stop b", "close"]


async def test_a_requests_time_per_output_token_is_read_off_its_servers_scraped_histogram(tmp_path):
    """Against a sim model server: for each streamed request, the endpoint's mean inter-token latency from the first
    token to the end, read off scrapes every 50 ms, is within 15 % of the time per output token the client saw."""
    import aiohttp

    from modelserver.engine.sim import SimTiming
    from tests.modelserver.conftest import MODEL, start_server

    running = await start_server(tmp_path, SimTiming(prefill_overhead=0.002, decode_base=0.015))
    endpoint, extractor = Endpoint(EndpointSpec("s", "127.0.0.1", 1)), PrometheusExtractor()
    try:
        async with aiohttp.ClientSession() as session:

            async def scrape() -> None:
                while True:
                    async with session.get(f"{running.url}/metrics") as r:
                        extractor.extract(await r.text(), endpoint)
                    await asyncio.sleep(0.05)

            async def streamed(tokens: int) -> tuple[float, float]:
                body = {"model": MODEL, "prompt": "hello", "max_tokens": tokens, "stream": True}
                first = None
                async with session.post(f"{running.url}/v1/completions", json=body) as r:
                    async for line in r.content:
                        if line.startswith(b"data: {") and first is None:
                            first = time.monotonic()
                end = time.monotonic()
                seen = endpoint.inter_token_latency(first, end)
                return (end - first) / (tokens - 1), seen

            scraper = asyncio.create_task(scrape())
            await asyncio.sleep(0.1)
            pairs = []
            for tokens in (40, 60, 80):  # four at a time, of different lengths
                pairs += await asyncio.gather(*(streamed(tokens + 5 * i) for i in range(4)))
            scraper.cancel()
    finally:
        await running.stop()
    errors = [abs(seen - client) / client for client, seen in pairs if seen is not None]
    assert len(errors) >= 10, pairs
    assert sum(errors) / len(errors) < 0.15, pairs
