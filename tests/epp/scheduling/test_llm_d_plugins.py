"""llm-d router's plugins that ours implement under their type names and parameters (prefix-cache-affinity-filter,
token-load-scorer, active-request-scorer), its v1.0 default profile, and EndpointPickerConfigs shaped like
llm-d-router's documented examples (written here from their documented shape): each runs, or fails at startup
naming every plugin and parameter it does not support."""

import pytest

from epp.config import ConfigError
from epp.config.loader import LLM_D_DEFAULT_CONFIG
from epp.flowcontrol import FlowControlConfig
from epp.scheduling.plugins import build_plugin
from epp.scheduling.scheduler import Scheduler
from epp.scheduling.types import CycleState, SchedulingRequest, SchedulingResult
from tests.epp.helpers import endpoint

PROMPT = "You are a helpful assistant that answers briefly and precisely. " * 16  # 16 blocks of 64 characters


def req(prompt=PROMPT):
    return SchedulingRequest(request_id="r", model="m", prompt=prompt, prompt_tokens_estimate=len(prompt) // 4)


def with_index(plugin, pool, held: dict[int, str]):
    """`plugin` reading a prefix index that was sent `held[i]` to pool[i]."""
    index = build_plugin("prefix-cache-scorer", {"loadGuardQueueGap": 0})
    for i, prompt in held.items():
        cycle_state = CycleState()
        index.hashes(cycle_state, req(prompt), pool)
        index.pre_request(req(prompt), SchedulingResult([pool[i]], cycle_state=cycle_state))
    plugin.use_prefix_index(index)
    return plugin


def affinity(pool, held, **parameters):
    return with_index(build_plugin("prefix-cache-affinity-filter", parameters), pool, held)


def names(endpoints):
    return sorted(e.spec.name for e in endpoints)


def test_affinity_keeps_the_endpoints_holding_the_prompt_down_to_its_threshold():
    pool = [endpoint(i) for i in range(4)]
    half = PROMPT[: len(PROMPT) // 2]
    f = affinity(pool, {0: PROMPT, 1: PROMPT, 2: half})
    assert names(f.filter(CycleState(), req(), pool)) == ["e0", "e1"]  # e2 holds half: below 0.80
    f = affinity(pool, {0: PROMPT, 1: PROMPT, 2: half}, affinityThreshold=0.5)
    assert names(f.filter(CycleState(), req(), pool)) == ["e0", "e1", "e2"]
    assert f.filter(CycleState(), req("unseen " * 200), pool) == pool  # nobody sticky: all of them
    assert f.filter(CycleState(), req(), pool[:1]) == pool[:1]
    assert affinity(pool, {0: PROMPT}, affinityThreshold=0).filter(CycleState(), req(), pool) == pool  # disabled


def test_the_ttft_gate_breaks_stickiness_once_the_sticky_endpoints_are_saturated():
    pool = [endpoint(0, in_flight_tokens=50_000), endpoint(1, in_flight_tokens=1_000), endpoint(2)]
    # 10k tokens a second: the sticky one's backlog is 5 s, the idle one's 0 s
    f = affinity(pool, {0: PROMPT}, peakPrefillThroughput=10_000, maxTTFTPenaltyMs=6000)
    assert names(f.filter(CycleState(), req(), pool)) == ["e0"]  # 5 s behind: still within the penalty
    f = affinity(pool, {0: PROMPT}, peakPrefillThroughput=10_000, maxTTFTPenaltyMs=4000)
    assert f.filter(CycleState(), req(), pool) == pool  # 5 s behind the best other: saturated, all go on
    f = affinity(pool, {0: PROMPT}, peakPrefillThroughput=10_000, maxTTFTPenaltyMs=0)
    assert names(f.filter(CycleState(), req(), pool)) == ["e0"]  # 0: always stick


def test_exploration_skips_the_gate_with_its_probability():
    pool = [endpoint(i) for i in range(3)]
    f = affinity(pool, {0: PROMPT}, explorationProbability=0.25)
    f.random = iter([0.1, 0.9]).__next__
    assert f.filter(CycleState(), req(), pool) == pool
    assert names(f.filter(CycleState(), req(), pool)) == ["e0"]


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"affinityThreshold": 1.5}, "affinityThreshold"),
        ({"explorationProbability": -0.1}, "explorationProbability"),
        ({"maxTTFTPenaltyMs": -1}, "maxTTFTPenaltyMs"),
        ({"ttftSource": "latencyPredictor"}, "ttftSource 'latencyPredictor' is not supported"),
        ({"peakPrefillThroughput": 0}, "peakPrefillThroughput must be > 0"),
        ({"prefixMatchInfoProducerName": "p"}, "unknown parameter"),
    ],
)
def test_affinity_parameters_are_checked(parameters, message):
    with pytest.raises(ConfigError, match=message):
        build_plugin("prefix-cache-affinity-filter", parameters)


