"""The plugin framework: filters narrow the candidates, scorers rate them in [0, 1] with a weight, a picker
chooses. Plugins register under a kebab-case type name and are built from GIE-style `parameters` mappings."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from epp.datalayer.endpoint import Endpoint
from epp.scheduling.errors import ConfigError
from epp.scheduling.types import SchedulingRequest, SchedulingResult


@runtime_checkable
class Filter(Protocol):
    def filter(self, request: SchedulingRequest, endpoints: list[Endpoint]) -> list[Endpoint]: ...


@runtime_checkable
class Scorer(Protocol):
    def score(self, request: SchedulingRequest, endpoints: list[Endpoint]) -> list[float]: ...


@runtime_checkable
class Picker(Protocol):
    def pick(self, request: SchedulingRequest, endpoints: list[Endpoint], scores: list[float]) -> list[Endpoint]: ...


class PostRouting(Protocol):
    """Optional hooks: after the EPP answered the proxy, when the request finished, when the pool changed."""

    def on_routed(self, request: SchedulingRequest, result: SchedulingResult) -> None: ...

    def on_finished(self, request: SchedulingRequest, endpoint: Endpoint) -> None: ...

    def on_pool_changed(self, endpoints: Sequence[Endpoint]) -> None: ...


PLUGIN_TYPES: dict[str, Callable[[dict[str, Any]], Any]] = {}


def register(type_name: str):
    def decorate(cls):
        PLUGIN_TYPES[type_name] = cls
        cls.type_name = type_name
        return cls

    return decorate


def build_plugin(type_name: str, parameters: dict[str, Any] | None) -> Any:
    from epp.scheduling import plugins  # noqa: F401  (registers the built-in plugins)

    factory = PLUGIN_TYPES.get(type_name)
    if factory is None:
        raise ConfigError(f"unknown plugin type {type_name!r}; known: {', '.join(sorted(PLUGIN_TYPES))}")
    try:
        return factory(dict(parameters or {}))
    except ConfigError:
        raise
    except (TypeError, ValueError, KeyError) as exc:
        raise ConfigError(f"plugin {type_name!r}: bad parameters {parameters!r}: {exc}") from None


class Parameters:
    """Typed access to a plugin's parameters with clear errors; unknown keys are rejected."""

    def __init__(self, type_name: str, raw: dict[str, Any]):
        self._type = type_name
        self._raw = dict(raw)

    def get(self, key: str, default: Any, kind: type | tuple[type, ...], minimum: float | None = None) -> Any:
        value = self._raw.pop(key, default)
        if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
            raise ConfigError(f"{self._type}: parameter {key} must be {kind}, got {value!r}")
        if not isinstance(value, kind):
            raise ConfigError(f"{self._type}: parameter {key} must be {kind}, got {value!r}")
        if minimum is not None and value < minimum:
            raise ConfigError(f"{self._type}: parameter {key} must be >= {minimum}, got {value!r}")
        return value

    def done(self) -> None:
        if self._raw:
            raise ConfigError(f"{self._type}: unknown parameter(s) {sorted(self._raw)}")
