"""session-affinity-scorer: a session stays on its endpoint until that endpoint saturates; agents' session headers
count as sessions and as fairness flows."""

import json

import pytest

from epp.config import ConfigError
from epp.datalayer.endpoint import EndpointSpec, PoolState
from epp.scheduling.plugins.session_affinity_scorer import SessionAffinityScorer
from tests.epp.test_server import BASE_HEADERS, body_message, headers_message, make_picker, new_stream

CONFIG = """\
plugins:
- type: session-affinity-scorer
  parameters: {PARAMETERS}
- type: queue-scorer
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: session-affinity-scorer
    weight: 3
  - pluginRef: queue-scorer
"""
POOL = PoolState(endpoints=tuple(EndpointSpec(n, f"10.0.0.{i}", 8000) for i, n in enumerate("abc", 1)))


def picker(parameters: str = "{}"):
    # (an Alpha plugin, as llm-d's: tests/epp/scheduling/test_stability.py)
    return make_picker(POOL, CONFIG.replace("{PARAMETERS}", parameters), allow_experimental_plugins=True)


def route(director, headers: dict) -> str:
    stream = new_stream(director)
    stream.handle(headers_message({**BASE_HEADERS, **headers}))
    stream.handle(body_message(json.dumps({"model": "m", "prompt": "x"}).encode()))
    stream.after_reply()
    endpoint = stream.ctx.endpoint
    stream.finish()  # (ended at once: in-flight counts stay out of the way)
    return endpoint.hostport


def by_hostport(director, hostport):
    return next(e for e in director.datastore.endpoints if e.hostport == hostport)


@pytest.mark.parametrize("header", ["x-session-id", "x-claude-code-session-id", "x-session-affinity", "session-id"])
def test_a_session_stays_until_its_endpoint_saturates(header):
    director = picker()
    home = route(director, {header: "s1"})
    by_hostport(director, home).metrics.waiting = 4  # busier than the others, below the threshold (5)
    assert {route(director, {header: "s1"}) for _ in range(5)} == {home}
    assert route(director, {header: "s2"}) != home  # other sessions: load decides
    by_hostport(director, home).metrics.waiting = 5  # saturated: load wins, and the session moves
    moved = route(director, {header: "s1"})
    assert moved != home
    by_hostport(director, home).metrics.waiting = 0
    by_hostport(director, moved).metrics.waiting = 3
    assert route(director, {header: "s1"}) == moved


def test_parameters_choose_the_headers_and_bound_the_sessions():
    director = picker('{"header": "X-Conversation", "agentHeaders": [], "maxSessions": 2}')
    scorer = next(p for p in director.scheduler._at_pick if isinstance(p, SessionAffinityScorer))
    home = route(director, {"x-conversation": "c1"})
    by_hostport(director, home).metrics.waiting = 2
    assert route(director, {"x-conversation": "c1"}) == home
    route(director, {"x-claude-code-session-id": "ignored"})
    assert list(scorer.sessions) == ["c1"]
    for session in ("c2", "c3"):
        route(director, {"x-conversation": session})
    assert list(scorer.sessions) == ["c2", "c3"]  # the least recently used went first
    for bad in ('{"agentHeaders": [5]}', '{"ttlSeconds": 0}', '{"sessionHeader": "x"}'):
        with pytest.raises(ConfigError):
            picker(bad)


def test_agent_identity_is_the_fairness_flow_unless_the_client_names_one():
    director = picker()
    stream = new_stream(director)
    stream.handle(headers_message({**BASE_HEADERS, "x-session-affinity": "agent-7"}))
    stream.handle(body_message(b'{"model": "m", "prompt": "x"}'))
    assert stream.ctx.request.fairness_id == "agent-7"
    stream.finish()
    stream = new_stream(director)
    headers = {**BASE_HEADERS, "session-id": "agent-8", "x-gateway-inference-fairness-id": "tenant-1"}
    stream.handle(headers_message(headers))
    stream.handle(body_message(b'{"model": "m", "prompt": "x"}'))
    assert stream.ctx.request.fairness_id == "tenant-1"
    stream.finish()
