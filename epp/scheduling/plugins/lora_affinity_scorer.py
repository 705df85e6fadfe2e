"""lora-affinity-scorer: send a LoRA request where its adapter is already loaded, or can be loaded without waiting.

Reads: `running_adapters`, `waiting_adapters` and `max_lora` from `vllm:lora_requests_info`, and the adapters each
endpoint used lately (`Endpoint.recent_adapters`: seen running by its scrapes, or sent there).
Score for the request's `model` (the adapter name after any rewrite), in this order:
  the adapter runs on the endpoint                                  1.0
  the adapter is probably still loaded there (see below)             0.9
  the endpoint has a free slot: len(running) + len(waiting) < max_lora  0.8
  the adapter is waiting to be loaded there                          0.6
  otherwise (no slot, not there; or no LoRA metrics)                 0.0
Base-model requests are neutral: for a model that no candidate lists as running or waiting the scorer abstains
(returns None: it adds nothing to any candidate), so the other scorers decide. The endpoints do not say which name
is their base model, and scoring the base model like an adapter would push base-model traffic off servers whose
adapter slots happen to be full, which costs it nothing.
The same rule applies to an adapter that no endpoint has loaded yet: its first request goes where load says, and
affinity holds from then on.
Still loaded: `vllm:lora_requests_info` names only adapters with requests running or waiting, but an engine keeps
an idle adapter in its GPU slot until another one needs the slot (LRU), and loading one costs tens of milliseconds
on the step that every running request shares. So an adapter counts as loaded when it is among the last `max_lora`
distinct adapters the endpoint used: seen running by its scrapes (which covers what another EPP sent), or sent there
by this scorer's `pre_request` (adapters only: names some endpoint has listed; a send counts before the next scrape
shows it). That memory is the endpoint's (`Endpoint.adapter_loaded`), so the latency predictor reads the same one.
The estimate is wrong when the engine evicts sooner; it only ranks above a free slot, never above an adapter that
the endpoint reports running.
Parameters: none.
Trade-offs: affinity concentrates an adapter's traffic on the endpoints that run it; weigh it below queue-scorer so
that a hot adapter still spreads (loading an adapter costs far less than a deep queue).
"""

from __future__ import annotations

from epp.datalayer.endpoint import Endpoint, adapter_listed
from epp.scheduling.framework import Parameters, PreRequest, Scorer, Stability, register
from epp.scheduling.types import CycleState, SchedulingRequest, SchedulingResult

RUNNING, LOADED, ROOM, WAITING, NONE = 1.0, 0.9, 0.8, 0.6, 0.0


@register("lora-affinity-scorer", Stability.BETA)
class LoRAAffinityScorer(Scorer, PreRequest):
    consumes = ("running_adapters", "waiting_adapters", "max_lora")

    def __init__(self, parameters: dict | None):
        Parameters("lora-affinity-scorer", parameters).done()
        self.adapters: set[str] = set()  # names endpoints have listed as adapters (never the base model), bounded

    def score(
        self, cycle_state: CycleState, request: SchedulingRequest, endpoints: list[Endpoint]
    ) -> list[float] | None:
        model = request.model
        if not adapter_listed(model, endpoints, self.adapters):
            return None  # no candidate lists it and it was never seen as an adapter: neutral
        scores = []
        for e in endpoints:
            m = e.metrics
            if m is None:
                scores.append(NONE)
            elif model in m.running_adapters:
                scores.append(RUNNING)
            elif model in e.recent_adapters:
                scores.append(LOADED)
            elif m.max_lora is not None and len(m.running_adapters) + len(m.waiting_adapters) < m.max_lora:
                scores.append(ROOM)
            else:
                scores.append(WAITING if model in m.waiting_adapters else NONE)
        return scores

    def pre_request(self, request: SchedulingRequest, result: SchedulingResult) -> None:
        if request.model not in self.adapters or not result.endpoints:
            return
        endpoint = result.endpoints[0]
        m = endpoint.metrics
        if m is not None and m.max_lora:
            endpoint.adapters_used((request.model,), m.max_lora)
