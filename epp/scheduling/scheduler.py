"""The scheduler: a profile of filters -> weighted scorers -> picker, built from an EndpointPickerConfig.

The config is GIE's shape:

    apiVersion: inference.networking.x-k8s.io/v1alpha1
    kind: EndpointPickerConfig
    plugins:                      # instances: type, optional name (defaults to type) and parameters
    - type: prefix-cache-scorer
      parameters: {blockSize: 16}
    schedulingProfiles:           # the first profile is used
    - name: default
      plugins:
      - pluginRef: prefix-cache-scorer
        weight: 3
    saturationDetector: {queueDepthThreshold: 5, kvCacheUtilThreshold: 0.8}

A profile without a picker gets `max-score-picker`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from epp.datalayer.endpoint import Endpoint
from epp.scheduling.errors import ConfigError, NoEndpointError
from epp.scheduling.framework import Filter, Picker, Scorer, build_plugin
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
  - pluginRef: max-score-picker
"""


@dataclass
class Profile:
    name: str
    filters: list[tuple[str, Filter]] = field(default_factory=list)
    scorers: list[tuple[str, Scorer, float]] = field(default_factory=list)
    picker: tuple[str, Picker] | None = None


class Scheduler:
    def __init__(self, profile: Profile, plugins: dict[str, Any], detector: SaturationDetector | None = None):
        self.profile = profile
        self.plugins = plugins
        self.detector = detector or SaturationDetector()
        self._hooks = [p for p in plugins.values() if hasattr(p, "on_routed")]
        self.last_plugin_durations: list[tuple[str, str, float]] = []  # (type, name, seconds) of the last call

    @classmethod
    def from_config(cls, config_text: str | None = None) -> Scheduler:
        try:
            config = yaml.safe_load(config_text or DEFAULT_CONFIG)
        except yaml.YAMLError as exc:
            raise ConfigError(f"scheduler config is not valid YAML: {exc}") from None
        if not isinstance(config, dict):
            raise ConfigError("scheduler config must be a mapping (an EndpointPickerConfig)")
        if config.get("kind", "EndpointPickerConfig") != "EndpointPickerConfig":
            raise ConfigError(f"scheduler config kind must be EndpointPickerConfig, got {config.get('kind')!r}")
        plugins: dict[str, Any] = {}
        for spec in config.get("plugins") or []:
            if not isinstance(spec, dict) or not isinstance(spec.get("type"), str):
                raise ConfigError(f"each plugin needs a `type`: {spec!r}")
            name = spec.get("name") or spec["type"]
            if name in plugins:
                raise ConfigError(f"duplicate plugin name {name!r}")
            plugins[name] = build_plugin(spec["type"], spec.get("parameters"))
        profiles = config.get("schedulingProfiles") or []
        if not profiles or not isinstance(profiles[0], dict):
            raise ConfigError("schedulingProfiles must list at least one profile")
        first = profiles[0]
        profile = Profile(str(first.get("name", "default")))
        for ref in first.get("plugins") or []:
            name = ref.get("pluginRef") if isinstance(ref, dict) else None
            if name not in plugins:
                raise ConfigError(f"profile {profile.name!r} refers to unknown plugin {name!r}")
            plugin = plugins[name]
            weight = ref.get("weight", 1)
            if isinstance(weight, bool) or not isinstance(weight, int | float) or weight < 0:
                raise ConfigError(f"plugin {name!r}: weight must be a non-negative number, got {weight!r}")
            if isinstance(plugin, Filter):
                profile.filters.append((name, plugin))
            if isinstance(plugin, Scorer):
                profile.scorers.append((name, plugin, float(weight)))
            if isinstance(plugin, Picker):
                if profile.picker is not None:
                    raise ConfigError(f"profile {profile.name!r} has more than one picker")
                profile.picker = (name, plugin)
        if profile.picker is None:
            picker = build_plugin("max-score-picker", {})
            plugins.setdefault("max-score-picker", picker)
            profile.picker = ("max-score-picker", picker)
        detector_config = config.get("saturationDetector") or {}
        detector = SaturationDetector(
            queue_depth_threshold=detector_config.get("queueDepthThreshold", 5),
            kv_cache_util_threshold=detector_config.get("kvCacheUtilThreshold", 0.8),
        )
        return cls(profile, plugins, detector)

    def admit(self, request: SchedulingRequest, endpoints: Sequence[Endpoint]) -> None:
        admit(request, endpoints, self.detector)

    def schedule(self, request: SchedulingRequest, endpoints: Sequence[Endpoint]) -> SchedulingResult:
        """Pick endpoints for a request, best first. Raises NoEndpointError when nothing can serve it."""
        candidates = list(endpoints)
        if request.subset is not None:
            candidates = [e for e in candidates if e.hostport in request.subset]
        fresh = [e for e in candidates if not e.stale]
        candidates = fresh or candidates  # stale endpoints only when nothing better is left
        if not candidates:
            raise NoEndpointError("no ready endpoint" + (" in the subset hint" if request.subset is not None else ""))
        durations = self.last_plugin_durations = []
        clock = time.perf_counter
        for name, plugin in self.profile.filters:
            start = clock()
            candidates = plugin.filter(request, candidates)
            durations.append((plugin.type_name, name, clock() - start))
            if not candidates:
                raise NoEndpointError(f"no endpoint left after filter {name!r}")
        totals = [0.0] * len(candidates)
        for name, scorer, weight in self.profile.scorers:
            start = clock()
            for i, score in enumerate(scorer.score(request, candidates)):
                totals[i] += weight * score
            durations.append((scorer.type_name, name, clock() - start))
        name, picker = self.profile.picker
        start = clock()
        picked = picker.pick(request, candidates, totals)
        durations.append((picker.type_name, name, clock() - start))
        if not picked:
            raise NoEndpointError("the picker chose no endpoint")
        return SchedulingResult(picked, self.profile.name)

    def on_routed(self, request: SchedulingRequest, result: SchedulingResult) -> None:
        for hook in self._hooks:
            hook.on_routed(request, result)

    def on_finished(self, request: SchedulingRequest, endpoint: Endpoint) -> None:
        for hook in self._hooks:
            hook.on_finished(request, endpoint)

    def on_pool_changed(self, endpoints: Sequence[Endpoint]) -> None:
        for hook in self._hooks:
            hook.on_pool_changed(endpoints)

    @property
    def prefix_scorer(self):
        return next((p for p in self.plugins.values() if hasattr(p, "hit_ratio")), None)
