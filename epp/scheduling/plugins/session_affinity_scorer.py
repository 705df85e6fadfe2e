"""session-affinity-scorer: keep a session's requests on the endpoint that served its last one, until that endpoint
saturates.

Reads: the request's session, the first non-empty of the `header` (default `x-session-id`) and the agents' own
session headers (`agentHeaders`, by default llm-d's agent-identity list: `x-claude-code-session-id` for Claude Code,
`x-session-affinity` for OpenCode, `session-id` and `session_id` for Codex); each endpoint's queue and KV-cache usage
(`epp.scheduling.saturation`).
Score: 1.0 for the endpoint the session is bound to, 0.0 for the others, while that endpoint is a candidate and not
saturated (its queue below `queueDepthThreshold`, its KV usage below `kvCacheUtilThreshold`, fresh metrics); else
the scorer abstains (no session, a session not seen for `ttlSeconds`, its endpoint gone or saturated) and load and
prefix scores decide. Each routed request binds its session to the endpoint it went to (a spilled session moves: its
newest context is cached there now).
Parameters: `header` ("x-session-id"), `agentHeaders` (the list above; [] reads only `header`), `ttlSeconds` (600),
`maxSessions` (100,000: the least recently used are forgotten first, ~200 B each), `queueDepthThreshold` (5),
`kvCacheUtilThreshold` (0.8).
Trade-offs: an agent's turns re-read its whole context, which the prefix scorers follow too; the session adds what
they cannot see: a turn whose prompt changed early (a compacted context, a different system prompt), and a forked
subagent, go where the session's cache is. Held only while the endpoint has room: a hot session must not pile a
queue on one server while others idle. Not in the default profile: there the prefix scorers already follow a
session's context, and at weight 3 this scorer held the agentic workload's sessions on the three servers where the
shared tools prompt first landed, queues up to its threshold while five servers idled: mean TTFT 1.24x the default
profile's with ample KV memory, 1.12x under KV pressure (docs/2026-11-29-agentic.md). Worth it where prompts do not
show the session (a compacted context, a changed system prompt) and at a low `queueDepthThreshold`. Each EPP replica
binds on its own.
"""

from __future__ import annotations

from collections import OrderedDict
from time import monotonic

from epp.config import ConfigError
from epp.datalayer.endpoint import Endpoint
from epp.datalayer.load import QUEUE_DEPTH_READS
from epp.scheduling.framework import Parameters, PreRequest, Scorer, Stability, register
from epp.scheduling.saturation import SaturationDetector
from epp.scheduling.types import CycleState, SchedulingRequest, SchedulingResult
from protocol.extproc import AGENT_SESSION_HEADERS, SESSION_ID_HEADER, agent_identity


@register("session-affinity-scorer", Stability.ALPHA)
class SessionAffinityScorer(Scorer, PreRequest):
    consumes = (*QUEUE_DEPTH_READS, "kv_usage")
    at_pick = True  # a burst of one session's requests sees the binding of the first

    def __init__(self, parameters: dict | None):
        p = Parameters("session-affinity-scorer", parameters)
        header = p.get("header", SESSION_ID_HEADER, str).lower()
        agents = p.get("agentHeaders", list(AGENT_SESSION_HEADERS), list)
        if not all(isinstance(h, str) and h for h in agents):
            raise ConfigError(f"session-affinity-scorer: agentHeaders must be a list of header names, got {agents!r}")
        self.headers = (header, *(h.lower() for h in agents))
        self.ttl = float(p.get("ttlSeconds", 600, (int, float), minimum=1))
        self.max_sessions = p.get("maxSessions", 100_000, int, minimum=1)
        self.saturation = SaturationDetector(
            p.get("queueDepthThreshold", 5, int, minimum=1),
            float(p.get("kvCacheUtilThreshold", 0.8, (int, float), minimum=0, maximum=1)),
        )
        p.done()
        self.sessions: OrderedDict[str, tuple[str, float]] = OrderedDict()  # session -> (hostport, last routed)

    def score(
        self, cycle_state: CycleState, request: SchedulingRequest, endpoints: list[Endpoint]
    ) -> list[float] | None:
        session = agent_identity(request.headers, self.headers)
        bound = self.sessions.get(session) if session is not None else None
        if bound is None or monotonic() - bound[1] > self.ttl:
            return None
        hostport = bound[0]
        scores = [
            1.0 if e.hostport == hostport and not self.saturation.endpoint_saturated(e) else 0.0 for e in endpoints
        ]
        return scores if 1.0 in scores else None

    def pre_request(self, request: SchedulingRequest, result: SchedulingResult) -> None:
        session = agent_identity(request.headers, self.headers)
        if session is None or not result.endpoints:
            return
        sessions = self.sessions
        sessions[session] = (result.endpoints[0].hostport, monotonic())
        sessions.move_to_end(session)
        if len(sessions) > self.max_sessions:
            sessions.popitem(last=False)
