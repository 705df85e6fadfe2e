"""The EPP's status page on its metrics port: `GET /` (one HTML page, no external assets: it works offline) and the
JSON it polls, `GET /status.json?since=SEQ`, and `GET /status/decision?seq=SEQ` for one decision in full.

What it shows: every endpoint of the pool with its state (ready, or why not: the latest failed scrape), its load
(waiting and running as last scraped, what the EPP has in flight there, KV-cache use), its LoRA adapters, its
entries in the prefix indexes (the approximate one and the KV-event one) and, once the latency predictor has
learnt, its predicted TTFT for a REFERENCE_PROMPT_TOKENS prompt with nothing cached; flow control's queues by
priority band and flow; the scheduler's last decisions (`epp/scheduling/decisions.py`, a bounded ring filled at
most `--status-decisions-per-second` a second) with each scorer's score per candidate and why the pick won.

Everything is read when the page asks, from what the parts keep anyway: the request path pays only the ring's
append. A decision's explanation is computed once and kept while the decision is in the ring.
"""

from __future__ import annotations

import json
from importlib import resources
from time import monotonic, time

from aiohttp import web

from epp.datalayer.datastore import Datastore
from epp.datalayer.endpoint import Endpoint
from epp.datalayer.load import queue_depth, running_requests
from epp.flowcontrol import FlowController
from epp.scheduling.decisions import Decision, DecisionLog, explain, ranked
from epp.scheduling.scheduler import Scheduler

# The prompt the endpoints' predicted TTFT is for: a typical chat turn, nothing of it cached, the base model.
REFERENCE_PROMPT_TOKENS = 512
# Decisions one poll returns at most (a page that has fallen behind gets the latest ones).
MAX_DECISIONS_PER_POLL = 1000


