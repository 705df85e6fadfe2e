"""lora-affinity-scorer: send a LoRA request where its adapter is already loaded, or can be without waiting.

Reads: `running_adapters`, `waiting_adapters` and `max_lora` from `vllm:lora_requests_info`.
Score for the request's `model`: running on the endpoint 1.0; not there but a free slot
(len(running | waiting) < max_lora) 0.8; waiting there 0.6; otherwise 0.
A model that no candidate lists as an adapter (the base model, or an adapter nobody has loaded yet) scores 1.0
everywhere: the other scorers decide, and base-model traffic is not pushed off adapter-heavy servers.
Parameters: none.
Trade-offs: affinity concentrates an adapter's traffic; weigh it below queue-scorer so a hot adapter can spread.
"""

from __future__ import annotations

from epp.datalayer.endpoint import Endpoint
from epp.scheduling.framework import Parameters, register
from epp.scheduling.types import SchedulingRequest

RUNNING, ROOM, WAITING, NONE = 1.0, 0.8, 0.6, 0.0


@register("lora-affinity-scorer")
class LoRAAffinityScorer:
    def __init__(self, parameters: dict):
        Parameters("lora-affinity-scorer", parameters).done()

    def score(self, request: SchedulingRequest, endpoints: list[Endpoint]) -> list[float]:
        model = request.model
        known = False
        scores = []
        for e in endpoints:
            m = e.metrics
            if m is None:
                scores.append(NONE)
                continue
            if model in m.running_adapters:
                known = True
                scores.append(RUNNING)
            elif model in m.waiting_adapters:
                known = True
                scores.append(WAITING)
            elif m.max_lora is not None and len(m.running_adapters | m.waiting_adapters) < m.max_lora:
                scores.append(ROOM)
            else:
                scores.append(NONE)
        return scores if known else [1.0] * len(endpoints)
