"""Typed reading of a configuration section's parameters (a plugin's, flow control's, the saturation detector's)."""

from __future__ import annotations

from typing import Any

from epp.config import ConfigError


class Parameters:
    """Typed access to a plugin's parameters with clear errors; unknown keys are rejected by `done()`."""

    def __init__(self, owner: str, raw: dict[str, Any] | None):
        if raw is not None and not isinstance(raw, dict):
            raise ConfigError(f"{owner}: parameters must be a mapping, got {raw!r}")
        self.owner = owner
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
            raise ConfigError(f"{self.owner}: parameter {key} must be {names}, got {value!r}")
        if minimum is not None and value < minimum:
            raise ConfigError(f"{self.owner}: parameter {key} must be >= {minimum}, got {value!r}")
        if maximum is not None and value > maximum:
            raise ConfigError(f"{self.owner}: parameter {key} must be <= {maximum}, got {value!r}")
        return value

    def done(self) -> None:
        if self._raw:
            raise ConfigError(f"{self.owner}: unknown parameter(s) {', '.join(sorted(self._raw))}")
