"""max-score-picker: the highest total score wins; ties are broken at random so that equal endpoints share load.
With active-active EPP replicas, each takes a different endpoint among the near-best ones, so that a burst split
between them lands as one EPP would spread it.

Reads: the weighted total score of each candidate; with replicas (`--replica-peers`), this replica's rank and the
live replicas' count (the replica channel, `ReplicaAware`).
Parameters: maxNumOfEndpoints (default 1): how many endpoints to return, best first; the rest are fallbacks the
proxy may try when the first fails (ties among them are ordered at random too). With fewer than the pick and the two
fallbacks our Envoy bootstrap retries on, the scheduler completes the list from the best-scored other candidates
(`epp.scheduling.scheduler.RESULT_ENDPOINTS`), the same way. With replicas only: replicaMargin (default 0.25),
replicaBurstMargin (default 1.0), replicaBurstWindowMs (default 10), below.
Trade-offs: deterministic apart from ties, so between two scrapes every request sees the same scores; the scorers'
in-flight correction (requests routed since the last scrape count as queued) is what keeps a burst from herding
onto the single best endpoint.

Replicas. Replicas that share their load (`epp.replicas`) still decide a burst's requests within the same
milliseconds, before a peer's pick reaches them: each sees the same scores, so all would take the same best one.
So the endpoints are striped over the replicas (the candidates in address order, the i-th on stripe i mod N). Among
the candidates whose total is within the margin of the best, a replica takes the best-scored on its own stripe; the
replicas whose stripe has none share out the near-best ones no stripe took. Every replica works out the same ranks,
stripes and so every replica's pick, with no message between them. The margin is replicaMargin, or
replicaBurstMargin while this replica's own last pick is less than replicaBurstWindowMs old (a burst's picks on one
replica come 1-3 ms apart; steady traffic at 24 req/s over 3 replicas ~125 ms apart): its peers are placing the
burst's other requests at the same time, unheard, so what it sees off its own stripe looks better than it is, and
keeping to its stripe keeps its view of its own endpoints whole, the latency predictor's features included. A
candidate ahead by more than the margin (a cached prefix leads by 1.5-2 in the default profile) wins on every
replica. The price: a replica may take an endpoint up to the margin below the best; stripes follow the candidates,
so a request whose filters leave few shares them less evenly. Measured (docs/replicas.md): in bursts of 8 on three
replicas the servers' own TTFT 57-62 ms against 66-70 without the stripes and 55-61 for one EPP, while the latency
predictor routed; nothing at steady load. Both margins 0: only exact ties are dealt by stripe.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from time import monotonic

from epp.datalayer.endpoint import Endpoint
from epp.scheduling.framework import Parameters, Picker, ReplicaAware, Stability, register
from epp.scheduling.types import CycleState, SchedulingRequest, add_best_scored


def _alone() -> tuple[int, int]:
    return 0, 1


@register("max-score-picker", Stability.BETA)
class MaxScorePicker(Picker, ReplicaAware):
    def __init__(self, parameters: dict | None):
        p = Parameters("max-score-picker", parameters)
        self.count = p.get("maxNumOfEndpoints", 1, int, minimum=1)
        self.margin = float(p.get("replicaMargin", 0.25, (int, float), minimum=0.0))
        self.burst_margin = float(p.get("replicaBurstMargin", 1.0, (int, float), minimum=0.0))
        self.burst_window = p.get("replicaBurstWindowMs", 10, (int, float), minimum=0) / 1e3
        p.done()
        self.position: Callable[[], tuple[int, int]] = _alone
        self._last_pick = -math.inf  # when this replica last picked among peers (monotonic)

    def use_replicas(self, position: Callable[[], tuple[int, int]]) -> None:
        self.position = position

    def pick(
        self, cycle_state: CycleState, request: SchedulingRequest, endpoints: list[Endpoint], scores: list[float]
    ) -> list[Endpoint]:
        best = max(scores)
        rank, replicas = self.position() if self.position is not _alone else (0, 1)  # one EPP: no call
        if replicas > 1 and len(endpoints) > 1:
            first = self._striped(rank, replicas, endpoints, scores, best)
        elif scores.count(best) == 1:  # the common case, without a loop in Python
            first = scores.index(best)
        else:
            ties = [i for i, s in enumerate(scores) if s == best]
            first = ties[int(random.random() * len(ties))]  # (random.choice runs as Python: twice the frames)
        picked = [endpoints[first]]
        if self.count > 1:  # the fallbacks, best first
            add_best_scored(picked, endpoints, scores, self.count)
        return picked

    def _striped(self, rank: int, replicas: int, endpoints: list[Endpoint], scores: list[float], best: float) -> int:
        """This replica's pick among peers: the best near-best on its stripe (ties in address order); the replicas
        whose stripe has none share out the near-best no stripe took, best first."""
        now = monotonic()
        floor = best - (self.burst_margin if now - self._last_pick < self.burst_window else self.margin)
        self._last_pick = now
        by_address = sorted(range(len(endpoints)), key=lambda i: endpoints[i].hostport)
        near = [i for i in by_address if scores[i] >= floor]
        if len(near) == 1:
            return near[0]
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
        return chosen
