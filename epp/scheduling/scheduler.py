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
    flowControl: {...}            # and featureGates: [flowControl=false]; read by epp.flowcontrol

epp.config.loader reads the document and hands the scheduler its sections.

Every plugin the profile refers to also gets the lifecycle hooks it implements (PreRequest, ResponseComplete, ResponseTimed,
PoolChanged); plugins listed under `plugins` but not in the profile get nothing. A profile without a picker gets
`max-score-picker`. With no config at all, DEFAULT_CONFIG (epp.config.loader) applies: the latency predictor's filters (slo-headroom-filter,
slo-interference-filter, predicted-latency-filter: each passes every endpoint until the predictor has learnt from
timings the gateway sends, epp.handlers.accesslog, and is not called until then), then predicted-latency-scorer 5
(`replaces: load`: once the predictor has learnt, it takes the place of the load scorers, queue, KV usage and
in-flight tokens, with their summed weight; their request counts sent long prompts behind another long prompt's
prefill), queue-scorer 2, kv-cache-utilization-scorer 2, prefix-cache-scorer 3 and precise-prefix-cache-scorer 3
(each endpoint gets one of the two: the precise one for endpoints that publish KV events, the approximate one for
the rest; the precise one is not called until an endpoint publishes), lora-affinity-scorer 1 (neutral for
base-model requests, so it only matters for adapters), in-flight-tokens-scorer 1 (a long prompt's prefill, which
request counts miss) and max-score-picker, whose pick the scheduler follows with two fallbacks (RESULT_ENDPOINTS,
for any profile: the gateway retries on them when the pick refuses the connection). Every error in a config is a
ConfigError at startup, including a plugin that consumes data nothing produces (framework.check_data_dependencies).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from time import perf_counter
from typing import Any, NamedTuple

import cython
from prometheus_client.core import GaugeMetricFamily

from epp.config import ConfigError
from epp.config.loader import EndpointPickerConfig, load
from epp.datalayer.endpoint import Endpoint
from epp.datalayer.kv_events import KVBlockIndex
from epp.predictor import LatencyPredictor
from epp.scheduling.decisions import DecisionLog
from epp.scheduling.errors import NoEndpointError
from epp.scheduling.framework import (
    Filter,
    KVEventsConsumer,
    LatencyPredictionReader,
    Picker,
    Plugin,
    PoolChanged,
    PrefixIndexStats,
    PrefixMatchReader,
    PrepareData,
    PreRequest,
    ReplicaAware,
    ResponseComplete,
    ResponseTimed,
    Scorer,
    SharedPrefixIndex,
    Stability,
    check_data_dependencies,
)
from epp.scheduling.plugins import PLUGIN_TYPES, build_plugin
from epp.scheduling.predictions import CandidatePredictions
from epp.scheduling.saturation import SaturationDetector, admit
from epp.scheduling.types import (
    CycleState,
    ResponseInfo,
    SchedulingRequest,
    SchedulingResult,
    StateKey,
    TypedName,
    add_best_scored,
)
from protocol import extproc

log = logging.getLogger(__name__)

# The endpoints a result carries when the candidates allow: the pick and the fallbacks the gateway retries on when the
# pick refuses the connection (the protocol's fallback headers). A picker that returns fewer (one, by default) has its
# list completed with the best-scored other candidates: without them a request sent to a server that died since the
# last scrape fails with a 503 (`epp-bench chaos`, "model server killed"), whatever the profile.
RESULT_ENDPOINTS = 1 + len(extproc.FALLBACK_ENDPOINT_HEADERS)

PREPARE_TIMINGS: StateKey[list[tuple[TypedName, float]]] = StateKey("prepare-timings")


@dataclass(frozen=True)
class Profile:
    """A profile resolved once at startup into the lists the request path walks."""

    name: str
    plugins: tuple[Plugin, ...]  # every plugin the profile refers to, in its order, each once (hooks reach these)
    filters: tuple[Filter, ...]  # in the profile's order
    scorers: tuple[tuple[Scorer, float], ...]  # (scorer, weight)
    picker: Picker


