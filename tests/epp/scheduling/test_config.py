"""The EndpointPickerConfig loader: defaults, valid shapes, and a clear ConfigError for every invalid one."""

from pathlib import Path

import pytest
import yaml

from epp.config import ConfigError
from epp.config.loader import API_VERSION, DEFAULT_CONFIG, load
from epp.flowcontrol import FlowControlConfig
from epp.scheduling.scheduler import Scheduler


def shape(scheduler):
    p = scheduler.profile
    return (
        p.name,
        [(f.typed_name.name, f.typed_name.type) for f in p.filters],
        [(s.typed_name.name, s.typed_name.type, w) for s, w in p.scorers],
        (p.picker.typed_name.name, p.picker.typed_name.type),
    )


def test_a_config_of_flow_control_alone_keeps_the_default_profile():
    """The README's `flowControl:` snippet as a whole file used to fail with a message about `plugins`."""
    text = "flowControl:\n  maxRequests: 10k\n  defaultRequestTTL: 30s\n"
    assert shape(Scheduler.from_config(text)) == shape(Scheduler.from_config(None))
    assert FlowControlConfig.from_sections(load(text)).max_requests == 10_000
    with pytest.raises(ConfigError, match="schedulingProfiles"):  # half a scheduling section is still a mistake
        Scheduler.from_config("plugins: [{type: queue-scorer}]")


@pytest.mark.parametrize("text", [None, "", DEFAULT_CONFIG])
def test_defaults(text):
    scheduler = Scheduler.from_config(text)
    assert shape(scheduler) == (
        "default",
        [
            ("slo-headroom-filter", "slo-headroom-filter"),
            ("slo-interference-filter", "slo-interference-filter"),
            ("predicted-latency-filter", "predicted-latency-filter"),
        ],
        [
            ("predicted-latency-scorer", "predicted-latency-scorer", 5.0),  # replaces the load scorers once warm
            ("queue-scorer", "queue-scorer", 2.0),
            ("kv-cache-utilization-scorer", "kv-cache-utilization-scorer", 2.0),
            ("prefix-cache-scorer", "prefix-cache-scorer", 3.0),
            ("precise-prefix-cache-scorer", "precise-prefix-cache-scorer", 3.0),
            ("lora-affinity-scorer", "lora-affinity-scorer", 1.0),
            ("in-flight-tokens-scorer", "in-flight-tokens-scorer", 1.0),
        ],
        ("max-score-picker", "max-score-picker"),
    )
    assert (scheduler.detector.queue_depth_threshold, scheduler.detector.kv_cache_util_threshold) == (5, 0.8)
    assert scheduler.prefix_index is scheduler.profile.scorers[3][0]


def test_named_instances_parameters_weights_and_saturation_thresholds():
    scheduler = Scheduler.from_config("""
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- name: only-listed
  type: header-based-testing-filter
  parameters: {headerName: x-pick}
- {name: short-blocks, type: prefix-cache-scorer, parameters: {blockSize: 8, loadGuardQueueGap: 2.5}}
- {name: unused, type: running-requests-size-scorer}
- type: queue-scorer
- {type: weighted-random-picker, parameters: {maxNumOfEndpoints: 2}}
schedulingProfiles:
- name: mine
  plugins:
  - pluginRef: only-listed
  - {pluginRef: short-blocks, weight: 0.5}
  - {pluginRef: queue-scorer}
  - {pluginRef: weighted-random-picker}
saturationDetector: {queueDepthThreshold: 9, kvCacheUtilThreshold: 1}
""")
    assert shape(scheduler) == (
        "mine",
        [("only-listed", "header-based-testing-filter")],
        [("short-blocks", "prefix-cache-scorer", 0.5), ("queue-scorer", "queue-scorer", 1.0)],
        ("weighted-random-picker", "weighted-random-picker"),
    )
    prefix = scheduler.profile.scorers[0][0]
    assert (prefix.block_size, prefix.load_guard_gap) == (8, 2.5)
    assert scheduler.profile.filters[0].header == "x-pick"
    assert scheduler.profile.picker.count == 2
    assert (scheduler.detector.queue_depth_threshold, scheduler.detector.kv_cache_util_threshold) == (9, 1.0)


def test_a_profile_without_a_picker_gets_max_score_and_one_without_prefix_has_no_index():
    scheduler = Scheduler.from_config(
        "plugins: [{type: queue-scorer}]\nschedulingProfiles: [{name: q, plugins: [{pluginRef: queue-scorer}]}]"
    )
    assert shape(scheduler)[3] == ("max-score-picker", "max-score-picker")
    assert scheduler.prefix_index is None


