"""Scheduler plugins (table-driven), the config loader, the prefix load guard, saturation and admission."""

import pytest

from epp.scheduling.errors import ConfigError, NoEndpointError, ShedError
from epp.scheduling.framework import build_plugin
from epp.scheduling.plugins.prefix_cache_scorer import PREFIX_HASHES
from epp.scheduling.saturation import SaturationDetector
from epp.scheduling.scheduler import Scheduler
from epp.scheduling.types import CycleState, SchedulingRequest, SchedulingResult
from tests.epp.helpers import endpoint


def req(model="m", prompt="", **kw):
    return SchedulingRequest(request_id="r", model=model, prompt=prompt, **kw)


@pytest.mark.parametrize(
    ("plugin", "endpoints", "expected"),
    [
        ("queue-scorer", [endpoint(0, waiting=0), endpoint(1, waiting=5), endpoint(2, waiting=10)], [1.0, 0.5, 0.0]),
        ("queue-scorer", [endpoint(0, waiting=3), endpoint(1, waiting=3)], [1.0, 1.0]),
        # in-flight requests the scrape does not show yet count as queued
        ("queue-scorer", [endpoint(0, waiting=0, running=0, in_flight=4), endpoint(1, waiting=2)], [0.0, 1.0]),
        ("kv-cache-utilization-scorer", [endpoint(0, kv=0.25), endpoint(1, kv=1.0)], [0.75, 0.0]),
        ("running-requests-size-scorer", [endpoint(0, running=2), endpoint(1, running=6)], [1.0, 0.0]),
    ],
)
def test_load_scorers(plugin, endpoints, expected):
    assert build_plugin(plugin, {}).score(CycleState(), req(), endpoints) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("model", "endpoints", "expected"),
    [
        (
            "sql",
            [
                endpoint(0, running_adapters={"sql"}, max_lora=2),
                endpoint(1, running_adapters={"x"}, max_lora=2),  # room for one more
                endpoint(2, waiting_adapters={"sql"}, running_adapters={"x", "y"}, max_lora=2),
                endpoint(3, running_adapters={"x", "y"}, max_lora=2),  # full
            ],
            [1.0, 0.8, 0.6, 0.0],
        ),
        # a model no endpoint lists (the base model) is neutral everywhere
        ("base", [endpoint(0, running_adapters={"x"}, max_lora=1), endpoint(1, max_lora=1)], None),
    ],
)
def test_lora_affinity(model, endpoints, expected):
    assert build_plugin("lora-affinity-scorer", {}).score(CycleState(), req(model), endpoints) == expected


def test_prefix_scorer_scores_longest_recorded_prefix_and_forgets_removed_endpoints():
    scorer = build_plugin("prefix-cache-scorer", {"loadGuardQueueGap": 0})
    eps = [endpoint(0), endpoint(1), endpoint(2)]
    system = "You are a helpful assistant that answers briefly. " * 20  # 1000 chars = 15 blocks of 64
    first, first_state = req(prompt=system + "question one"), CycleState()
    assert scorer.score(first_state, first, eps) is None
    scorer.pre_request(first, SchedulingResult([eps[1]], cycle_state=first_state))
    second, second_state = req(prompt=system + "another question entirely"), CycleState()
    scores = scorer.score(second_state, second, eps)
    blocks = len(second_state.read(PREFIX_HASHES))
    assert scores[0] == 0.0 and scores[2] == 0.0
    assert scores[1] == pytest.approx(15 / blocks)
    assert scorer.index_size == len(first_state.read(PREFIX_HASHES))
    other_model = req(model="other", prompt=system + "question one")
    assert scorer.score(CycleState(), other_model, eps) is None  # hashes are seeded by the model
    scorer.pool_changed([eps[0], eps[2]])
    assert scorer.score(CycleState(), req(prompt=system + "question one"), eps) is None
    assert scorer.index_size == 0


def test_prefix_index_lru_is_bounded_by_num_gpu_blocks():
    scorer = build_plugin("prefix-cache-scorer", {})
    small = endpoint(0, num_gpu_blocks=4)
    for i in range(10):
        r, state = req(prompt=f"{i:04d}" * 200), CycleState()
        scorer.score(state, r, [small])
        scorer.pre_request(r, SchedulingResult([small], cycle_state=state))
    assert scorer.index_size == 4


@pytest.mark.parametrize(
    ("gap", "queues", "expected"),
    [
        (8, [0, 0], [1.0, 0.0]),  # equal load: full prefix credit
        (8, [4, 0], [0.5, 0.0]),  # 4 deeper than the shallowest: half credit
        (8, [8, 0], [0.0, 0.0]),  # at the gap: none
        (0, [50, 0], [1.0, 0.0]),  # guard off
    ],
)
def test_prefix_load_guard(gap, queues, expected):
    scorer = build_plugin("prefix-cache-scorer", {"loadGuardQueueGap": gap})
    hot, cold = endpoint(0, waiting=queues[0]), endpoint(1, waiting=queues[1])
    prompt = "shared system prompt " * 20
    first, state = req(prompt=prompt), CycleState()
    scorer.score(state, first, [hot, cold])
    scorer.pre_request(first, SchedulingResult([hot], cycle_state=state))
    r = req(prompt=prompt)
    assert scorer.score(CycleState(), r, [hot, cold]) == pytest.approx(expected)