class CyclePlugins(NamedTuple):
    """The plugins of a profile that one scheduling cycle runs, in the profile's order (Scheduler.cycle_plugins)."""

    prepare: tuple[PrepareData, ...]
    filters: tuple[Filter, ...]
    scorers: tuple[tuple[Scorer, float], ...]  # (scorer, weight)


@cython.annotation_typing(True)
def add_weighted(totals: list[float], scores: Sequence[float], weight: float) -> None:
    """totals[i] += weight x scores[i] clamped to [0, 1] (NaN as 0: every comparison with NaN is false), in place,
    with types.clamp_score's expression inlined: a call per score would cost more than the sum itself. ValueError
    when the lengths differ (a scorer's bug). Compiled, its floats are C doubles (the annotations, typed): each
    request sums five scorers over every candidate, and with Python floats boxed and compared by the interpreter's
    protocol this loop was 15,000 of the request path's instructions (docs/2026-11-29-redesign.md)."""
    if len(scores) != len(totals):
        raise ValueError(f"{len(scores)} scores for {len(totals)} candidates")
    for i in range(len(totals)):
        s: float = scores[i]
        total: float = totals[i]
        totals[i] = total + weight * (s if 0.0 <= s <= 1.0 else (1.0 if s > 1.0 else 0.0))


