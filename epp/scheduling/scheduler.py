"""The scheduler: one profile of filters -> weighted scorers -> picker, built from an EndpointPickerConfig.

The config has GIE's shape:

    apiVersion: inference.networking.x-k8s.io/v1alpha1
    kind: EndpointPickerConfig
    plugins:                      # instances: type, optional name (defaults to the type), optional parameters
    - type: prefix-cache-scorer
      parameters: {blockSize: 16}
    schedulingProfiles:           # exactly one profile (there is no profile handler to choose between several)
    - name: default
      plugins:                    # filters run in this order; scorers are summed with their weight (default 1)
      - pluginRef: prefix-cache-scorer
        weight: 3
    saturationDetector: {queueDepthThreshold: 5, kvCacheUtilThreshold: 0.8}

A profile without a picker gets `max-score-picker`. With no config at all, DEFAULT_CONFIG applies: queue-scorer 2,
kv-cache-utilization-scorer 2, prefix-cache-scorer 3, lora-affinity-scorer 1 (neutral for base-model requests, so
it only matters for adapters), in-flight-tokens-scorer 1 (a long prompt's prefill, which request counts miss) and
max-score-picker. Every error in a config is a ConfigError at startup.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from epp.datalayer.endpoint import Endpoint
from epp.scheduling.errors import ConfigError, NoEndpointError
from epp.scheduling.framework import HOOKS, Filter, Picker, Scorer, build_plugin
from epp.scheduling.saturation import SaturationDetector, admit
from epp.scheduling.types import SchedulingRequest, SchedulingResult

DEFAULT_CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: lora-affinity-scorer
- type: in-flight-tokens-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: prefix-cache-scorer
    weight: 3
  - pluginRef: lora-affinity-scorer
    weight: 1
  - pluginRef: in-flight-tokens-scorer
    weight: 1
  - pluginRef: max-score-picker
"""
API_VERSIONS = (
    "inference.networking.x-k8s.io/v1alpha1",
    "config.apix.gateway-api-inference-extension.sigs.k8s.io/v1alpha1",
)
TOP_LEVEL_KEYS = {"apiVersion", "kind", "plugins", "schedulingProfiles", "saturationDetector"}


@dataclass(frozen=True)
class Profile:
    """A profile resolved once at startup into the lists the request path walks."""

    name: str
    filters: tuple[tuple[str, Filter], ...]
    scorers: tuple[tuple[str, Scorer, float], ...]
    picker: tuple[str, Picker]

    def plugins(self) -> list[Any]:
        return [p for _, p in self.filters] + [s for _, s, _ in self.scorers] + [self.picker[1]]


class Scheduler:
    def __init__(self, profile: Profile, detector: SaturationDetector | None = None):
        self.profile = profile
        self.detector = detector or SaturationDetector()
        unique = list(dict.fromkeys(profile.plugins()))  # one plugin may be a filter and a scorer: hook it once
        self._hooks: dict[str, list[Callable]] = {
            hook: [getattr(p, hook) for p in unique if hasattr(p, hook)] for hook in HOOKS
        }
        # per plugin of the last schedule() call: (plugin type, plugin name, seconds); the server exports them
        self.last_plugin_durations: list[tuple[str, str, float]] = []

    @classmethod
    def from_config(cls, config_text: str | None = None) -> Scheduler:
        """Build from EndpointPickerConfig YAML (None or "" -> DEFAULT_CONFIG). Raises ConfigError."""
        try:
            config = yaml.safe_load(config_text or DEFAULT_CONFIG)
        except yaml.YAMLError as exc:
            raise ConfigError(f"scheduler config is not valid YAML: {exc}") from None
        if not isinstance(config, dict):
            raise ConfigError("scheduler config must be a mapping (an EndpointPickerConfig)")
        unknown = set(config) - TOP_LEVEL_KEYS
        if unknown:
            raise ConfigError(f"scheduler config: unknown field(s) {', '.join(sorted(map(str, unknown)))}")
        if config.get("kind", "EndpointPickerConfig") != "EndpointPickerConfig":
            raise ConfigError(f"scheduler config kind must be EndpointPickerConfig, got {config.get('kind')!r}")
        if config.get("apiVersion", API_VERSIONS[0]) not in API_VERSIONS:
            raise ConfigError(
                f"scheduler config apiVersion must be one of {API_VERSIONS}, got {config['apiVersion']!r}"
            )
        plugins = _build_plugins(config.get("plugins"))
        profile = _build_profile(config.get("schedulingProfiles"), plugins)
        return cls(profile, SaturationDetector.from_config(config.get("saturationDetector")))

    def admit(self, request: SchedulingRequest, endpoints: Sequence[Endpoint]) -> None:
        """Raise ShedError (429) for a sheddable request while the pool is saturated."""
        admit(request, endpoints, self.detector)

    def schedule(self, request: SchedulingRequest, endpoints: Sequence[Endpoint]) -> SchedulingResult:
        """Endpoints for a request, best first. Raises NoEndpointError when nothing can serve it.

        Candidates are the endpoints in `request.subset` (when given) that are not stale; stale ones only when no
        fresh one is left (an endpoint that missed a few scrapes may still serve, and a 503 certainly does not).
        """
        subset = request.subset
        if subset is not None:
            endpoints = [e for e in endpoints if e.hostport in subset]
        candidates = [e for e in endpoints if not e.stale] or list(endpoints)
        if not candidates:
            raise NoEndpointError("no endpoint in the subset hint" if subset is not None else "no ready endpoint")
        clock = time.perf_counter
        durations = self.last_plugin_durations = []
        for name, plugin in self.profile.filters:
            start = clock()
            candidates = plugin.filter(request, candidates)
            durations.append((plugin.type_name, name, clock() - start))
            if not candidates:
                raise NoEndpointError(f"no endpoint left after filter {name!r}")
        totals = [0.0] * len(candidates)
        for name, scorer, weight in self.profile.scorers:
            start = clock()
            scores = scorer.score(request, candidates)
            if scores is not None:
                totals = [t + weight * s for t, s in zip(totals, scores, strict=True)]
            durations.append((scorer.type_name, name, clock() - start))
        name, picker = self.profile.picker
        start = clock()
        picked = picker.pick(request, candidates, totals)
        durations.append((picker.type_name, name, clock() - start))
        return SchedulingResult(picked, self.profile.name)

    def on_routed(self, request: SchedulingRequest, result: SchedulingResult) -> None:
        """The proxy has its answer: plugins record the pick (the prefix index)."""
        for hook in self._hooks["on_routed"]:
            hook(request, result)

    def on_finished(self, request: SchedulingRequest, endpoint: Endpoint) -> None:
        for hook in self._hooks["on_finished"]:
            hook(request, endpoint)

    def on_pool_changed(self, endpoints: Sequence[Endpoint]) -> None:
        """Discovery added or removed endpoints: plugins drop what they keep for endpoints that are gone."""
        for hook in self._hooks["on_pool_changed"]:
            hook(endpoints)

    @property
    def prefix_scorer(self) -> Any:
        """The profile's prefix-cache scorer (index size and hit ratio for the EPP's metrics), or None."""
        return next((s for _, s, _ in self.profile.scorers if hasattr(s, "hit_ratio")), None)


