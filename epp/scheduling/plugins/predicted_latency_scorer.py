"""predicted-latency-scorer: prefer the endpoint predicted to answer this request soonest (GIE/llm-d's name).

Reads: the scheduler's latency predictor (`LatencyPredictionReader`): predicted TTFT of this request on each
candidate from its scraped load, this EPP's in-flight tokens and prefill backlog there, the request's prompt
tokens and the part the profile's prefix index expects cached there (none without one), and whether its LoRA adapter is loaded; `max_tokens` of the request. For a long answer (`max_tokens` at
least `longOutputTokens`) the cost is the predicted end-to-end time, TTFT + TPOT x max_tokens, so that a decode
batch that would slow every token counts too.
Score: best cost / cost (1 for the fastest, 0.5 for one predicted twice as slow), so close predictions stay close
instead of being stretched to 0..1 as min-max would.
Abstains (None) while the predictor is cold (too few observations or its windowed error above its bound): the
other scorers then decide alone.
Feeds the predictor too: when a request is routed (PreRequest, at the pick: a burst's next request sees its prefill
in the backlog) its features on the picked endpoint are kept in the cycle state, and when its timings are known
(ResponseTimed) they train the model. The director has them for streamed responses only (so only a streamed
request's features are kept; every request's prefill joins the backlog), from the first of two
sources: the gateway's access log (TTFT: Envoy's time from sending the request upstream to the first body byte
back; `epp.handlers.accesslog`, a record per request, batched; TPOT: the endpoint's scraped inter-token latency over
the request's decode, `Endpoint.inter_token_latency`) or the body passing through the EPP (Envoy's
response_body_mode FULL_DUPLEX_STREAMED, an ext_proc round trip per token: TTFT, and TPOT from the usage).
Composition with the other scorers: the prediction is made from their signals (the queue, running requests, KV
usage, in-flight tokens, the prefix match as cached tokens, the adapter loaded or not), so while it predicts it
replaces those scorers for the request (`Scorer.replaces`: the scheduler skips them); while it abstains (cold, or
its windowed error above its bound) they decide as in a profile without it. `replaces: all` (the default) replaces
every one of them, so this scorer decides alone and its weight does not matter: adding both would count a cache
hit or a queue twice, and a weight to balance them would have to be tuned per workload. `replaces: load` replaces
only the load scorers (LOAD_SCORERS), whose counts say nothing of the work each request brings (a server busy with
a 6,000-token prefill shows no queue, one that was just sent a 200-token chat turn shows one): the prefix and LoRA
scorers, exact about what they see, still add theirs, so its weight matters; the default profile
(`epp.config.loader.DEFAULT_CONFIG`) gives it the summed weights of the scorers it replaces there, the
profile's own balance between load and those signals.
Parameters: longOutputTokens (256), replaces ("all" or "load").
Trade-offs: it is only as good as the predictor's recent error (`LatencyPredictor.ttft_mape`, for the EPP's
metrics); one model per pool, its TTFT scaled per endpoint by the prefill speed measured there
(`PrefillBacklog.slowness`), assumes endpoints that differ only in speed; a scorer added to the profile that it does not replace
(one reading signals the predictor does not have) still adds to its score with the weights of the profile.
"""

from __future__ import annotations

from collections.abc import Sequence

from epp.config import ConfigError
from epp.datalayer.endpoint import Endpoint
from epp.predictor import Features
from epp.scheduling.framework import (
    LatencyPredictionReader,
    Parameters,
    PoolChanged,
    PreRequest,
    ResponseTimed,
    Scorer,
    Stability,
    register,
)
from epp.scheduling.predictions import CACHED_TOKENS, PREDICTED_LATENCY, PREDICTION_READS
from epp.scheduling.types import CycleState, SchedulingRequest, SchedulingResult, StateKey