class Scheduler:
    """Runs one profile per request. The request path calls admit, schedule, on_picked when the pick is final,
    on_routed once the proxy has its answer and on_finished when the request is over; discovery calls
    on_pool_changed. The profile's plugins are checked (check_data_dependencies) and listed in the log at startup.

    The at-pick hooks of a pick (on_picked) run before anything else reaches the plugins (the next cycle, any other
    hook, a pool change) or at record_picks(), which the director calls once the proxy has its answer, whichever
    comes first: a lone request's answer does not wait for them, and a burst's next decision still sees them."""

    def __init__(
        self,
        profile: Profile,
        detector: SaturationDetector | None = None,
        predictions: CandidatePredictions | None = None,
    ):
        self.profile = profile
        self.detector = detector or SaturationDetector()
        plugins = profile.plugins
        check_data_dependencies(profile.name, plugins)
        for p in plugins:
            consumes = ", ".join(k.name if isinstance(k, StateKey) else k for k in p.consumes)
            produces = ", ".join(k.name for k in p.produces)
            log.info("profile %s: %s consumes [%s] produces [%s]", profile.name, p.typed_name, consumes, produces)
        self._prepare = [p for p in plugins if isinstance(p, PrepareData)]
        self._kv_events = [p for p in plugins if isinstance(p, KVEventsConsumer)]
        self._at_pick = [p for p in plugins if isinstance(p, PreRequest) and p.at_pick]
        self._pre_request = [p for p in plugins if isinstance(p, PreRequest) and not p.at_pick]
        self._unrecorded: list[tuple[SchedulingRequest, SchedulingResult]] = []  # picks whose at-pick hooks wait
        self._response_complete = [p for p in plugins if isinstance(p, ResponseComplete)]
        self._response_timed = [p for p in plugins if isinstance(p, ResponseTimed)]
        self._pool_changed = [p for p in plugins if isinstance(p, PoolChanged)]
        self._replica_aware = [p for p in plugins if isinstance(p, ReplicaAware)]
        self.prefix_index: PrefixIndexStats | None = next((p for p in plugins if isinstance(p, PrefixIndexStats)), None)
        # the prefix index EPP replicas share (epp.replicas), when the profile has one
        self.shared_prefix_index = next((p for p in plugins if isinstance(p, SharedPrefixIndex)), None)
        for p in plugins:
            if isinstance(p, PrefixMatchReader):
                if self.prefix_index is None:
                    raise ConfigError(f"profile {profile.name!r}: {p.typed_name} reads a prefix index it has none of")
                p.use_prefix_index(self.prefix_index)
        # One latency predictor for every plugin of the profile that reads one (`predictions`, when given, is one
        # trained elsewhere); its predictions count what the prefix index expects cached.
        readers = [p for p in plugins if isinstance(p, LatencyPredictionReader)]
        if predictions is None and readers:
            predictions = readers[0].predictions
        self.predictions = predictions
        for p in readers:
            p.use_predictions(predictions)
        self._trains_predictor = any(isinstance(p, ResponseTimed) for p in readers)
        self._kv_index: KVBlockIndex | None = None
        self.decisions: DecisionLog | None = None  # the last decisions, when the status page keeps them
        # A plugin whose data source has given nothing yet would prepare nothing, pass every endpoint or abstain:
        # the latency predictor's readers until it predicts, the KV-event readers (`requires_kv_events`) until an
        # endpoint publishes events. A cycle leaves them out (cycle_plugins: no call, no timing); their hooks still
        # run (the predictor learns from the requests it routes). The default profile: 902 -> 874 thousand
        # instructions a request for the predictor's readers (`epp-bench handler-cpu --instructions`).
        self._cycles = tuple(  # at 2 * kv_events + predicting
            self._plugins_that_run(predicting, kv_events) for kv_events in (False, True) for predicting in (False, True)
        )
        if predictions is not None and self.prefix_index is not None:
            predictions.cached_tokens = self.prefix_index.cached_tokens
            predictions.unknown_tokens = self.prefix_index.unknown_endpoint_tokens

    @classmethod
    def from_config(
        cls,
        config_text: str | None = None,
        predictions: CandidatePredictions | None = None,
        allow_experimental_plugins: bool = False,
    ) -> Scheduler:
        """Build from EndpointPickerConfig YAML (None or "" -> DEFAULT_CONFIG), read by the config loader; see
        from_sections. Raises ConfigError."""
        return cls.from_sections(load(config_text), predictions, allow_experimental_plugins)

    @classmethod
    def from_sections(
        cls,
        config: EndpointPickerConfig,
        predictions: CandidatePredictions | None = None,
        allow_experimental_plugins: bool = False,
    ) -> Scheduler:
        """Build from the sections of a loaded EndpointPickerConfig the scheduler owns: plugins, schedulingProfiles
        and saturationDetector. Its plugins read `predictions` when given (a latency predictor trained elsewhere).
        An Alpha plugin is built only with `allow_experimental_plugins` (the EPP's --allow-experimental-plugins,
        as llm-d's). Raises ConfigError."""
        plugins = _build_plugins(config.plugins, allow_experimental_plugins)
        profile = _build_profile(config.scheduling_profiles, plugins)
        return cls(profile, SaturationDetector.from_config(config.saturation_detector), predictions)

    @property
    def latency_predictor(self) -> LatencyPredictor | None:
        """The predictor the profile trains (one of its readers learns from the responses' timings), whose error
        the EPP exports; None when no plugin trains one."""
        return self.predictions.predictor if self._trains_predictor else None

    def collect(self):
        """The prefix index's and the latency predictor's metrics, when the profile has them (read when Prometheus
        scrapes)."""
        index = self.prefix_index
        if index is not None:
            size = GaugeMetricFamily("inference_extension_prefix_indexer_size", "Size of the prefix indexer.")
            size.add_metric([], index.index_size)
            ratio = GaugeMetricFamily(
                "inference_extension_prefix_indexer_hit_ratio",
                "Fraction of prompt blocks found on the chosen endpoint, over all requests.",
            )
            ratio.add_metric([], index.hit_ratio)
            yield from (size, ratio)
        predictor = self.latency_predictor
        if predictor is not None:
            yield from predictor.collect()

    def admit(self, request: SchedulingRequest, endpoints: Sequence[Endpoint]) -> None:
        """Raise ShedError (429) for a sheddable request while the pool is saturated."""
        admit(request, endpoints, self.detector)

    @property
    def requires_kv_events(self) -> bool:
        """A plugin of the profile reads the KV-event index (the EPP then runs its subscriber)."""
        return any(p.requires_kv_events for p in self._kv_events)

    @property
    def kv_index(self) -> KVBlockIndex | None:
        """The KV-event index the profile's plugins read, when the EPP runs its subscriber."""
        return self._kv_index

    @property
    def weights(self) -> dict[TypedName, float]:
        """Each scorer's weight in the profile (the status page's totals)."""
        return {scorer.typed_name: weight for scorer, weight in self.profile.scorers}

    def use_kv_index(self, index: KVBlockIndex) -> None:
        self._kv_index = index
        for p in self._kv_events:
            p.use_kv_index(index)

    def use_replicas(self, position: Callable[[], tuple[int, int]]) -> None:
        """This replica's rank and the live replicas' count (`epp.replicas.ReplicaChannel.position`)."""
        for p in self._replica_aware:
            p.use_replicas(position)

    def _plugins_that_run(self, predicting: bool, kv_events: bool) -> CyclePlugins:
        def runs(p: Plugin) -> bool:
            return (predicting or not isinstance(p, LatencyPredictionReader)) and (
                kv_events or not (isinstance(p, KVEventsConsumer) and p.requires_kv_events)
            )

        profile = self.profile
        return CyclePlugins(
            tuple(p for p in self._prepare if runs(p)),
            tuple(f for f in profile.filters if runs(f)),
            tuple(pair for pair in profile.scorers if runs(pair[0])),
        )

    def cycle_plugins(self) -> CyclePlugins:
        """The PrepareData plugins, filters and scorers a cycle runs now: those whose data source has something
        (see __init__)."""
        predictions, index = self.predictions, self._kv_index
        predicting = predictions is None or predictions.predictor.ttft_ready
        kv_events = index is not None and index.has_publishers
        return self._cycles[2 * kv_events + predicting]

    def prepare(self, request: SchedulingRequest) -> CycleState | Awaitable[CycleState]:
        """The request's cycle state after the PrepareData plugins (exact tokens, block hashes): returned as is, or
        an awaitable of it when a plugin asked for a worker thread (a long prompt)."""
        self.record_picks()
        cycle_state = CycleState()
        plugins = self.cycle_plugins().prepare
        if not plugins:
            return cycle_state
        for p in plugins:
            if p.in_thread(request):
                return asyncio.to_thread(self._run_prepare, plugins, cycle_state, request)
        return self._run_prepare(plugins, cycle_state, request)

    def _run_prepare(
        self, plugins: tuple[PrepareData, ...], cycle_state: CycleState, request: SchedulingRequest
    ) -> CycleState:
        timings = []
        clock = perf_counter
        start = clock()
        for p in plugins:
            try:
                p.prepare(cycle_state, request)
            except Exception:  # a plugin's bug must not fail the request: its scorer abstains
                log.exception("%s failed to prepare request %s", p.typed_name, request.request_id)
            end = clock()
            timings.append((p.typed_name, end - start))
            start = end
        cycle_state.write(PREPARE_TIMINGS, timings)
        return cycle_state

    def schedule(
        self, request: SchedulingRequest, endpoints: Sequence[Endpoint], cycle_state: CycleState | None = None
    ) -> SchedulingResult:
        """Endpoints for a request, best first, with each scorer's scores and each plugin's time. Raises
        NoEndpointError when nothing can serve it.

        Candidates are the endpoints in `request.subset` (when given) that are not stale; stale ones only when no
        fresh one is left (an endpoint that missed a few scrapes may still serve, and a 503 certainly does not), and
        never one that has not served a valid metrics page yet: it may be no model server at all (a wrong port, a
        web server answering 404), whose answer the client would get instead of the 503.
        """
        self.record_picks()
        subset = request.subset
        if subset is not None:
            endpoints = [e for e in endpoints if e.hostport in subset]
        candidates = [e for e in endpoints if not e.stale] or [e for e in endpoints if e.metrics is not None]
        considered = len(candidates)
        if not candidates:
            raise NoEndpointError("no endpoint in the subset hint" if subset is not None else "no ready endpoint")
        clock = perf_counter
        if cycle_state is None:
            cycle_state = CycleState()
        timings: list[tuple[TypedName, float]] = list(cycle_state.read(PREPARE_TIMINGS) or ())
        _, filters, scorers = self.cycle_plugins()
        # one clock reading per plugin: each one's end is the next one's start
        start = clock()
        for f in filters:
            candidates = f.filter(cycle_state, request, candidates)
            end = clock()
            timings.append((f.typed_name, end - start))
            start = end
            if not candidates:
                raise NoEndpointError(f"no endpoint left after filter {f.typed_name.name!r}")
        totals = [0.0] * len(candidates)
        raw_scores: dict[TypedName, list[float]] = {}
        replaced: tuple[str, ...] = ()
        for scorer, weight in scorers:
            if replaced and scorer.typed_name.type in replaced:
                continue
            scores = scorer.score(cycle_state, request, candidates)
            if scores is not None:
                replaced = scorer.replaces or replaced
                raw_scores[scorer.typed_name] = scores
                add_weighted(totals, scores, weight)
            end = clock()
            timings.append((scorer.typed_name, end - start))
            start = end
        picker = self.profile.picker
        picked = picker.pick(cycle_state, request, candidates, totals)
        timings.append((picker.typed_name, clock() - start))
        if len(picked) < RESULT_ENDPOINTS and len(candidates) > len(picked):
            picked = list(picked)
            add_best_scored(picked, candidates, totals, RESULT_ENDPOINTS)
        result = SchedulingResult(picked, self.profile.name, candidates, raw_scores, timings, cycle_state, totals)
        if self.decisions is not None:  # the one place a decision is recorded
            self.decisions.record(request, result, considered)
        return result

    def on_picked(self, request: SchedulingRequest, result: SchedulingResult) -> None:
        """The pick is final: PreRequest plugins with `at_pick` record it, at record_picks() or before anything
        else reaches the plugins (see the class docstring)."""
        if self._at_pick:
            self._unrecorded.append((request, result))

    def record_picks(self) -> None:
        """Run the at-pick hooks of the picks made since the last call, in the order they were made."""
        unrecorded = self._unrecorded
        if not unrecorded:
            return
        self._unrecorded = []
        for request, result in unrecorded:
            for p in self._at_pick:
                p.pre_request(request, result)

    def on_routed(self, request: SchedulingRequest, result: SchedulingResult) -> None:
        """The proxy has its answer: the other PreRequest plugins record the pick (the prefix index)."""
        self.record_picks()
        for p in self._pre_request:
            p.pre_request(request, result)

    def on_finished(
        self, request: SchedulingRequest, result: SchedulingResult, endpoint: Endpoint, response: ResponseInfo
    ) -> None:
        """The request is over: ResponseComplete plugins see it with its scheduling result and how it went."""
        self.record_picks()
        for p in self._response_complete:
            p.response_complete(request, result, endpoint, response)

    @property
    def wants_timings(self) -> bool:
        """Whether a plugin reads responses' timings (the director then keeps what it needs to deliver them)."""
        return bool(self._response_timed)

    def on_timed(
        self, request: SchedulingRequest, result: SchedulingResult, endpoint: Endpoint, ttft: float, tpot: float | None
    ) -> None:
        """A streamed response's timings are known: ResponseTimed plugins see them."""
        self.record_picks()
        for p in self._response_timed:
            p.response_timed(request, result, endpoint, ttft, tpot)

    def on_pool_changed(self, endpoints: Sequence[Endpoint]) -> None:
        """Discovery added or removed endpoints: plugins drop what they keep for endpoints that are gone."""
        self.record_picks()
        for p in self._pool_changed:
            p.pool_changed(endpoints)


