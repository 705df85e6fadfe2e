"""schedule() end to end: candidates (subset, stale), filters, weighted scores, hooks, bursts between scrapes and
the prefix load guard over many requests."""

from collections import Counter

import pytest

from epp.scheduling.errors import NoEndpointError
from epp.scheduling.scheduler import Scheduler
from epp.scheduling.types import ResponseInfo, SchedulingRequest, TypedName
from tests.epp.helpers import endpoint

SYSTEM = "You are a terse assistant. Answer in one sentence. " * 40  # ~2 KB shared prefix
QUEUE_ONLY = "plugins: [{type: queue-scorer}]\nschedulingProfiles: [{name: q, plugins: [{pluginRef: queue-scorer}]}]"


def req(prompt="", model="m", **kw):
    return SchedulingRequest(request_id="r", model=model, prompt=prompt, **kw)


def names(result):
    return [e.name for e in result.endpoints]


def route(scheduler, request, pool):
    """What the server does around schedule(): count the request in flight, then record the pick."""
    result = scheduler.schedule(request, pool)
    result.primary.in_flight_requests += 1
    result.primary.routed_total += 1
    scheduler.on_routed(request, result)
    return result


@pytest.mark.parametrize(
    ("subset", "stale", "expected"),
    [
        (None, [], {"e0", "e1", "e2"}),
        (frozenset({"127.0.0.1:8001"}), [], {"e1"}),
        (frozenset({"127.0.0.1:8001", "127.0.0.1:8002"}), [1], {"e2"}),  # stale ones skipped
        (None, [0, 1], {"e2"}),
        (None, [0, 1, 2], {"e0", "e1", "e2"}),  # all stale: better a try than a 503
        (frozenset({"127.0.0.1:8001"}), [1], {"e1"}),
    ],
)
def test_candidates_respect_the_subset_hint_and_skip_stale_endpoints(subset, stale, expected):
    pool = [endpoint(i, stale=i in stale) for i in range(3)]
    scheduler = Scheduler.from_config(QUEUE_ONLY)
    seen = {scheduler.schedule(req(subset=subset), pool).primary.name for _ in range(60)}
    assert seen == expected


@pytest.mark.parametrize(
    ("pool", "subset", "message"),
    [
        ([], None, "no ready endpoint"),
        ([endpoint(0)], frozenset(), "subset"),
        ([endpoint(0)], frozenset({"10.0.0.9:8000"}), "subset"),
    ],
)
def test_nothing_to_serve_is_no_endpoint_error(pool, subset, message):
    with pytest.raises(NoEndpointError, match=message) as error:
        Scheduler.from_config(None).schedule(req(subset=subset), pool)
    assert error.value.status == 503


def test_an_endpoint_that_never_served_a_metrics_page_is_never_picked():
    """Not even when nothing fresh is left: it may be no model server at all (a wrong port), whose answer (an HTML
    404 or 501) the client got instead of the EPP's 503."""
    never_read = endpoint(0, stale=True)
    never_read.metrics = None
    with pytest.raises(NoEndpointError, match="no ready endpoint") as error:
        Scheduler.from_config(None).schedule(req(), [never_read])
    assert error.value.status == 503
    stale_but_read = endpoint(1, stale=True)  # it served pages until lately: better a try than a 503
    assert Scheduler.from_config(None).schedule(req(), [never_read, stale_but_read]).primary.name == "e1"


def test_a_filter_that_leaves_nothing_is_no_endpoint_error():
    config = (
        "plugins: [{type: header-based-testing-filter}]\nschedulingProfiles: [{name: t, plugins: "
        "[{pluginRef: header-based-testing-filter}]}]"
    )
    scheduler = Scheduler.from_config(config)
    picked = scheduler.schedule(
        req(headers={"test-epp-endpoint-selection": "127.0.0.1:8001"}), [endpoint(0), endpoint(1)]
    )
    assert names(picked) == ["e1"]
    with pytest.raises(NoEndpointError, match="header-based-testing-filter"):
        scheduler.schedule(req(headers={"test-epp-endpoint-selection": "10.1.1.1:1"}), [endpoint(0)])


