"""The built-in scheduler plugins, one per module, and the table that registers them: a config's plugin `type`
names one of PLUGIN_TYPES (`build_plugin`). A new built-in plugin is a module here and a line in BUILTIN_PLUGINS;
nothing registers by being imported, and no plugin imports this package's table (the scheduler does)."""

from __future__ import annotations

from typing import Any

from epp.config import ConfigError
from epp.scheduling.framework import Plugin
from epp.scheduling.plugins.active_request_scorer import ActiveRequestScorer
from epp.scheduling.plugins.header_based_testing_filter import HeaderBasedTestingFilter
from epp.scheduling.plugins.in_flight_tokens_scorer import InFlightTokensScorer
from epp.scheduling.plugins.kv_cache_utilization_scorer import KVCacheUtilizationScorer
from epp.scheduling.plugins.lora_affinity_scorer import LoRAAffinityScorer
from epp.scheduling.plugins.max_score_picker import MaxScorePicker
from epp.scheduling.plugins.precise_prefix_cache_scorer import PrecisePrefixCacheScorer
from epp.scheduling.plugins.predicted_latency_filter import PredictedLatencyFilter
from epp.scheduling.plugins.predicted_latency_scorer import PredictedLatencyScorer
from epp.scheduling.plugins.prefix_cache_affinity_filter import PrefixCacheAffinityFilter
from epp.scheduling.plugins.prefix_cache_scorer import PrefixCacheScorer
from epp.scheduling.plugins.queue_scorer import QueueScorer
from epp.scheduling.plugins.random_picker import RandomPicker
from epp.scheduling.plugins.replica_stripe_picker import ReplicaStripePicker
from epp.scheduling.plugins.running_requests_size_scorer import RunningRequestsSizeScorer
from epp.scheduling.plugins.session_affinity_scorer import SessionAffinityScorer
from epp.scheduling.plugins.slo_headroom_filter import SLOHeadroomFilter
from epp.scheduling.plugins.slo_interference_filter import SLOInterferenceFilter
from epp.scheduling.plugins.token_load_scorer import TokenLoadScorer
from epp.scheduling.plugins.weighted_random_picker import WeightedRandomPicker
from epp.scheduling.types import TypedName

BUILTIN_PLUGINS: tuple[type[Plugin], ...] = (
    ActiveRequestScorer,
    HeaderBasedTestingFilter,
    InFlightTokensScorer,
    KVCacheUtilizationScorer,
    LoRAAffinityScorer,
    MaxScorePicker,
    PrecisePrefixCacheScorer,
    PredictedLatencyFilter,
    PredictedLatencyScorer,
    PrefixCacheAffinityFilter,
    PrefixCacheScorer,
    QueueScorer,
    RandomPicker,
    ReplicaStripePicker,
    RunningRequestsSizeScorer,
    SessionAffinityScorer,
    SLOHeadroomFilter,
    SLOInterferenceFilter,
    TokenLoadScorer,
    WeightedRandomPicker,
)


def plugin_types(classes: tuple[type[Plugin], ...]) -> dict[str, type[Plugin]]:
    """The classes by their type name (`framework.register`); ValueError when two share one."""
    types: dict[str, type[Plugin]] = {}
    for cls in classes:
        type_name = cls.typed_name.type
        if type_name in types:
            raise ValueError(f"plugin type {type_name!r} registered twice")
        types[type_name] = cls
    return types


PLUGIN_TYPES = plugin_types(BUILTIN_PLUGINS)


def build_plugin(type_name: str, parameters: dict[str, Any] | None = None, name: str | None = None) -> Plugin:
    """A plugin instance from its type name, `parameters` mapping and instance name (default: the type name);
    ConfigError for anything invalid."""
    factory = PLUGIN_TYPES.get(type_name)
    if factory is None:
        raise ConfigError(f"unknown plugin type {type_name!r}; known: {', '.join(sorted(PLUGIN_TYPES))}")
    plugin = factory(parameters)
    if name is not None and name != type_name:
        plugin.typed_name = TypedName(type_name, name)
    return plugin