def _build_plugins(specs: Any, allow_experimental: bool = False) -> dict[str, Plugin]:
    """The plugin instances by name. Every plugin is built before any error is raised, so that one ConfigError names
    every unknown type, every unsupported parameter and every Alpha plugin (without `allow_experimental`) of the
    document (a config written for llm-d's router fails at startup with the whole list, never runs in part)."""
    if not isinstance(specs, list):
        raise ConfigError("scheduler config: `plugins` must be a list of {type, name, parameters}")
    plugins: dict[str, Plugin] = {}
    errors: list[str] = []
    unknown_types: list[str] = []
    for spec in specs:
        if isinstance(spec, dict) and isinstance(spec.get("type"), str) and spec["type"] not in PLUGIN_TYPES:
            unknown_types.append(spec["type"])
            continue
        try:
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
            plugins[name] = build_plugin(spec["type"], spec.get("parameters"), name)
        except ConfigError as error:
            errors.append(str(error))
    if unknown_types:
        known = ", ".join(sorted(PLUGIN_TYPES))
        errors.insert(0, f"unsupported plugin type(s) {', '.join(unknown_types)} (known: {known})")
    alpha = [plugin.typed_name for plugin in plugins.values() if plugin.stability is Stability.ALPHA]
    if alpha and not allow_experimental:
        named = ", ".join(f"{t.name!r} (type {t.type!r})" for t in alpha)
        errors.append(
            f"plugin(s) {named} have the Alpha stability level: start the EPP with --allow-experimental-plugins"
        )
    if errors:
        raise ConfigError("; ".join(errors) if len(errors) == 1 else f"{len(errors)} errors: " + "; ".join(errors))
    return plugins


