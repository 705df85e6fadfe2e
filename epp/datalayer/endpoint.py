"""The pool as discovery reports it (`PoolState`, `EndpointSpec`) and as the scheduler reads it (`Endpoint`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.metrics import EndpointMetrics


@dataclass(frozen=True, slots=True)
class EndpointSpec:
    """One model-server endpoint as discovery knows it. `name` is unique in the pool (Kubernetes: `<pod>-rank-<i>`)."""

    name: str
    address: str
    port: int
    engine: str = "vllm"
    labels: tuple[tuple[str, str], ...] = ()
    # "ip:port" ("[ip6]:port"), read on every request by the scheduler and the answers: computed once
    hostport: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        address = f"[{self.address}]" if ":" in self.address else self.address
        object.__setattr__(self, "hostport", f"{address}:{self.port}")


@dataclass(frozen=True, slots=True)
class ModelRewrite:
    """Requests for `model` are sent as one of `targets` (name, weight), chosen by weight."""

    model: str
    targets: tuple[tuple[str, int], ...]


@dataclass(frozen=True, slots=True)
class PoolState:
    """Everything discovery knows at one moment. Discovery sources publish a whole new PoolState on each change."""

    endpoints: tuple[EndpointSpec, ...] = ()
    objectives: dict[str, int] = field(default_factory=dict)  # objective name -> priority (negative = sheddable)
    models: frozenset[str] | None = None  # models the pool serves, when declared; None = any
    rewrites: tuple[ModelRewrite, ...] = ()


@dataclass(slots=True, eq=False)
class Endpoint:
    """Live state of one endpoint: identity, the latest scrape, and what the EPP routed there and is not finished.

    The data layer mutates it in place (one object per endpoint for its lifetime in the pool), so the scheduler's
    per-request path reads plain attributes with no copying or locking (single event loop).
    """

    spec: EndpointSpec
    metrics: EndpointMetrics | None = None  # None until the first successful scrape
    stale: bool = True  # no successful scrape within the staleness threshold
    in_flight_requests: int = 0
    in_flight_tokens: int = 0  # estimated prompt tokens of in-flight requests
    routed_total: int = 0
    # For a load estimate fresher than the last scrape: what the EPP had in flight when that scrape was taken (the
    # requests routed and finished since then are the difference), and the most requests the endpoint was seen
    # running while others waited (its batch is full at that count; None until a scrape showed a waiting request).
    in_flight_at_scrape: int = 0
    batch_slots: int | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def hostport(self) -> str:
        return self.spec.hostport