@pytest.mark.parametrize(
    ("pool", "expected"),
    [
        # default weights: queue 2, kv 2 (prefix and lora neutral without a prompt or adapters)
        ([endpoint(0, waiting=4, kv=0.1), endpoint(1, waiting=0, kv=0.5), endpoint(2, waiting=2, kv=0.9)], "e1"),
        # a nearly full KV cache outweighs one more queued request once the queues span more than that
        ([endpoint(0, waiting=1, kv=0.05), endpoint(1, waiting=0, kv=0.95), endpoint(2, waiting=10)], "e0"),
        ([endpoint(0, waiting=0, running=9, in_flight=12), endpoint(1, waiting=2)], "e1"),  # 3 not yet scraped
    ],
)
def test_default_profile_prefers_the_least_loaded(pool, expected):
    assert Scheduler.from_config(None).schedule(req(), pool).primary.name == expected


def test_lora_requests_go_where_the_adapter_runs_base_model_requests_by_load():
    pool = [endpoint(0, running_adapters={"sql"}, max_lora=1), endpoint(1, running_adapters={"chat"}, max_lora=1)]
    scheduler = Scheduler.from_config(None)
    assert {scheduler.schedule(req(model="sql"), pool).primary.name for _ in range(20)} == {"e0"}
    assert {scheduler.schedule(req(model="chat"), pool).primary.name for _ in range(20)} == {"e1"}
    assert {scheduler.schedule(req(model="base"), pool).primary.name for _ in range(40)} == {"e0", "e1"}
    pool[0].metrics.waiting = 1
    assert {scheduler.schedule(req(model="base"), pool).primary.name for _ in range(20)} == {"e1"}


@pytest.mark.parametrize("picker", ["max-score-picker", "random-picker", "weighted-random-picker"])
def test_a_picker_of_one_gets_the_best_scored_fallbacks(picker):
    """The gateway retries on two fallbacks: whatever the picker returns first, the rest is completed by total score
    (queue depths 4, 0, 2, 6 -> e1, e2, e0 after any pick)."""
    config = f"""
plugins: [{{type: queue-scorer}}, {{type: {picker}}}]
schedulingProfiles: [{{name: p, plugins: [{{pluginRef: queue-scorer}}, {{pluginRef: {picker}}}]}}]
"""
    scheduler = Scheduler.from_config(config)
    pool = [endpoint(0, waiting=4), endpoint(1, waiting=0), endpoint(2, waiting=2), endpoint(3, waiting=6)]
    for _ in range(20):
        picked = names(scheduler.schedule(req(), pool))
        assert len(picked) == 3 and len(set(picked)) == 3
        assert picked[1:] == [n for n in ("e1", "e2", "e0") if n != picked[0]][:2]


def test_fallbacks_come_only_from_the_candidates():
    scheduler = Scheduler.from_config(QUEUE_ONLY)
    pool = [endpoint(i) for i in range(4)]
    assert len(scheduler.schedule(req(), pool).endpoints) == 3
    assert names(scheduler.schedule(req(subset=frozenset({"127.0.0.1:8001", "127.0.0.1:8003"})), pool)) in (
        ["e1", "e3"],
        ["e3", "e1"],
    )
    assert names(scheduler.schedule(req(), pool[:1])) == ["e0"]


def test_result_scores_ordering_and_plugin_durations():
    config = """
plugins:
- {type: queue-scorer}
- {type: kv-cache-utilization-scorer}
- {type: max-score-picker, parameters: {maxNumOfEndpoints: 3}}
schedulingProfiles:
- name: p
  plugins: [{pluginRef: queue-scorer, weight: 2}, {pluginRef: kv-cache-utilization-scorer}, {pluginRef: max-score-picker}]
"""
    scheduler = Scheduler.from_config(config)
    pool = [endpoint(0, waiting=4, kv=0.0), endpoint(1, waiting=0, kv=0.5), endpoint(2, waiting=2, kv=0.0)]
    result = scheduler.schedule(req(), pool)
    assert names(result) == ["e1", "e2", "e0"]  # totals 2.5, 2.0, 1.0
    assert result.profile == "p"
    assert [e.name for e in result.candidates] == ["e0", "e1", "e2"]
    assert result.scores == {
        TypedName("queue-scorer", "queue-scorer"): [0.0, 1.0, 0.5],
        TypedName("kv-cache-utilization-scorer", "kv-cache-utilization-scorer"): [1.0, 0.5, 1.0],
    }
    assert [name for name, _ in result.timings] == [
        TypedName("queue-scorer", "queue-scorer"),
        TypedName("kv-cache-utilization-scorer", "kv-cache-utilization-scorer"),
        TypedName("max-score-picker", "max-score-picker"),
    ]
    assert all(0 <= s < 0.1 for _, s in result.timings)


