"""The status page (epp/status.py) and the decision ring it reads (epp/scheduling/decisions.py): every endpoint's
state, flow control's queues, the last decisions with each scorer's scores and why the pick won."""

import asyncio

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from epp.datalayer.datastore import Datastore
from epp.datalayer.endpoint import EndpointSpec, PoolState
from epp.flowcontrol import FlowControlConfig, FlowController
from epp.scheduling.decisions import DEFAULT_DECISIONS_PER_SECOND, DecisionLog, explain
from epp.scheduling.scheduler import Scheduler
from epp.scheduling.types import SchedulingRequest, TypedName
from epp.status import StatusPage
from protocol.metrics import EndpointMetrics
from tests.epp.helpers import endpoint

QUEUE_AND_KV = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
  - pluginRef: prefix-cache-scorer
  - pluginRef: max-score-picker
"""


def scheduler_with_ring(size: int = 1000) -> Scheduler:
    scheduler = Scheduler.from_config(QUEUE_AND_KV)
    scheduler.decisions = DecisionLog(size)
    return scheduler


def test_the_ring_keeps_the_last_decisions_and_the_scheduler_records_each_one():
    scheduler = scheduler_with_ring(size=3)
    endpoints = [endpoint(0, waiting=4), endpoint(1, waiting=0, kv=0.5), endpoint(2, stale=True)]
    for i in range(5):
        scheduler.schedule(SchedulingRequest(f"r{i}", "m", prompt="hello"), endpoints)
    ring = scheduler.decisions
    assert [d.request_id for d in ring.entries] == ["r2", "r3", "r4"]
    assert ring.count == 5 and [d.seq for d in ring.since(3)] == [4, 5]
    assert list(ring.since(0)) == list(ring.entries) and list(ring.since(5)) == []
    assert ring.get(2) is None and ring.get(4).request_id == "r3"
    last = ring.get(5)
    assert last.considered == 2  # the stale endpoint is not a candidate while fresh ones are left
    assert [e.name for e in last.candidates] == ["e0", "e1"]
    assert last.endpoints[0].name == "e1"  # an empty queue beats a half-full KV cache at weight 2 against 1
    assert TypedName("queue-scorer", "queue-scorer") in dict(last.raw_scores)


def test_explain_says_why_the_pick_won():
    scheduler = scheduler_with_ring()
    weights = scheduler.weights
    endpoints = [endpoint(0, waiting=4), endpoint(1, waiting=0, kv=0.5)]
    scheduler.schedule(SchedulingRequest("best", "m", prompt="x"), endpoints)
    explained = explain(scheduler.decisions.get(1), weights)
    decision = scheduler.decisions.get(1)
    assert (explained.picked, explained.runner_up) == (1, 0) and decision.totals[1] > decision.totals[0]
    assert explained.reason.startswith("best total") and "ahead of e0" in explained.reason
    assert "most from queue-scorer" in explained.reason

    scheduler.schedule(SchedulingRequest("tie", "m", prompt="x"), [endpoint(0), endpoint(1)])
    assert explain(scheduler.decisions.get(2), weights).reason.startswith("tied at")

    scheduler.schedule(SchedulingRequest("alone", "m", prompt="x"), [endpoint(0), endpoint(1, stale=True)])
    assert explain(scheduler.decisions.get(3), weights).reason == "the only candidate (of 1)"


def test_past_its_rate_the_ring_keeps_the_first_decisions_of_each_second_and_counts_the_rest():
    now = [100.2]
    ring = DecisionLog(10, per_second=2, clock=lambda: now[0])
    scheduler = Scheduler.from_config(QUEUE_AND_KV)
    scheduler.decisions = ring
    endpoints = [endpoint(0), endpoint(1)]
    for second, names in ((100.2, "abc"), (100.9, "d"), (101.0, "ef"), (103.5, "g")):
        now[0] = second
        for name in names:
            scheduler.schedule(SchedulingRequest(name, "m", prompt="x"), endpoints)
    assert [d.request_id for d in ring.entries] == ["a", "b", "e", "f", "g"]
    assert [d.seq for d in ring.entries] == [1, 2, 3, 4, 5] and ring.count == 5 and ring.made == 7
    assert ring.get(3).request_id == "e" and ring.get(3).at == 101.0
    unbounded, request = DecisionLog(10, per_second=0, clock=lambda: 100.0), SchedulingRequest("r", "m")
    result = scheduler.schedule(request, endpoints)
    for _ in range(7):
        unbounded.record(request, result, 2)
    assert unbounded.count == unbounded.made == 7


def test_bad_ring_sizes_are_refused():
    with pytest.raises(ValueError, match="at least one"):
        DecisionLog(0)
    with pytest.raises(ValueError, match="negative"):
        DecisionLog(10, per_second=-1)


def pool(n: int) -> Datastore:
    datastore = Datastore([])
    datastore.apply(PoolState(tuple(EndpointSpec(f"s{i}", "127.0.0.1", 9000 + i) for i in range(n))))
    return datastore


async def status_client(page: StatusPage) -> TestClient:
    app = web.Application()
    page.add_routes(app)
    client = TestClient(TestServer(app))
    await client.start_server()
    return client


async def test_the_page_and_its_json_show_endpoints_queues_and_decisions():
    datastore = pool(3)
    ready, idle, never = datastore.endpoints
    ready.stale = False
    ready.metrics = EndpointMetrics(
        waiting=2, running=5, kv_usage=0.25, running_adapters=frozenset({"sql-lora"}), scraped_at=1.0
    )
    idle.metrics, idle.stale, idle.stale_reason = EndpointMetrics(scraped_at=1.0), True, "TimeoutError: "
    never.stale_reason = "ConnectionRefusedError: [Errno 111] Connect call failed"
    scheduler = scheduler_with_ring()
    flow = FlowController(FlowControlConfig(), lambda in_flight: False, poll_interval=60)
    waiter = asyncio.ensure_future(flow.wait(0, "tenant-a", 120, 30))
    await asyncio.sleep(0)
    for i in range(4):
        scheduler.schedule(SchedulingRequest(f"req-{i}", "m", prompt="hi"), datastore.endpoints)
    client = await status_client(StatusPage("pool-x", datastore, scheduler, flow, scheduler.decisions))
    try:
        page = await client.get("/")
        assert page.status == 200 and page.content_type == "text/html"
        html = await page.text()
        assert "status.json" in html and "http" not in html and "src=" not in html  # no external assets
        status = await (await client.get("/status.json")).json()
        assert status["pool"] == "pool-x"
        rows = {e["name"]: e for e in status["endpoints"]}
        assert rows["s0"]["ready"] and rows["s0"]["reason"] == "" and rows["s0"]["waiting"] == 2
        assert rows["s0"]["adapters"] == ["sql-lora"] and rows["s0"]["kv_usage"] == 0.25
        assert rows["s0"]["prefix_entries"] >= 0 and rows["s0"]["kv_event_blocks"] is None
        assert not rows["s1"]["ready"] and rows["s1"]["reason"] == "metrics stale: TimeoutError: "
        assert rows["s2"]["reason"].startswith("no metrics page read yet: ConnectionRefusedError")
        assert status["flow_control"]["queued"] == 1
        [band] = status["flow_control"]["bands"]
        assert band["priority"] == 0 and band["flows"][0]["id"] == "tenant-a" and band["flows"][0]["bytes"] == 120
        decisions = status["decisions"]
        assert decisions["kept"] == 1000 and decisions["last"] == decisions["made"] == 4
        assert decisions["per_second"] == DEFAULT_DECISIONS_PER_SECOND
        assert [d["request_id"] for d in decisions["entries"]] == ["req-0", "req-1", "req-2", "req-3"]
        assert decisions["entries"][0]["pick"] == "s0" and decisions["entries"][0]["reason"]
        later = await (await client.get("/status.json?since=3")).json()
        assert [d["seq"] for d in later["decisions"]["entries"]] == [4]
        detail = await (await client.get("/status/decision?seq=4")).json()
        assert [s["name"] for s in detail["scorers"]] == ["queue-scorer", "kv-cache-utilization-scorer"]
        assert detail["rows"][0]["name"] == detail["pick"]
        assert len(detail["rows"][0]["scores"]) == 2 and detail["timings"]
        assert (await client.get("/status/decision?seq=99")).status == 404
        assert (await client.get("/status.json?since=x")).status == 400
    finally:
        waiter.cancel()
        await client.close()


async def test_without_a_ring_or_flow_control_the_page_still_shows_the_pool():
    datastore = pool(2)
    scheduler = Scheduler.from_config(QUEUE_AND_KV)
    client = await status_client(StatusPage("p", datastore, scheduler, None, None))
    try:
        status = await (await client.get("/status.json")).json()
        assert len(status["endpoints"]) == 2 and status["decisions"]["entries"] == []
        assert status["flow_control"] == {"enabled": False, "bands": []}
    finally:
        await client.close()