def _build_profile(specs: Any, plugins: dict[str, Plugin]) -> Profile:
    if not isinstance(specs, list) or not specs:
        raise ConfigError("scheduler config: `schedulingProfiles` must list one profile")
    if len(specs) > 1:
        raise ConfigError(f"scheduler config: exactly one scheduling profile is supported, got {len(specs)}")
    spec = specs[0]
    if not isinstance(spec, dict) or not isinstance(spec.get("name", "default"), str):
        raise ConfigError(f"a scheduling profile is a mapping with a `name` string: {spec!r}")
    name = spec.get("name", "default")
    unknown = set(spec) - {"name", "plugins"}
    if unknown:
        raise ConfigError(f"profile {name!r}: unknown field(s) {', '.join(sorted(map(str, unknown)))}")
    refs = spec.get("plugins") or []
    if not isinstance(refs, list):
        raise ConfigError(f"profile {name!r}: `plugins` must be a list of {{pluginRef, weight}}")
    referred: dict[str, Plugin] = {}
    scorers: list[tuple[Scorer, float]] = []
    for ref in refs:
        plugin_name = ref.get("pluginRef") if isinstance(ref, dict) else None
        if plugin_name not in plugins:
            raise ConfigError(f"profile {name!r} refers to unknown plugin {ref!r}")
        unknown = set(ref) - {"pluginRef", "weight"}
        if unknown:
            raise ConfigError(f"profile {name!r}, {plugin_name!r}: unknown field(s) {', '.join(sorted(unknown))}")
        if plugin_name in referred:
            raise ConfigError(f"profile {name!r} refers to {plugin_name!r} twice")
        referred[plugin_name] = plugins[plugin_name]
        weight = ref.get("weight", 1)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or weight < 0:
            raise ConfigError(f"profile {name!r}: weight of {plugin_name!r} must be a number >= 0, got {weight!r}")
        if isinstance(plugins[plugin_name], Scorer):
            scorers.append((plugins[plugin_name], float(weight)))
    pickers = [p for p in referred.values() if isinstance(p, Picker)]
    if len(pickers) > 1:
        raise ConfigError(f"profile {name!r} has more than one picker: {', '.join(p.typed_name.name for p in pickers)}")
    picker = pickers[0] if pickers else build_plugin("max-score-picker")
    members = tuple(referred.values()) if pickers else (*referred.values(), picker)
    if any(isinstance(p, PrefixMatchReader) for p in members) and not any(
        isinstance(p, PrefixIndexStats) for p in members
    ):  # the readers' prefix index, recording picks without scoring (framework.PrefixMatchReader)
        members = (*members, build_plugin("prefix-cache-scorer"))
    filters = tuple(p for p in members if isinstance(p, Filter))
    scorers.sort(key=lambda pair: not pair[0].replaces)  # replacing scorers first (Scorer.replaces); stable
    return Profile(name, members, filters, tuple(scorers), picker)
