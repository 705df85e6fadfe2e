"""lora-affinity-scorer: send a LoRA request where its adapter is already loaded, or can be loaded without waiting.

Reads: `running_adapters`, `waiting_adapters` and `max_lora` from `vllm:lora_requests_info`.
Score for the request's `model` (the adapter name after any rewrite), in this order:
  the adapter runs on the endpoint                                  1.0
  the endpoint has a free slot: len(running) + len(waiting) < max_lora  0.8
  the adapter is waiting to be loaded there                          0.6
  otherwise (no slot, not there; or no LoRA metrics)                 0.0
Base-model requests are neutral: for a model that no candidate lists as running or waiting the scorer abstains
(returns None: it adds nothing to any candidate), so the other scorers decide. The endpoints do not say which name is their base model, and scoring the base model like
an adapter would push base-model traffic off servers whose adapter slots happen to be full, which costs it nothing.
The same rule applies to an adapter that no endpoint has loaded yet: its first request goes where load says, and
affinity holds from then on.
Parameters: none.
Trade-offs: affinity concentrates an adapter's traffic on the endpoints that run it; weigh it below queue-scorer so
that a hot adapter still spreads (loading an adapter costs far less than a deep queue).
"""

from __future__ import annotations

from epp.datalayer.endpoint import Endpoint
from epp.scheduling.framework import Parameters, register
from epp.scheduling.types import SchedulingRequest

RUNNING, ROOM, WAITING, NONE = 1.0, 0.8, 0.6, 0.0


@register("lora-affinity-scorer")
class LoRAAffinityScorer:
    def __init__(self, parameters: dict | None):
        Parameters("lora-affinity-scorer", parameters).done()

    def score(self, request: SchedulingRequest, endpoints: list[Endpoint]) -> list[float] | None:
        model = request.model
        for e in endpoints:
            m = e.metrics
            if m is not None and (model in m.running_adapters or model in m.waiting_adapters):
                break
        else:
            return None  # no candidate lists it: neutral
        scores = []
        for e in endpoints:
            m = e.metrics
            if m is None:
                scores.append(NONE)
            elif model in m.running_adapters:
                scores.append(RUNNING)
            elif m.max_lora is not None and len(m.running_adapters) + len(m.waiting_adapters) < m.max_lora:
                scores.append(ROOM)
            else:
                scores.append(WAITING if model in m.waiting_adapters else NONE)
        return scores
