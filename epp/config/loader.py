"""The EndpointPickerConfig loader: the YAML document (GIE's / llm-d's shape, `epp --config-file` or
`--config-text`) is parsed once, its top level checked, and each section handed to its owner:

| section | owner |
| --- | --- |
| `plugins`, `schedulingProfiles`, `saturationDetector` | the scheduler (`epp.scheduling.scheduler.Scheduler.from_sections`) |
| `flowControl`, `featureGates` | flow control (`epp.flowcontrol.FlowControlConfig.from_sections`) |

A field outside these (and `apiVersion`, `kind`) is a ConfigError, as is any error an owner finds in its sections:
all at startup, never on the request path. With no document at all, DEFAULT_CONFIG applies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml

from epp.config import ConfigError

DEFAULT_CONFIG = """\
apiVersion: llm-d.ai/v1
kind: EndpointPickerConfig
plugins:
- type: slo-headroom-filter
- type: slo-interference-filter
- type: predicted-latency-filter
- type: predicted-latency-scorer
  parameters: {replaces: load}
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: precise-prefix-cache-scorer
- type: lora-affinity-scorer
- type: in-flight-tokens-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: slo-headroom-filter
  - pluginRef: slo-interference-filter
  - pluginRef: predicted-latency-filter
  - pluginRef: predicted-latency-scorer
    weight: 5
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: prefix-cache-scorer
    weight: 3
  - pluginRef: precise-prefix-cache-scorer
    weight: 3
  - pluginRef: lora-affinity-scorer
    weight: 1
  - pluginRef: in-flight-tokens-scorer
    weight: 1
  - pluginRef: max-score-picker
"""
# llm-d router v1.0's default profile, "sticky until saturated" (its prefix-cache-affinity-filter, token-load-scorer,
# active-request-scorer and max-score-picker, with their defaults), as written here from their documentation; only
# peakPrefillThroughput is set, to the reference model server's sim (~10k prefill tokens a second), as llm-d asks of
# its users. docs/llm-d-names.md has its measure against DEFAULT_CONFIG.
LLM_D_DEFAULT_CONFIG = """\
apiVersion: llm-d.ai/v1
kind: EndpointPickerConfig
plugins:
- type: prefix-cache-affinity-filter
  parameters: {affinityThreshold: 0.80, maxTTFTPenaltyMs: 18000, peakPrefillThroughput: 10000}
- type: token-load-scorer
- type: active-request-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: prefix-cache-affinity-filter
  - pluginRef: token-load-scorer
    weight: 1
  - pluginRef: active-request-scorer
    weight: 1
  - pluginRef: max-score-picker
"""
# llm-d router v1's apiVersion first; the older ones are read as the same document (their fields are a subset of
# v1's, with the saturation detector at the top level, where v1 still accepts it).
API_VERSION = "llm-d.ai/v1"
API_VERSIONS = (
    API_VERSION,
    "llm-d.ai/v1alpha1",
    "inference.networking.x-k8s.io/v1alpha1",
    "config.apix.gateway-api-inference-extension.sigs.k8s.io/v1alpha1",
)
KIND = "EndpointPickerConfig"


@dataclass(frozen=True)
class EndpointPickerConfig:
    """The document's sections as written (None when absent); their owners check them."""

    plugins: Any = None
    scheduling_profiles: Any = None
    saturation_detector: Any = None
    flow_control: Any = None
    feature_gates: Any = None


# The document's fields: the sections (field -> EndpointPickerConfig attribute) and what identifies it.
SECTIONS = {
    "plugins": "plugins",
    "schedulingProfiles": "scheduling_profiles",
    "saturationDetector": "saturation_detector",
    "flowControl": "flow_control",
    "featureGates": "feature_gates",
}
TOP_LEVEL_KEYS = {"apiVersion", "kind", *SECTIONS}


def load(config_text: str | None) -> EndpointPickerConfig:
    """The sections of an EndpointPickerConfig document (None or "" -> DEFAULT_CONFIG). Raises ConfigError."""
    try:
        config = yaml.safe_load(config_text or DEFAULT_CONFIG)
    except yaml.YAMLError as exc:
        raise ConfigError(f"scheduler config is not valid YAML: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"scheduler config must be a mapping (an {KIND})")
    unknown = set(config) - TOP_LEVEL_KEYS
    if unknown:
        raise ConfigError(f"scheduler config: unknown field(s) {', '.join(sorted(map(str, unknown)))}")
    if config.get("kind", KIND) != KIND:
        raise ConfigError(f"scheduler config kind must be {KIND}, got {config.get('kind')!r}")
    if config.get("apiVersion", API_VERSIONS[0]) not in API_VERSIONS:
        raise ConfigError(f"scheduler config apiVersion must be one of {API_VERSIONS}, got {config['apiVersion']!r}")
    _convert_saturation_detector(config)
    return EndpointPickerConfig(**{attribute: config.get(field) for field, attribute in SECTIONS.items()})


DETECTOR_TYPE = "utilization-detector"  # llm-d's saturation detector that ours is (queue depth, KV usage)


def _convert_saturation_detector(config: dict) -> None:
    """llm-d's saturation detector as ours reads it, in place. llm-d names it by reference: `flowControl:
    {saturationDetector: {pluginRef: name}}` (v1; the top-level `saturationDetector` is v1alpha1's place, the
    new one wins when both are set), `name` being a `utilization-detector` of `plugins` whose parameters are ours
    (queueDepthThreshold, kvCacheUtilThreshold). That plugin leaves `plugins` and its parameters become the
    top-level `saturationDetector` (the older GIE shape, read as is); a reference to anything else stays for the
    scheduler to refuse by name."""
    flow_control = config.get("flowControl")
    detector = flow_control.get("saturationDetector") if isinstance(flow_control, dict) else None
    if detector is not None:
        config["flowControl"] = {k: v for k, v in flow_control.items() if k != "saturationDetector"}
    else:
        detector = config.get("saturationDetector")
    if not isinstance(detector, dict) or "pluginRef" not in detector:
        if detector is not None:
            config["saturationDetector"] = detector
        return
    if set(detector) != {"pluginRef"}:
        raise ConfigError(f"saturationDetector: unknown field(s) {', '.join(sorted(set(detector) - {'pluginRef'}))}")
    plugins = config.get("plugins") if isinstance(config.get("plugins"), list) else []
    ref = detector["pluginRef"]
    spec = next((p for p in plugins if isinstance(p, dict) and (p.get("name") or p.get("type")) == ref), None)
    if spec is None:
        raise ConfigError(f"saturationDetector refers to plugin {ref!r}, which `plugins` does not list")
    if spec.get("type") != DETECTOR_TYPE:
        config.pop("saturationDetector", None)  # the plugin's unsupported type is the error (the scheduler's)
        return
    config["plugins"] = [p for p in plugins if p is not spec]
    config["saturationDetector"] = spec.get("parameters") or {}