def _build_plugins(specs: Any) -> dict[str, Any]:
    if not isinstance(specs, list):
        raise ConfigError("scheduler config: `plugins` must be a list of {type, name, parameters}")
    plugins: dict[str, Any] = {}
    for spec in specs:
        if not isinstance(spec, dict) or not isinstance(spec.get("type"), str):
            raise ConfigError(f"each plugin needs a `type` string: {spec!r}")
        unknown = set(spec) - {"type", "name", "parameters"}
        if unknown:
            raise ConfigError(f"plugin {spec['type']!r}: unknown field(s) {', '.join(sorted(map(str, unknown)))}")
        name = spec.get("name") or spec["type"]
        if not isinstance(name, str):
            raise ConfigError(f"plugin name must be a string, got {name!r}")
        if name in plugins:
            raise ConfigError(f"duplicate plugin name {name!r}")
        plugins[name] = build_plugin(spec["type"], spec.get("parameters"))
    return plugins


def _build_profile(specs: Any, plugins: dict[str, Any]) -> Profile:
    if not isinstance(specs, list) or not specs:
        raise ConfigError("scheduler config: `schedulingProfiles` must list one profile")
    if len(specs) > 1:
        raise ConfigError(f"scheduler config: exactly one scheduling profile is supported, got {len(specs)}")
    spec = specs[0]
    if not isinstance(spec, dict) or not isinstance(spec.get("name", "default"), str):
        raise ConfigError(f"a scheduling profile is a mapping with a `name` string: {spec!r}")
    name = spec.get("name", "default")
    refs = spec.get("plugins") or []
    if not isinstance(refs, list):
        raise ConfigError(f"profile {name!r}: `plugins` must be a list of {{pluginRef, weight}}")
    filters: list[tuple[str, Filter]] = []
    scorers: list[tuple[str, Scorer, float]] = []
    pickers: list[tuple[str, Picker]] = []
    for ref in refs:
        plugin_name = ref.get("pluginRef") if isinstance(ref, dict) else None
        if plugin_name not in plugins:
            raise ConfigError(f"profile {name!r} refers to unknown plugin {ref!r}")
        if any(plugin_name == n for n, *_ in (*filters, *scorers, *pickers)):
            raise ConfigError(f"profile {name!r} refers to {plugin_name!r} twice")
        plugin = plugins[plugin_name]
        weight = ref.get("weight", 1)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or weight < 0:
            raise ConfigError(f"profile {name!r}: weight of {plugin_name!r} must be a number >= 0, got {weight!r}")
        if isinstance(plugin, Filter):
            filters.append((plugin_name, plugin))
        if isinstance(plugin, Scorer):
            scorers.append((plugin_name, plugin, float(weight)))
        if isinstance(plugin, Picker):
            pickers.append((plugin_name, plugin))
    if len(pickers) > 1:
        raise ConfigError(f"profile {name!r} has more than one picker: {', '.join(n for n, _ in pickers)}")
    picker = pickers[0] if pickers else ("max-score-picker", build_plugin("max-score-picker"))
    return Profile(name, tuple(filters), tuple(scorers), picker)
