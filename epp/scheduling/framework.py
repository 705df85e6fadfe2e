"""The plugin framework: filters narrow the candidates, scorers rate them in [0, 1] with a weight, a picker
chooses; lifecycle hooks see the request after it was routed, when it finished, and when the pool changed.

A plugin is one class in one module of `epp.scheduling.plugins`, named with `@register("type-name", Stability.X)` (its
type and stability level) and listed in that package's BUILTIN_PLUGINS, built
from its GIE-style `parameters` mapping at startup (invalid ones raise ConfigError there, never on the request
path). It derives from `Plugin` and declares each extension point it implements by inheriting its base class
(Filter, Scorer, Picker, PrepareData, PreRequest, ResponseComplete, ResponseTimed, PoolChanged; a prefix index also PrefixIndexStats,
which the EPP's metrics read, and KVEventsConsumer to read the KV-event index); the scheduler collects plugins by these types. It also declares the data it reads and writes (`consumes`, `produces`), which the scheduler
checks at startup. All extension points run synchronously on the event loop (no I/O, no awaits), except PrepareData,
which the director may run in a worker thread.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import fields
from enum import StrEnum
from typing import Any, ClassVar

from epp.config import ConfigError
from epp.config.parameters import Parameters as Parameters  # plugins read their parameters with it
from epp.datalayer.endpoint import Endpoint, EndpointSpec
from epp.datalayer.kv_events import KVBlockIndex
from epp.predictor import LatencyPredictor
from epp.scheduling.predictions import CandidatePredictions
from epp.scheduling.types import CycleState, ResponseInfo, SchedulingRequest, SchedulingResult, StateKey, TypedName
from protocol.metrics import EndpointMetrics

# What the data layer fills in on every endpoint (discovery, the scrapes, the EPP's own in-flight counters): the
# endpoint attributes a plugin may name in `consumes`.
ENDPOINT_ATTRIBUTES = frozenset(
    f.name for c in (EndpointSpec, Endpoint, EndpointMetrics) for f in fields(c) if f.name not in ("spec", "metrics")
)


class Stability(StrEnum):
    """A plugin type's stability level, llm-d router's three (its `pkg/epp/framework/plugins/README.md`): an Alpha
    plugin may change or go in any release and runs only with `--allow-experimental-plugins`; Beta keeps its
    parameters and behaviour within a release and is deprecated before it goes; Stable changes only in a major
    release."""

    ALPHA = "Alpha"
    BETA = "Beta"
    STABLE = "Stable"


class Plugin(ABC):
    """Base of every scheduler plugin. A registered plugin class is built as `cls(parameters)`.

    typed_name: the plugin's type and instance name (set by `register` and `epp.scheduling.plugins.build_plugin`).
    stability: its type's stability level (set by `register`).
    consumes: the data it reads: endpoint attributes by name (ENDPOINT_ATTRIBUTES) and cycle-state keys.
    produces: the cycle-state keys it writes.
    """

    typed_name: TypedName
    stability: ClassVar[Stability]
    consumes: ClassVar[tuple[str | StateKey[Any], ...]] = ()
    produces: ClassVar[tuple[StateKey[Any], ...]] = ()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.typed_name}>"


class Filter(Plugin):
    @abstractmethod
    def filter(self, cycle_state: CycleState, request: SchedulingRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        """The candidates that may serve the request (a sub-list, in any order; empty means none)."""


class Scorer(Plugin):
    # Plugin types whose signals this scorer's scores already contain (a latency prediction from the queue, the KV
    # usage, the prefix match, ...): for a request it scores (not None) the scheduler skips those scorers, so that
    # nothing counts twice; when it abstains they decide. Such a scorer runs before the others of its profile. A
    # class default: an instance may set its own (predicted-latency-scorer's `replaces` parameter).
    replaces: tuple[str, ...] = ()

    @abstractmethod
    def score(
        self, cycle_state: CycleState, request: SchedulingRequest, endpoints: list[Endpoint]
    ) -> list[float] | None:
        """One score in [0, 1] per candidate, in the candidates' order; higher is better (the scheduler clamps
        values outside [0, 1] and counts NaN as 0). None means no preference for this request (it adds nothing to
        any candidate), which spares building a list of equal scores on the common path (no prompt blocks known
        anywhere, a base-model request)."""


class Picker(Plugin):
    @abstractmethod
    def pick(
        self, cycle_state: CycleState, request: SchedulingRequest, endpoints: list[Endpoint], scores: list[float]
    ) -> list[Endpoint]:
        """At least one endpoint, best first, from the candidates and their weighted total scores."""


class PreRequest(Plugin):
    # False: the hook runs after the EPP answered the proxy (off the request's critical path: the prefix index).
    # True: once the proxy has its answer too, but before anything else reaches the plugins (Scheduler.on_picked),
    # for bookkeeping that the next request's decision must see: a burst's requests are all scheduled before any
    # answer goes out (the latency predictor's backlog).
    at_pick: ClassVar[bool] = False

    @abstractmethod
    def pre_request(self, request: SchedulingRequest, result: SchedulingResult) -> None:
        """The request was routed (see `at_pick` for when this is called)."""


class ResponseComplete(Plugin):
    @abstractmethod
    def response_complete(
        self, request: SchedulingRequest, result: SchedulingResult, endpoint: Endpoint, response: ResponseInfo
    ) -> None:
        """The request is over (its ext_proc stream ended); `endpoint` is the one it was routed to."""


class ResponseTimed(Plugin):
    @abstractmethod
    def response_timed(
        self, request: SchedulingRequest, result: SchedulingResult, endpoint: Endpoint, ttft: float, tpot: float | None
    ) -> None:
        """How fast a routed, streamed response came, from the first source that saw it: seconds from the routing
        answer to its first token (`ttft`) and mean seconds per later token (`tpot`, None when unknown). Sources: the
        response body streamed through the EPP, at the request's end (both figures), or the proxy's access log,
        shortly after it (TTFT only; `epp.handlers.accesslog`). At most once per request, and not for every request:
        only those a source saw."""


class PrepareData(Plugin):
    """Reads the request before its scheduling cycle and writes what the scorers need into the cycle state (GIE's
    PrepareData), e.g. the prompt's exact tokens. The one extension point that may be slow: when `in_thread` says
    so for a request, the director runs `prepare` in a worker thread and the event loop serves other requests
    meanwhile; it must then only touch the cycle state and its own thread-safe state."""

    @abstractmethod
    def in_thread(self, request: SchedulingRequest) -> bool:
        """Whether preparing this request is long enough (a long prompt) to be worth a worker thread."""

    @abstractmethod
    def prepare(self, cycle_state: CycleState, request: SchedulingRequest) -> None:
        """Write what this request's cycle needs into `cycle_state`; must not raise for a bad request (the
        scorers then abstain)."""


class KVEventsConsumer(Plugin):
    """Reads the index the model servers' KV events build (`epp.datalayer.kv_events.KVBlockIndex`).
    `requires_kv_events`: the EPP starts its KV-event subscriber only when some plugin of the profile requires it
    (the others, e.g. the approximate prefix scorer, only step aside for endpoints the index covers), and the
    scheduler does not call such a plugin's filter, scorer or preparation until an endpoint publishes events."""

    requires_kv_events: ClassVar[bool] = False

    @abstractmethod
    def use_kv_index(self, index: KVBlockIndex) -> None:
        """The EPP's KV-event index, handed over at startup when the subscriber runs."""


