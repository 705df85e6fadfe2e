"""The scheduler's inputs and outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

from epp.datalayer.endpoint import Endpoint


@dataclass(slots=True)
class SchedulingRequest:
    """What the scheduler may read of one request. Built once per request on the ext_proc path."""

    request_id: str
    model: str  # the model (or LoRA adapter) name after any rewrite: what the model server will see
    prompt: str = ""  # protocol.openai.prompt_text(...) of the body; "" for header-only requests
    prompt_tokens_estimate: int = 0  # len(prompt) // 4 unless a tokenizer is known
    priority: int = 0  # from the InferenceObjective named by x-gateway-inference-objective
    objective: str | None = None
    fairness_id: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    subset: frozenset[str] | None = None  # allowed "ip:port" from the proxy's subset hint; None = no hint
    prefix_hashes: list[int] | None = None  # computed once by the prefix scorer, reused when the pick is recorded
    max_tokens: int | None = None  # the body's max_tokens / max_completion_tokens, when it gives one


@dataclass(slots=True)
class SchedulingResult:
    """Endpoints in preference order: the first is the pick, the rest are fallbacks."""

    endpoints: list[Endpoint]
    profile: str = "default"

    @property
    def primary(self) -> Endpoint:
        return self.endpoints[0]