# A streamed request's features at its pick (only its timings come back to learn from).
ROUTED_FEATURES: StateKey[Features] = StateKey("predicted-latency-routed-features")
FED: StateKey[bool] = StateKey("predicted-latency-fed")  # the request's prompt joined its endpoint's prefill backlog
OBSERVED: StateKey[bool] = StateKey("predicted-latency-observed")  # the predictor learnt from this request
# The scorers whose signals are the load of an endpoint, counted without the work each request brings; the others
# the prediction reads (prefix match, LoRA adapter) are exact about what they see.
LOAD_SCORERS = (
    "queue-scorer",
    "running-requests-size-scorer",
    "kv-cache-utilization-scorer",
    "in-flight-tokens-scorer",
)
EXACT_SCORERS = ("prefix-cache-scorer", "precise-prefix-cache-scorer", "lora-affinity-scorer")


class PredictorFeed(LatencyPredictionReader, PreRequest, ResponseTimed, PoolChanged):
    """The hooks that train the predictor, shared by the plugins that read it (this scorer and
    predicted-latency-filter): at the pick the request's features on its endpoint (and its prompt into the
    endpoint's prefill backlog), then the observed TTFT and TPOT; a departed endpoint's prefill rate goes with the
    pool change. With both plugins in one profile the first one fed does it, once per request."""

    at_pick = True  # the prompt joins the pick's prefill backlog before the next request of a burst is scheduled

    def pre_request(self, request: SchedulingRequest, result: SchedulingResult) -> None:
        cycle_state = result.cycle_state
        if cycle_state.read(FED):
            return  # fed by the profile's other predictor plugin
        cycle_state.write(FED, True)
        endpoint = result.primary
        predictions = self.predictions
        cached_tokens = predictions.cached(cycle_state, request, [endpoint])[0]
        timed = request.streamed  # only a streamed response's timings come back: only its features are read
        adapter = predictions.adapter(request.model, result.candidates or [endpoint]) if timed else None
        features = predictions.predictor.routed(
            endpoint, request.prompt_tokens_estimate, cached_tokens, adapter, timed=timed
        )
        if features is not None:
            cycle_state.write(ROUTED_FEATURES, features)

    def response_timed(
        self, request: SchedulingRequest, result: SchedulingResult, endpoint, ttft: float, tpot: float | None
    ) -> None:
        if result.cycle_state.read(OBSERVED) is not None:
            return
        result.cycle_state.write(OBSERVED, True)
        features = result.cycle_state.read(ROUTED_FEATURES)
        if features is None or not ttft > 0:
            return  # not routed by a prompt, or no time measured
        self.predictions.predictor.observe(features, ttft, tpot if tpot is not None and tpot > 0 else None)

    def pool_changed(self, endpoints: Sequence[Endpoint]) -> None:
        self.predictions.predictor.backlog.forget({e.spec.name for e in endpoints})


@register("predicted-latency-scorer", Stability.BETA)
class PredictedLatencyScorer(Scorer, PredictorFeed):
    consumes = PREDICTION_READS
    produces = (PREDICTED_LATENCY, CACHED_TOKENS, ROUTED_FEATURES, FED, OBSERVED)
    replaces = (*LOAD_SCORERS, *EXACT_SCORERS)

    def __init__(self, parameters: dict | None):
        p = Parameters("predicted-latency-scorer", parameters)
        self.own_predictor()
        self.long_output_tokens = p.get("longOutputTokens", 256, int, minimum=1)
        replaces = p.get("replaces", "all", str)
        p.done()
        if replaces not in ("all", "load"):
            raise ConfigError(f"predicted-latency-scorer: parameter replaces must be all or load, got {replaces!r}")
        if replaces == "load":
            self.replaces = LOAD_SCORERS

    def score(
        self, cycle_state: CycleState, request: SchedulingRequest, endpoints: list[Endpoint]
    ) -> list[float] | None:
        output = request.max_tokens
        long_output = output is not None and output >= self.long_output_tokens
        predicted = self.predictions.get(cycle_state, request, endpoints, tpot=long_output)
        if predicted is None:
            return None
        # a long answer's cost is its TTFT plus TPOT x max_tokens
        if long_output and predicted[0][1] is not None:
            costs = [ttft + tpot * output for ttft, tpot in predicted]
        else:
            costs = [ttft for ttft, _ in predicted]
        best = min(costs)
        return [best / c for c in costs]