class PoolChanged(Plugin):
    @abstractmethod
    def pool_changed(self, endpoints: Sequence[Endpoint]) -> None:
        """Discovery added or removed endpoints; `endpoints` is the whole pool now."""


class SharedPrefixIndex(Plugin):
    """A prefix index that EPP replicas share (`epp.replicas`): it hands each pick it records to `learned`
    (endpoint hostport, the prompt's block hashes) when replicas are wired, and records a peer's pick in `learn`."""

    learned: Callable[[str, list[int]], None] | None = None

    @abstractmethod
    def learn(self, endpoint: Endpoint, hashes: list[int]) -> None:
        """A peer replica routed a prompt with these block hashes to `endpoint`: remember it as if this one had."""


class ReplicaAware(Plugin):
    """Decides knowing this EPP's place among the active-active replicas that share the pool (`epp.replicas`)."""

    @abstractmethod
    def use_replicas(self, position: Callable[[], tuple[int, int]]) -> None:
        """`position()` is this replica's rank among the replicas whose channel is live, and their count (itself
        included): (0, 1) alone. Handed over at startup when the EPP has peers (`--replica-peers`)."""


class PrefixIndexStats(Plugin):
    """A prefix index whose size and hit ratio the EPP exports (inference_extension_prefix_indexer_*)."""

    @property
    @abstractmethod
    def index_size(self) -> int:
        """Entries in the index."""

    @abstractmethod
    def entries(self, endpoint: Endpoint) -> int:
        """Entries in the index for one endpoint (the status page)."""

    @abstractmethod
    def cached_tokens(
        self, cycle_state: CycleState, request: SchedulingRequest, endpoints: Sequence[Endpoint]
    ) -> list[int]:
        """Prompt tokens of `request` that each of `endpoints` probably holds in its prefix cache."""

    @abstractmethod
    def unknown_endpoint_tokens(
        self, cycle_state: CycleState, request: SchedulingRequest, endpoints: Sequence[Endpoint]
    ) -> list[int]:
        """Prompt tokens of `request` to expect cached on each of `endpoints` that the index knows nothing of (a
        server new to the pool): what the latency predictor compares candidates with, beside `cached_tokens`."""

    @property
    @abstractmethod
    def hit_ratio(self) -> float:
        """Share of the routed prompts' blocks found on the chosen endpoint."""

    @abstractmethod
    def match_fractions(
        self, cycle_state: CycleState, request: SchedulingRequest, endpoints: Sequence[Endpoint]
    ) -> list[float]:
        """The share of `request`'s prompt blocks each of `endpoints` probably holds (0 to 1), without any load
        correction; computed once per cycle (llm-d's PrefixCacheMatchInfo: match blocks / total blocks)."""