PROFILE = "schedulingProfiles: [{name: a, plugins: [{pluginRef: queue-scorer}]}]"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a: [", "not valid YAML"),
        ("- just a list", "must be a mapping"),
        ("kind: InferencePool\nplugins: []\n" + PROFILE, "kind must be EndpointPickerConfig"),
        ("apiVersion: v9\nplugins: [{type: queue-scorer}]\n" + PROFILE, "apiVersion must be one of"),
        ("plugin: [{type: queue-scorer}]\n" + PROFILE, r"unknown field\(s\) plugin"),
        ("plugins: {type: queue-scorer}\n" + PROFILE, "`plugins` must be a list"),
        ("plugins: [queue-scorer]\n" + PROFILE, "needs a `type`"),
        ("plugins: [{name: q}]\n" + PROFILE, "needs a `type`"),
        ("plugins: [{type: queue-scorer, weight: 2}]\n" + PROFILE, r"unknown field\(s\) weight"),
        ("plugins: [{type: queue-scorer}, {type: queue-scorer}]\n" + PROFILE, "duplicate plugin name 'queue-scorer'"),
        (
            "plugins: [{type: queue-scorer}]\nschedulingProfiles: [{name: a, plugins: [{pluginRef: queue-scorer, wieght: 2}]}]",
            "'queue-scorer': unknown field.s. wieght",
        ),
        (
            "plugins: [{type: queue-scorer}]\nschedulingProfiles: [{name: a, handler: x, plugins: [{pluginRef: queue-scorer}]}]",
            "profile 'a': unknown field.s. handler",
        ),
        ("plugins: [{type: nope}]\n" + PROFILE, r"unsupported plugin type\(s\) nope \(known: "),
        ("plugins: [{type: queue-scorer, parameters: {x: 1}}]\n" + PROFILE, "queue-scorer: unknown parameter"),
        ("plugins: [{type: queue-scorer, parameters: 3}]\n" + PROFILE, "parameters must be a mapping"),
        ("plugins: [{type: prefix-cache-scorer, parameters: {blockSize: -4}}]\n" + PROFILE, "blockSize must be >= 1"),
        ("plugins: [{type: queue-scorer}]", "`schedulingProfiles` must list one profile"),
        ("plugins: [{type: queue-scorer}]\nschedulingProfiles: []", "must list one profile"),
        ("plugins: [{type: queue-scorer}]\nschedulingProfiles: [{name: a}, {name: b}]", "exactly one scheduling"),
        (
            "plugins: [{type: queue-scorer}]\nschedulingProfiles: [{name: a, plugins: [{pluginRef: b}]}]",
            "refers to unknown plugin",
        ),
        (
            "plugins: [{type: queue-scorer}]\nschedulingProfiles: [{name: a, plugins: [queue-scorer]}]",
            "refers to unknown plugin",
        ),
        (
            "plugins: [{type: queue-scorer}]\nschedulingProfiles: [{name: a, plugins: "
            "[{pluginRef: queue-scorer}, {pluginRef: queue-scorer}]}]",
            "twice",
        ),
        (
            "plugins: [{type: queue-scorer}]\nschedulingProfiles: [{name: a, plugins: "
            "[{pluginRef: queue-scorer, weight: -1}]}]",
            "must be a number >= 0",
        ),
        (
            "plugins: [{type: queue-scorer}]\nschedulingProfiles: [{name: a, plugins: "
            "[{pluginRef: queue-scorer, weight: heavy}]}]",
            "must be a number >= 0",
        ),
        (
            "plugins: [{type: random-picker}, {type: max-score-picker}]\nschedulingProfiles: [{name: a, plugins: "
            "[{pluginRef: random-picker}, {pluginRef: max-score-picker}]}]",
            "more than one picker",
        ),
        (
            "plugins: [{type: queue-scorer}]\n" + PROFILE + "\nsaturationDetector: {queueDepthThreshold: 0}",
            "queueDepthThreshold must be >= 1",
        ),
        (
            "plugins: [{type: queue-scorer}]\n" + PROFILE + "\nsaturationDetector: {kvCacheUtilThreshold: 1.5}",
            "kvCacheUtilThreshold must be <= 1",
        ),
        (
            "plugins: [{type: queue-scorer}]\n" + PROFILE + "\nsaturationDetector: {queueDepth: 3}",
            "saturationDetector: unknown parameter",
        ),
    ],
)
def test_invalid_configs_are_config_errors_at_startup(text, message):
    with pytest.raises(ConfigError, match=message):
        Scheduler.from_config(text)


def test_the_shipped_manifest_config_loads():
    text = (Path(__file__).parents[3] / "manifests" / "base" / "scheduler.yaml").read_text()
    assert yaml.safe_load(text)["apiVersion"] == API_VERSION  # llm-d router v1's
    assert Scheduler.from_config(text).prefix_index is not None