def test_load_guard_keeps_a_hot_prefix_from_piling_onto_one_endpoint():
    """Many requests with one shared prefix: with the guard the load spreads once the hot endpoint's queue grows."""
    results = {}
    for gap in (0, 4):
        scheduler = Scheduler.from_config(
            f"""
plugins:
- type: queue-scorer
- type: prefix-cache-scorer
  parameters: {{loadGuardQueueGap: {gap}}}
schedulingProfiles:
- name: default
  plugins:
  - {{pluginRef: queue-scorer, weight: 1}}
  - {{pluginRef: prefix-cache-scorer, weight: 3}}
"""
        )
        eps = [endpoint(i) for i in range(4)]
        for i in range(40):
            r = req(prompt="the same long system prompt " * 30 + str(i))
            result = scheduler.schedule(r, eps)
            result.primary.in_flight_requests += 1  # nothing finishes: queues only grow
            scheduler.on_routed(r, result)
        results[gap] = max(e.in_flight_requests for e in eps)
    assert results[0] == 40  # prefix alone: everything on one endpoint
    assert results[4] <= 16  # guarded: spread within the gap


def test_max_score_picker_breaks_ties_at_random_and_returns_fallbacks():
    picker = build_plugin("max-score-picker", {"maxNumOfEndpoints": 2})
    eps = [endpoint(i) for i in range(3)]
    firsts = {picker.pick(CycleState(), req(), eps, [1.0, 1.0, 0.0])[0].name for _ in range(50)}
    assert firsts == {"e0", "e1"}
    assert [e.name for e in picker.pick(CycleState(), req(), eps, [0.1, 0.9, 0.5])] == ["e1", "e2"]


def test_random_and_weighted_random_pickers():
    eps = [endpoint(i) for i in range(3)]
    weighted = build_plugin("weighted-random-picker", {})
    assert {weighted.pick(CycleState(), req(), eps, [0.0, 1.0, 0.0])[0].name for _ in range(30)} == {"e1"}
    assert (
        len({build_plugin("random-picker", {}).pick(CycleState(), req(), eps, [0, 0, 0])[0].name for _ in range(60)})
        == 3
    )


def test_default_scheduler_prefers_short_queue_free_kv_and_cached_prefix():
    scheduler = Scheduler.from_config(None)
    eps = [endpoint(0, waiting=6, kv=0.7), endpoint(1, waiting=0, kv=0.1), endpoint(2, waiting=3, kv=0.4)]
    result = scheduler.schedule(req(), eps)
    assert result.primary.name == "e1"
    assert [name.type for name, _ in result.timings] == [
        "queue-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer", "lora-affinity-scorer",
        "in-flight-tokens-scorer", "max-score-picker"]  # fmt: skip


def test_subset_hint_and_staleness():
    scheduler = Scheduler.from_config(None)
    eps = [endpoint(0), endpoint(1, stale=True), endpoint(2, waiting=9)]
    assert scheduler.schedule(req(subset=frozenset({"127.0.0.1:8002"})), eps).primary.name == "e2"
    with pytest.raises(NoEndpointError):
        scheduler.schedule(req(subset=frozenset({"10.0.0.1:1"})), eps)
    assert all(scheduler.schedule(req(), eps).primary.name != "e1" for _ in range(20))  # stale skipped
    assert scheduler.schedule(req(), [endpoint(5, stale=True)]).primary.name == "e5"  # unless all are stale
    with pytest.raises(NoEndpointError):
        scheduler.schedule(req(), [])


def test_header_based_testing_filter():
    scheduler = Scheduler.from_config(
        "plugins:\n- type: header-based-testing-filter\nschedulingProfiles:\n- name: t\n  plugins:\n"
        "  - pluginRef: header-based-testing-filter\n"
    )
    eps = [endpoint(0), endpoint(1)]
    r = req(headers={"test-epp-endpoint-selection": "127.0.0.1:8001"})
    assert scheduler.schedule(r, eps).primary.name == "e1"
    with pytest.raises(NoEndpointError):
        scheduler.schedule(req(headers={"test-epp-endpoint-selection": "10.1.1.1:80"}), eps)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[1, 2]", "mapping"),
        ("kind: Other", "EndpointPickerConfig"),
        ("plugins: [{type: nope}]\nschedulingProfiles: [{name: a, plugins: []}]", "unknown plugin type"),
        ("plugins: [{type: queue-scorer, parameters: {x: 1}}]\nschedulingProfiles: [{name: a}]", "unknown parameter"),
        (
            "plugins: [{type: queue-scorer}]\nschedulingProfiles: [{name: a, plugins: [{pluginRef: b}]}]",
            "unknown plugin",
        ),
        (
            "plugins: [{type: queue-scorer}]\nschedulingProfiles: [{name: a, plugins: [{pluginRef: queue-scorer, weight: -1}]}]",
            "weight",
        ),
        (
            "plugins: [{type: max-score-picker, parameters: {maxNumOfEndpoints: 0}}]\nschedulingProfiles: [{name: a}]",
            ">= 1",
        ),
        ("plugins: []", "schedulingProfiles"),
        ("a: [", "YAML"),
    ],
)
def test_config_errors(text, message):
    with pytest.raises(ConfigError, match=message):
        Scheduler.from_config(text)


def test_saturation_and_admission():
    detector = SaturationDetector()
    busy = [endpoint(0, waiting=5), endpoint(1, kv=0.85), endpoint(2, stale=True)]
    assert detector.is_saturated(busy)
    assert not detector.is_saturated([*busy, endpoint(3, waiting=4, kv=0.79)])
    scheduler = Scheduler.from_config(None)
    with pytest.raises(ShedError):
        scheduler.admit(req(priority=-1), busy)
    scheduler.admit(req(priority=0), busy)  # only sheddable requests are shed
    scheduler.admit(req(priority=-1), [endpoint(0)])
