"""The plugin framework: filters narrow the candidates, scorers rate them in [0, 1] with a weight, a picker
chooses. Plugins register under a kebab-case type name and are built from GIE-style `parameters` mappings.

A plugin is one class in one module of `epp.scheduling.plugins`, registered with `@register("type-name")`, built
from its parameters at startup (invalid ones raise ConfigError there, never on the request path), and it implements
one or more of the extension points below. All of them run synchronously on the request path: no I/O, no awaits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from epp.datalayer.endpoint import Endpoint
from epp.scheduling.errors import ConfigError
from epp.scheduling.types import SchedulingRequest


@runtime_checkable
class Filter(Protocol):
    """Returns the candidates that may serve the request (a sub-list, in any order; empty means none)."""

    def filter(self, request: SchedulingRequest, endpoints: list[Endpoint]) -> list[Endpoint]: ...


@runtime_checkable
class Scorer(Protocol):
    """Returns one score in [0, 1] per candidate, in the candidates' order; higher is better. None means the
    scorer has no preference for this request (it adds nothing to any candidate), which spares building a list
    of equal scores on the common path (no prompt blocks known anywhere, a base-model request)."""

    def score(self, request: SchedulingRequest, endpoints: list[Endpoint]) -> list[float] | None: ...


@runtime_checkable
class Picker(Protocol):
    """Returns at least one endpoint, best first, from the candidates and their weighted total scores."""

    def pick(self, request: SchedulingRequest, endpoints: list[Endpoint], scores: list[float]) -> list[Endpoint]: ...


# Optional hooks a plugin may define (the scheduler calls those present, in profile order):
#   on_routed(request, result)      after the EPP answered the proxy (off the request's critical path)
#   on_finished(request, endpoint)  when the request's ext_proc stream ended
#   on_pool_changed(endpoints)      after discovery added or removed endpoints
HOOKS = ("on_routed", "on_finished", "on_pool_changed")

PLUGIN_TYPES: dict[str, Callable[[dict[str, Any] | None], Any]] = {}


def register(type_name: str):
    """Class decorator: make a plugin buildable from configs under its kebab-case `type_name`."""

    def decorate(cls):
        if type_name in PLUGIN_TYPES:
            raise ValueError(f"plugin type {type_name!r} registered twice")
        PLUGIN_TYPES[type_name] = cls
        cls.type_name = type_name
        return cls

    return decorate


def build_plugin(type_name: str, parameters: dict[str, Any] | None = None) -> Any:
    """A plugin instance from its type name and `parameters` mapping; ConfigError for anything invalid."""
    from epp.scheduling import plugins  # noqa: F401  (registers the built-in plugins)

    factory = PLUGIN_TYPES.get(type_name)
    if factory is None:
        raise ConfigError(f"unknown plugin type {type_name!r}; known: {', '.join(sorted(PLUGIN_TYPES))}")
    return factory(parameters)


class Parameters:
    """Typed access to a plugin's parameters with clear errors; unknown keys are rejected by `done()`."""

    def __init__(self, owner: str, raw: dict[str, Any] | None):
        if raw is not None and not isinstance(raw, dict):
            raise ConfigError(f"{owner}: parameters must be a mapping, got {raw!r}")
        self._owner = owner
        self._raw = dict(raw or {})

    def get(
        self,
        key: str,
        default: Any,
        kind: type | tuple[type, ...],
        minimum: float | None = None,
        maximum: float | None = None,
    ) -> Any:
        value = self._raw.pop(key, default)
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
            names = " or ".join(k.__name__ for k in kinds)
            raise ConfigError(f"{self._owner}: parameter {key} must be {names}, got {value!r}")
        if minimum is not None and value < minimum:
            raise ConfigError(f"{self._owner}: parameter {key} must be >= {minimum}, got {value!r}")
        if maximum is not None and value > maximum:
            raise ConfigError(f"{self._owner}: parameter {key} must be <= {maximum}, got {value!r}")
        return value

    def done(self) -> None:
        if self._raw:
            raise ConfigError(f"{self._owner}: unknown parameter(s) {', '.join(sorted(self._raw))}")
