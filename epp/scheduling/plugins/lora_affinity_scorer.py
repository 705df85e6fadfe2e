"""lora-affinity-scorer: send a LoRA request where its adapter is already loaded, or can be loaded without waiting.

Reads: `running_adapters`, `waiting_adapters` and `max_lora` from `vllm:lora_requests_info`, and the EPP's own
record of which adapters it sent where.
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
on the step that every running request shares. So an adapter counts as loaded when the endpoint's scrapes saw it
among the last `max_lora` distinct adapters running there (`Endpoint.adapter_loaded`, which the latency predictor
reads too), or, like the prefix-cache scorer's index, among the last `max_lora` distinct adapters this scorer sent
there (adapters only: names some endpoint has listed; a send counts before the next scrape shows it). The estimate
is wrong when the engine evicts sooner; it only ranks above a free slot, never above an adapter that the endpoint
reports running.
Parameters: none.
Trade-offs: affinity concentrates an adapter's traffic on the endpoints that run it; weigh it below queue-scorer so
that a hot adapter still spreads (loading an adapter costs far less than a deep queue).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from epp.datalayer.endpoint import MAX_ADAPTER_SLOTS, Endpoint
from epp.scheduling.framework import Parameters, PoolChanged, PreRequest, Scorer, register
from epp.scheduling.types import CycleState, SchedulingRequest, SchedulingResult

RUNNING, LOADED, ROOM, WAITING, NONE = 1.0, 0.9, 0.8, 0.6, 0.0


@register("lora-affinity-scorer")
class LoRAAffinityScorer(Scorer, PreRequest, PoolChanged):
    consumes = ("running_adapters", "waiting_adapters", "max_lora")

    def __init__(self, parameters: dict | None):
        Parameters("lora-affinity-scorer", parameters).done()
        self.adapters: set[str] = set()  # names endpoints have listed as adapters (the base model never is)
        self._sent: dict[str, OrderedDict[str, None]] = {}  # endpoint name -> adapters sent there, most recent last

    def score(
        self, cycle_state: CycleState, request: SchedulingRequest, endpoints: list[Endpoint]
    ) -> list[float] | None:
        model = request.model
        sent = self._sent
        for e in endpoints:
            m = e.metrics
            if m is not None and (model in m.running_adapters or model in m.waiting_adapters):
                self.adapters.add(model)
                break
        else:
            if model not in self.adapters:
                return None  # no candidate lists it and it was never seen as an adapter: neutral
        scores = []
        for e in endpoints:
            m = e.metrics
            if m is None:
                scores.append(NONE)
            elif model in m.running_adapters:
                scores.append(RUNNING)
            elif model in e.recent_adapters or model in sent.get(e.spec.name, ()):
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
        if m is None or not m.max_lora:
            return
        sent = self._sent.setdefault(endpoint.spec.name, OrderedDict())
        sent[request.model] = None
        sent.move_to_end(request.model)
        while len(sent) > min(m.max_lora, MAX_ADAPTER_SLOTS):
            sent.popitem(last=False)

    def pool_changed(self, endpoints: Sequence[Endpoint]) -> None:
        present = {e.spec.name for e in endpoints}
        for name in [n for n in self._sent if n not in present]:
            del self._sent[name]