def test_token_load_counts_in_flight_tokens_and_the_request_s_uncached_share():
    pool = [endpoint(0, in_flight_tokens=1000), endpoint(1, in_flight_tokens=1000), endpoint(2)]
    s = with_index(build_plugin("token-load-scorer", {"queueThresholdTokens": 2000}), pool, {0: PROMPT})
    tokens = len(PROMPT) // 4  # 256: e0 holds all of it, e1 and e2 none
    assert s.score(CycleState(), req(), pool) == [0.5, 1 - (1000 + tokens) / 2000, 1 - tokens / 2000]
    busy = [endpoint(0, in_flight_tokens=10_000)]
    assert with_index(build_plugin("token-load-scorer", {"queueThresholdTokens": 2000}), busy, {}).score(
        CycleState(), req(), busy
    ) == [0.0]
    assert build_plugin("token-load-scorer", {"queueThresholdTokens": 0}).threshold == 4194304  # llm-d's default


def test_active_request_scores_idle_endpoints_1_and_busy_ones_up_to_max_busy_score():
    pool = [endpoint(0, in_flight=0), endpoint(1, in_flight=2), endpoint(2, in_flight=4)]
    assert build_plugin("active-request-scorer").score(CycleState(), req(), pool) == [1.0, 0.5, 0.0]
    s = build_plugin("active-request-scorer", {"idleThreshold": 2, "maxBusyScore": 0.5, "requestTimeout": "2m"})
    assert s.score(CycleState(), req(), pool) == [1.0, 1.0, 0.0]
    with pytest.raises(ConfigError, match="maxBusyScore"):
        build_plugin("active-request-scorer", {"maxBusyScore": 2})


def test_llm_d_s_default_profile_gets_a_prefix_index_that_only_records_picks():
    scheduler = Scheduler.from_config(LLM_D_DEFAULT_CONFIG)
    profile = scheduler.profile
    assert [f.typed_name.type for f in profile.filters] == ["prefix-cache-affinity-filter"]
    assert [(s.typed_name.type, w) for s, w in profile.scorers] == [
        ("token-load-scorer", 1.0),
        ("active-request-scorer", 1.0),
    ]
    assert profile.picker.typed_name.type == "max-score-picker"
    index = scheduler.prefix_index
    assert index is not None and index.typed_name.type == "prefix-cache-scorer"
    assert profile.filters[0].prefix_index is index and profile.scorers[0][0].prefix_index is index
    pool = [endpoint(i) for i in range(3)]
    first = scheduler.schedule(req(), pool)
    scheduler.on_routed(req(), first)
    again = scheduler.schedule(req(), pool)
    assert again.endpoints[0] is first.endpoints[0]  # sticky: the prompt is there now


# EndpointPickerConfigs shaped like llm-d-router's documented examples (its plugins' READMEs and its chart's
# default-plugins.yaml), written here from their documented shape. Each runs unchanged...
RUNS = {
    "weighted-scorers": """
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
  parameters: {blockSizeTokens: 64, maxPrefixTokensToMatch: 8192, lruCapacityPerServer: 31250, autoTune: false}
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: prefix-cache-scorer
    weight: 3
""",
    "sticky-until-saturated": """
apiVersion: llm-d.ai/v1
kind: EndpointPickerConfig
plugins:
- type: prefix-cache-affinity-filter
  name: prefix-affinity
  parameters: {affinityThreshold: 0.8, explorationProbability: 0.01, maxTTFTPenaltyMs: 5000, ttftSource: prefillThroughput}
- type: token-load-scorer
  name: token-load
  parameters: {queueThresholdTokens: 4194304}
- type: active-request-scorer
  name: active-tracker
  parameters: {idleThreshold: 2, maxBusyScore: 0.5}
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: prefix-affinity
  - pluginRef: token-load
    weight: 1
  - pluginRef: active-tracker
    weight: 5
  - pluginRef: max-score-picker
""",
    "lora-and-running-requests": """
apiVersion: llm-d.ai/v1
kind: EndpointPickerConfig
plugins:
- type: lora-affinity-scorer
- type: running-requests-size-scorer
- type: random-picker
  parameters: {maxNumOfEndpoints: 1}
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: lora-affinity-scorer
  - pluginRef: running-requests-size-scorer
  - pluginRef: random-picker
""",
}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_llm_d_shaped_configs_run_unchanged(name):
    scheduler = Scheduler.from_config(RUNS[name])
    pool = [endpoint(i, in_flight=i) for i in range(3)]
    assert scheduler.schedule(req(), pool).endpoints


