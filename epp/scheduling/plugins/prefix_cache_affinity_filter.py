"""prefix-cache-affinity-filter: keep a request on the endpoints that hold its prompt ("sticky"), until they are
saturated (llm-d router's filter of the same type and parameters).

Reads: the share of the prompt's blocks each candidate holds, from the profile's prefix index
(`PrefixMatchReader`: the profile's prefix-cache-scorer, or one the scheduler adds to record picks); each
candidate's in-flight prompt tokens not yet answered (`in_flight_tokens`, the EPP's own count) for the load gate.
Keeps: the candidates whose match share is at least `affinityThreshold`; all of them when none is that sticky, when
there is one candidate, or (with probability `explorationProbability`) to let other endpoints warm up. Load gate:
an endpoint's time to first token is estimated as in-flight tokens / `peakPrefillThroughput`; when the best sticky
endpoint's estimate exceeds the best other one's by more than `maxTTFTPenaltyMs`, stickiness breaks and all
candidates go on to the scorers (0 = always stick).
Parameters (llm-d's names and defaults): affinityThreshold (0.80, <= 1; <= 0 disables the filter),
explorationProbability (0, in [0, 1]), maxTTFTPenaltyMs (18000, >= 0), ttftSource (`prefillThroughput`, the only
source here: llm-d's `latencyPredictor` is refused at startup), peakPrefillThroughput (15928 tokens a second,
llm-d's figure for a 32B model on two H100s: set your servers' own).
Trade-offs: a hard filter, so the scorers after it only balance load among the sticky endpoints: cache hits are
kept at the cost of hot spots, up to the gate; the gate's estimate ignores the decode work queued behind the
prefill and trusts one throughput figure for every endpoint (a mixed pool's slower servers look faster than they
are). The scorers after it should be load scorers only (a prefix scorer there would outvote a broken gate).
"""

from __future__ import annotations

import random

from epp.config import ConfigError
from epp.datalayer.endpoint import Endpoint
from epp.scheduling.framework import Filter, Parameters, PrefixMatchReader, Stability, register
from epp.scheduling.types import CycleState, SchedulingRequest

PREFILL_THROUGHPUT = "prefillThroughput"


@register("prefix-cache-affinity-filter", Stability.BETA)
class PrefixCacheAffinityFilter(Filter, PrefixMatchReader):
    consumes = ("in_flight_tokens",)

    def __init__(self, parameters: dict | None):
        p = Parameters("prefix-cache-affinity-filter", parameters)
        self.threshold = float(p.get("affinityThreshold", 0.80, (int, float), maximum=1.0))
        self.exploration = float(p.get("explorationProbability", 0.0, (int, float), minimum=0.0, maximum=1.0))
        self.max_penalty_ms = float(p.get("maxTTFTPenaltyMs", 18000, (int, float), minimum=0))
        source = p.get("ttftSource", PREFILL_THROUGHPUT, str)
        if source != PREFILL_THROUGHPUT:
            raise ConfigError(
                f"prefix-cache-affinity-filter: ttftSource {source!r} is not supported here (only {PREFILL_THROUGHPUT!r})"
            )
        self.throughput = float(p.get("peakPrefillThroughput", 15928, (int, float), minimum=0))
        p.done()
        if self.max_penalty_ms > 0 and self.throughput == 0:
            raise ConfigError("prefix-cache-affinity-filter: peakPrefillThroughput must be > 0 with a TTFT load gate")
        self.random = random.random

    def filter(self, cycle_state: CycleState, request: SchedulingRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        if len(endpoints) <= 1 or self.threshold <= 0:
            return endpoints
        if self.exploration and self.random() < self.exploration:
            return endpoints
        threshold = self.threshold
        fractions = self.prefix_index.match_fractions(cycle_state, request, endpoints)
        sticky = [e for e, f in zip(endpoints, fractions, strict=True) if f >= threshold]
        if not sticky or len(sticky) == len(endpoints):
            return endpoints
        if self.max_penalty_ms > 0:
            others = [e for e, f in zip(endpoints, fractions, strict=True) if f < threshold]
            # the lowest in-flight tokens on each side, as milliseconds of prefill at the peak throughput
            gap = min(e.in_flight_tokens for e in sticky) - min(e.in_flight_tokens for e in others)
            if gap * 1000.0 / self.throughput > self.max_penalty_ms:
                return endpoints
        return sticky
