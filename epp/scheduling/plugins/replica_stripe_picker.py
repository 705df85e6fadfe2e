"""replica-stripe-picker: max-score-picker for active-active EPP replicas, which take different endpoints among the
near-best ones so that a burst split between them does not land where one EPP would have spread it.

Why: replicas that share their load (`epp.replicas`) still decide a burst's requests within the same milliseconds,
before a peer's pick reaches them. Each sees the same scores, and a request that no prefix ties to one endpoint goes
to the least loaded one: the same one from every replica. Measured (multi-turn-kv-pressure, 24 req/s in bursts of 8,
three sharing replicas, docs/2026-11-30-replicas-notebook.md, "Bursts split between replicas"): 10-13 % of the
picks were decided by the load scorers and repeated an endpoint picked less than 10 ms before, nearly always by
another replica; 2-6 % with one EPP.

What it does: the endpoints are striped over the replicas (the candidates in address order, the i-th on stripe
i mod N). Among the candidates whose total is within `margin` of the best, a replica takes the best-scored on its
own stripe; the replicas whose stripe has none share out the near-best ones no stripe took. Every replica works out
the same ranks, stripes and so every replica's pick, so their first picks among near-equal endpoints differ (as far
as there are enough of them), with no message between them. A candidate ahead by more than `margin` (a cached
prefix, a much shorter queue) wins on every replica, as with max-score-picker; alone (no peers, or none heard picking
within the last second, `epp.replicas.ROUTING_SECONDS`) it is max-score-picker.
Reads: the weighted total of each candidate; this replica's rank and the live replicas' count (the replica
channel, `ReplicaAware`).
Parameters: margin (default 0.5, in the profile's weighted-total units: a weight-1 scorer's whole range is 1; 0:
only exact ties are shared out), maxNumOfEndpoints (default 1) as max-score-picker's.
Trade-offs: a replica may take an endpoint up to `margin` below the best where one EPP would not, so keep it under
the margin by which the affinity scorers lead (a cached prefix leads by 1.5-2 in the default profile); a narrow
margin leaves more of a burst's load-driven picks to collide (measured: p90 TTFT in bursts 0.77-0.87x three
max-score replicas', the repeats of a peer's pick cut by a tenth). Stripes follow the candidates, so a request whose
filters leave few of them shares those among the replicas less evenly.
"""

from __future__ import annotations

from collections.abc import Callable

from epp.datalayer.endpoint import Endpoint
from epp.scheduling.framework import Parameters, ReplicaAware, Stability, register
from epp.scheduling.plugins.max_score_picker import MaxScorePicker
from epp.scheduling.types import CycleState, SchedulingRequest, add_best_scored


def _alone() -> tuple[int, int]:
    return 0, 1


@register("replica-stripe-picker", Stability.ALPHA)
class ReplicaStripePicker(MaxScorePicker, ReplicaAware):
    def __init__(self, parameters: dict | None):
        p = Parameters("replica-stripe-picker", parameters)
        self.count = p.get("maxNumOfEndpoints", 1, int, minimum=1)
        self.margin = float(p.get("margin", 0.5, (int, float), minimum=0.0))
        p.done()
        self.position: Callable[[], tuple[int, int]] = _alone

    def use_replicas(self, position: Callable[[], tuple[int, int]]) -> None:
        self.position = position

    def pick(
        self, cycle_state: CycleState, request: SchedulingRequest, endpoints: list[Endpoint], scores: list[float]
    ) -> list[Endpoint]:
        rank, replicas = self.position()
        if replicas < 2 or len(endpoints) < 2:
            return super().pick(cycle_state, request, endpoints, scores)
        floor = max(scores) - self.margin
        by_address = sorted(range(len(endpoints)), key=lambda i: endpoints[i].hostport)
        near = [i for i in by_address if scores[i] >= floor]
        if len(near) < 2:
            return super().pick(cycle_state, request, endpoints, scores)
        # every replica's pick as each works it out from the same scores: the best near-best on its stripe (ties
        # in address order); the replicas whose stripe has none share out the near-best no stripe took, best first
        stripe = {i: position % replicas for position, i in enumerate(by_address)}
        best_on: dict[int, int] = {}
        for i in near:
            owner = best_on.get(stripe[i])
            if owner is None or scores[i] > scores[owner]:
                best_on[stripe[i]] = i
        chosen = best_on.get(rank)
        if chosen is None:
            taken = set(best_on.values())
            near.sort(key=lambda i: -scores[i])
            order = [i for i in near if i not in taken] + near  # the ones left first, then all again, best first
            without = [r for r in range(replicas) if r not in best_on]
            chosen = order[without.index(rank) % len(order)]
        picked = [endpoints[chosen]]
        if self.count > 1:
            add_best_scored(picked, endpoints, scores, self.count)
        return picked