class PrefixMatchReader(Plugin):
    """Reads the profile's prefix index (`PrefixIndexStats.match_fractions`), handed over by the scheduler
    (`use_prefix_index`). A profile with such a reader and no prefix index gets a `prefix-cache-scorer` that only
    records picks (it scores nothing), as llm-d creates its approximate prefix producer for its readers."""

    prefix_index: PrefixIndexStats

    def use_prefix_index(self, index: PrefixIndexStats) -> None:
        self.prefix_index = index


class LatencyPredictionReader(Plugin):
    """Reads the latency predictor's predictions (`epp.scheduling.predictions.CandidatePredictions`). A scheduler has one
    predictor and hands it to every plugin of its profile that reads one (`use_predictions`): what one plugin feeds
    (a reader that is also ResponseTimed learns from the responses), the others read, and no two schedulers share
    one. A plugin built alone reads a predictor of its own. Until the predictor predicts (`ttft_ready`), a reader's
    filter passes every endpoint and its score abstains: the scheduler does not call (nor time) them until then."""

    predictions: CandidatePredictions

    def own_predictor(self) -> None:
        """Start with a predictor of its own (called by the plugin's constructor)."""
        self.predictions = CandidatePredictions(LatencyPredictor())

    def use_predictions(self, predictions: CandidatePredictions) -> None:
        self.predictions = predictions


EXTENSION_POINTS = (Filter, Scorer, Picker, PreRequest, ResponseComplete, ResponseTimed, PoolChanged, PrepareData)


def check_data_dependencies(profile: str, plugins: Iterable[Plugin]) -> None:
    """ConfigError when a plugin consumes an endpoint attribute the data layer does not produce, or a cycle-state
    key that no plugin of the profile produces."""
    plugins = list(plugins)
    produced = {key for p in plugins for key in p.produces}
    for p in plugins:
        for key in p.consumes:
            if isinstance(key, StateKey):
                if key not in produced:
                    raise ConfigError(
                        f"profile {profile!r}: {p.typed_name} consumes {key.name!r}, which no plugin of the profile "
                        "produces"
                    )
            elif key not in ENDPOINT_ATTRIBUTES:
                raise ConfigError(
                    f"profile {profile!r}: {p.typed_name} consumes endpoint attribute {key!r}, which the data layer "
                    "does not produce"
                )


def register(type_name: str, stability: Stability):
    """Class decorator: the plugin's kebab-case `type_name`, by which configs build it once the wiring lists the
    class (`epp.scheduling.plugins.BUILTIN_PLUGINS`), and its stability level (llm-d's where llm-d has the type)."""

    def decorate(cls):
        if not issubclass(cls, EXTENSION_POINTS):
            raise TypeError(f"plugin type {type_name!r}: {cls.__name__} implements no extension point")
        if not isinstance(stability, Stability):
            raise TypeError(f"plugin type {type_name!r}: stability must be a Stability, got {stability!r}")
        cls.typed_name = TypedName(type_name, type_name)
        cls.stability = stability
        return cls

    return decorate