class StatusPage:
    """The page's data, read from the live parts. `decisions`: the scheduler's ring (None: no decisions kept)."""

    def __init__(
        self,
        pool_name: str,
        datastore: Datastore,
        scheduler: Scheduler,
        flow_control: FlowController | None,
        decisions: DecisionLog | None,
    ):
        self.pool_name = pool_name
        self.datastore = datastore
        self.scheduler = scheduler
        self.flow_control = flow_control
        self.decisions = decisions
        self.weights = scheduler.weights
        self._summaries: dict[int, dict] = {}  # seq -> a decision's summary, while the ring keeps it
        self.html = resources.files("epp").joinpath("status.html").read_bytes()

    def snapshot(self, since: int = 0) -> dict:
        """The pool, flow control, the decisions after `since` and the latest one in full (what the page shows
        until one is chosen: no second round trip)."""
        ring = self.decisions
        return {
            "pool": self.pool_name,
            "time": time(),
            "endpoints": self._endpoints(),
            "predictor": self._predictor(),
            "flow_control": self._flow_control(),
            "scorers": [{"name": n.name, "type": n.type, "weight": w} for n, w in self.weights.items()],
            "decisions": self._decisions(since),
            "latest": self.decision(ring.count) if ring is not None and ring.count > since else None,
        }

    def _endpoints(self) -> list[dict]:
        endpoints = self.datastore.endpoints
        scheduler = self.scheduler
        prefix, kv_index = scheduler.prefix_index, scheduler.kv_index
        predicted = self._predicted_ttft(endpoints)
        now = monotonic()
        rows = []
        for i, e in enumerate(endpoints):
            m = e.metrics
            adapters = sorted({*m.running_adapters, *m.waiting_adapters, *e.recent_adapters}) if m else []
            rows.append(
                {
                    "name": e.name,
                    "address": e.hostport,
                    "engine": e.spec.engine,
                    "ready": not e.stale and m is not None,
                    "reason": _not_ready_reason(e),
                    "waiting": m.waiting if m else None,
                    "running": m.running if m else None,
                    "queue": queue_depth(e),
                    "running_estimate": running_requests(e),
                    "in_flight": e.in_flight_requests,
                    "in_flight_tokens": e.in_flight_tokens,
                    "peer_in_flight": e.peer_in_flight_requests,  # of in_flight, what peer replicas routed
                    "kv_usage": m.kv_usage if m else None,
                    "adapters": adapters,
                    "max_lora": m.max_lora if m else None,
                    "prefix_entries": prefix.entries(e) if prefix is not None else None,
                    "kv_event_blocks": kv_index.entries(e.hostport) if kv_index is not None else None,
                    "recent_ttft": e.recent_ttft or None,
                    "predicted_ttft": predicted[i] if predicted else None,
                    "metrics_age": now - m.scraped_at if m and m.scraped_at else None,
                    "routed": e.routed_total,
                }
            )
        return rows

    def _predicted_ttft(self, endpoints: list[Endpoint]) -> list[float] | None:
        predictions = self.scheduler.predictions
        if predictions is None or not predictions.predictor.ttft_ready or not endpoints:
            return None
        predicted = predictions.predictor.predict_endpoints(
            endpoints, REFERENCE_PROMPT_TOKENS, [0] * len(endpoints), None, tpot=False
        )
        return [ttft for ttft, _ in predicted] if predicted else None

    def _predictor(self) -> dict | None:
        predictor = self.scheduler.latency_predictor
        if predictor is None:
            return None
        return {
            "ready": predictor.ttft_ready,
            "observations": predictor.observations,
            "ttft_mape": predictor.ttft_mape,
            "reference_prompt_tokens": REFERENCE_PROMPT_TOKENS,
        }

    def _flow_control(self) -> dict:
        controller = self.flow_control
        if controller is None:
            return {"enabled": False, "bands": []}
        now = controller.clock()
        bands = []
        for band in list(controller.order):
            flows = []
            for flow in list(band.flows.values()):
                if not flow.count:
                    continue
                head = flow.head()
                flows.append(
                    {
                        "id": flow.id,
                        "queued": flow.count,
                        "bytes": flow.bytes,
                        "oldest_wait": now - head.enqueued if head is not None else None,
                    }
                )
            bands.append({"priority": band.config.priority, "queued": band.count, "bytes": band.bytes, "flows": flows})
        return {"enabled": True, "queued": controller.count, "in_flight": controller.in_flight, "bands": bands}

    def _decisions(self, since: int) -> dict:
        ring = self.decisions
        if ring is None:
            return {"kept": 0, "last": 0, "made": 0, "per_second": 0, "entries": []}
        entries = list(ring.since(since))[-MAX_DECISIONS_PER_POLL:]
        summaries = self._summaries
        if entries and summaries:
            first = ring.first
            for seq in [s for s in summaries if s < first]:
                del summaries[seq]
        out = []
        for d in entries:
            summary = summaries.get(d.seq)
            if summary is None:
                summary = summaries[d.seq] = self._summary(d)
            out.append(summary)
        return {"kept": ring.size, "last": ring.count, "made": ring.made, "per_second": ring.per_second, "entries": out}

    def _summary(self, d: Decision) -> dict:
        explained = explain(d, self.weights)
        totals, picked, runner_up = d.totals, explained.picked, explained.runner_up
        runner = d.candidates[runner_up] if runner_up >= 0 else None
        return {
            "seq": d.seq,
            "time": d.at,
            "request_id": d.request_id,
            "model": d.model,
            "priority": d.priority,
            "fairness_id": d.fairness_id,
            "prompt_tokens": d.prompt_tokens,
            "considered": d.considered,
            "candidates": len(d.candidates),
            "pick": d.endpoints[0].name,
            "pick_address": d.endpoints[0].hostport,
            "fallbacks": [e.hostport for e in d.endpoints[1:]],
            "total": totals[picked] if picked >= 0 else None,
            "runner_up": runner.name if runner is not None else None,
            "runner_up_total": totals[runner_up] if runner is not None else None,
            "reason": explained.reason,
            "seconds": sum(seconds for _, seconds in d.timings),
        }

    def decision(self, seq: int) -> dict | None:
        """One decision in full: every candidate (best total first) with each scorer's raw score, and each plugin's
        time; None when the ring no longer holds it."""
        d = self.decisions.get(seq) if self.decisions is not None else None
        if d is None:
            return None
        return {
            **self._summary(d),
            "scorers": [{"name": n[1], "type": n[0], "weight": self.weights.get(n, 1.0)} for n, _ in d.raw_scores],
            "rows": [
                {
                    "name": d.candidates[i].name,
                    "address": d.candidates[i].hostport,
                    "total": d.totals[i],
                    "scores": [scores[i] for _, scores in d.raw_scores],
                }
                for i in ranked(d)
            ],
            "timings": [{"plugin": f"{n[0]}/{n[1]}", "seconds": s} for n, s in d.timings],
        }

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/", self._page)
        app.router.add_get("/status.json", self._json)
        app.router.add_get("/status/decision", self._decision)

    async def _page(self, request: web.Request) -> web.Response:
        return web.Response(body=self.html, content_type="text/html", charset="utf-8")

    async def _json(self, request: web.Request) -> web.Response:
        since = _int_query(request, "since", 0)
        return web.Response(body=json.dumps(self.snapshot(since)), content_type="application/json")

    async def _decision(self, request: web.Request) -> web.Response:
        seq = _int_query(request, "seq", -1)
        found = self.decision(seq)
        if found is None:
            raise web.HTTPNotFound(text=f"decision {seq} is not kept (the ring holds the last {self._kept()})")
        return web.Response(body=json.dumps(found), content_type="application/json")

    def _kept(self) -> int:
        return self.decisions.size if self.decisions is not None else 0


def _not_ready_reason(e: Endpoint) -> str:
    """Why the scheduler passes over `e` ("" when it is ready)."""
    if e.metrics is None:
        return f"no metrics page read yet: {e.stale_reason}" if e.stale_reason else "not scraped yet"
    if e.stale:
        return f"metrics stale: {e.stale_reason}" if e.stale_reason else "metrics stale"
    return ""


def _int_query(request: web.Request, name: str, default: int) -> int:
    text = request.query.get(name)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise web.HTTPBadRequest(text=f"{name} must be an integer, got {text!r}") from None