# ... or fails at startup with one error that names every plugin and parameter it does not support.
FAILS = {
    "predictor-gates": (
        """
apiVersion: llm-d.ai/v1
kind: EndpointPickerConfig
plugins:
- type: predicted-latency-producer
- name: strict-affinity-filter
  type: prefix-cache-affinity-filter
  parameters: {affinityThreshold: 0.99, ttftSource: latencyPredictor, maxTTFTPenaltyMs: 5000}
- type: latency-scorer
- type: weighted-random-picker
- type: slo-headroom-tier-filter
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: strict-affinity-filter
  - pluginRef: weighted-random-picker
""",
        [
            "unsupported plugin type(s) predicted-latency-producer, latency-scorer, slo-headroom-tier-filter",
            "ttftSource 'latencyPredictor' is not supported",
        ],
    ),
    "producer-names-and-no-hit-lru": (
        """
apiVersion: llm-d.ai/v1
kind: EndpointPickerConfig
plugins:
- type: inflight-load-producer
  parameters: {addEstimatedOutputTokens: true}
- type: token-load-scorer
  parameters: {inFlightLoadProducerName: inflight-load-producer}
- type: prefix-cache-scorer
  parameters: {prefixMatchInfoProducerName: precise-prefix-cache-producer, matchLengthWeight: 0.5}
- type: no-hit-lru-scorer
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: token-load-scorer
""",
        [
            "unsupported plugin type(s) inflight-load-producer, no-hit-lru-scorer",
            "token-load-scorer: unknown parameter(s) inFlightLoadProducerName",
            "prefix-cache-scorer: unknown parameter(s) matchLengthWeight, prefixMatchInfoProducerName",
        ],
    ),
}


@pytest.mark.parametrize("name", sorted(FAILS))
def test_llm_d_shaped_configs_we_cannot_run_fail_at_startup_naming_everything_unsupported(name):
    text, expected = FAILS[name]
    with pytest.raises(ConfigError) as error:
        Scheduler.from_config(text)
    message = str(error.value)
    assert message.startswith(f"{len(expected)} errors: ")
    for part in expected:
        assert part in message


SATURATION = """
apiVersion: llm-d.ai/v1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- name: detector
  type: utilization-detector
  parameters: {queueDepthThreshold: 7, kvCacheUtilThreshold: 0.9}
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
flowControl:
  defaultRequestTTL: 30s
  saturationDetector: {pluginRef: detector}
"""


def test_llm_d_s_saturation_detector_reference_is_read_as_ours():
    scheduler = Scheduler.from_config(SATURATION)
    assert (scheduler.detector.queue_depth_threshold, scheduler.detector.kv_cache_util_threshold) == (7, 0.9)
    assert FlowControlConfig.from_text(SATURATION).default_request_ttl == 30.0
    older = SATURATION.replace("flowControl:\n  defaultRequestTTL: 30s\n  ", "")  # v1alpha1's top-level field
    assert Scheduler.from_config(older).detector.queue_depth_threshold == 7
    with pytest.raises(ConfigError, match=r"saturationDetector: unknown parameter\(s\) headroom"):
        Scheduler.from_config(SATURATION.replace("kvCacheUtilThreshold: 0.9", "headroom: 0.1"))
    with pytest.raises(ConfigError, match=r"unsupported plugin type\(s\) concurrency-detector"):
        Scheduler.from_config(SATURATION.replace("utilization-detector", "concurrency-detector"))
    with pytest.raises(ConfigError, match="does not list"):
        Scheduler.from_config(SATURATION.replace("{pluginRef: detector}", "{pluginRef: elsewhere}"))