def test_a_burst_between_scrapes_spreads_over_the_pool():
    """Scrapes arrive every 50 ms; a burst routed in between must not all land on the endpoint that looked best."""
    pool = [endpoint(i) for i in range(4)]
    scheduler = Scheduler.from_config(None)
    counts = Counter(route(scheduler, req(f"distinct prompt {i}" * 10), pool).primary.name for i in range(40))
    assert counts == {"e0": 10, "e1": 10, "e2": 10, "e3": 10}


def test_repeated_prefixes_stick_to_the_endpoint_that_cached_them():
    pool = [endpoint(i) for i in range(4)]
    scheduler = Scheduler.from_config(None)
    first = route(scheduler, req(SYSTEM + "question 0"), pool).primary
    first.in_flight_requests = 0  # finished
    for i in range(1, 10):
        picked = scheduler.schedule(req(SYSTEM + f"question {i}"), pool).primary
        assert picked is first
    assert scheduler.prefix_index.index_size > 0


@pytest.mark.parametrize("config", [None, "prefix-only"])
def test_load_guard_keeps_a_hot_prefix_from_piling_onto_one_endpoint(config):
    """Every request shares one system prompt and nothing finishes: prefix affinity alone would send all of them
    to the first endpoint. The guard spreads them once its queue is `loadGuardQueueGap` (8) deeper than its peers'."""
    if config == "prefix-only":
        config = (
            "plugins: [{type: prefix-cache-scorer}]\nschedulingProfiles: [{name: p, plugins: "
            "[{pluginRef: prefix-cache-scorer}]}]"
        )
    pool = [endpoint(i) for i in range(4)]
    scheduler = Scheduler.from_config(config)
    for i in range(200):
        route(scheduler, req(SYSTEM + f"question {i}"), pool)
    queues = [e.in_flight_requests for e in pool]
    assert sum(queues) == 200
    assert max(queues) - min(queues) <= 9, queues
    assert scheduler.prefix_index.hit_ratio > 0.5  # affinity still wins whenever the queues allow it


def test_without_the_guard_prefix_only_routing_piles_up():
    """The failure the guard prevents (loadGuardQueueGap 0): every request lands on the first endpoint."""
    config = (
        "plugins: [{type: prefix-cache-scorer, parameters: {loadGuardQueueGap: 0}}]\nschedulingProfiles: "
        "[{name: p, plugins: [{pluginRef: prefix-cache-scorer}]}]"
    )
    pool = [endpoint(i) for i in range(4)]
    scheduler = Scheduler.from_config(config)
    for i in range(50):
        route(scheduler, req(SYSTEM + f"question {i}"), pool)
    assert sorted(e.in_flight_requests for e in pool) == [0, 0, 0, 50]


def test_hooks_reach_profile_plugins_only():
    scheduler = Scheduler.from_config(None)
    prefix = scheduler.prefix_index
    pool = [endpoint(0), endpoint(1)]
    result = route(scheduler, req(SYSTEM), pool)
    assert prefix.index_size > 0
    scheduler.on_pool_changed([])
    assert prefix.index_size == 0
    scheduler.on_finished(
        req(SYSTEM), result, pool[0], ResponseInfo("200")
    )  # no plugin needs it: a no-op, never an error
    unused = Scheduler.from_config(
        "plugins: [{type: prefix-cache-scorer}, {type: queue-scorer}]\nschedulingProfiles:"
        " [{name: q, plugins: [{pluginRef: queue-scorer}]}]"
    )
    assert unused.prefix_index is None
    assert [p.typed_name.type for p in unused.profile.plugins] == ["queue-scorer", "max-score-picker"]
