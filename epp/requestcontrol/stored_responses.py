"""Where a Responses follow-up must go: the endpoint that stored the response its `previous_response_id` names.

A model server keeps stored responses in its own process (vLLM's Responses API, ours), so a follow-up is answered
only there. The EPP learns `response id -> endpoint` two ways, neither shared between replicas:
* from the response itself, when its body comes through the EPP (Envoy's response_body_mode FULL_DUPLEX_STREAMED):
  the id is in the first bytes of the JSON answer and of the stream's `response.created` event;
* on a miss (another EPP replica routed the first turn, the body did not come through, this replica restarted): by
  asking the pool's endpoints `GET /v1/responses/{id}` at once, all of them, and taking the one that answers 200 (the
  others answer 404). Any replica finds it, with nothing shared; measured in docs/agents.md. When this replica
  routed the agent session's last stored answer (`routed`: its session header, protocol.extproc.agent_identity), that
  endpoint is asked alone first: an agent's follow-up is almost always to its own previous answer, and the gateway's
  default access-log mode never shows the EPP a response body, so otherwise every follow-up cost one request per
  endpoint (3 ms of the EPP's CPU for 8 endpoints, 5 % of all it spent on the agentic benchmark).
A follow-up then goes only to that endpoint (no fallbacks: no other server can answer it). When no endpoint has it
(its endpoint left the pool, or it was never stored, or dropped from a bounded store): 404 in OpenAI's error shape,
as the server itself answers an unknown id, never a turn answered without its conversation.

Bounded: `MAX_LEARNT` ids (the oldest forgotten first: a forgotten one is found again by asking), at most
`MAX_LOOKUPS` look-ups in flight (more wait for a turn), each at most `LOOKUP_SECONDS`.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections import OrderedDict

import aiohttp
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from protocol.openai import OpenAIError
from protocol.responses import RESPONSE_ID_PREFIX

log = logging.getLogger("epp.requestcontrol")

MAX_LEARNT = 100_000  # ~150 B an entry: ~15 MB
MAX_SESSIONS = 100_000  # agent session -> the endpoint of its last stored answer: ~200 B an entry
MAX_LOOKUPS = 64
LOOKUP_SECONDS = 1.0  # within the 2 s the handler tells the proxy to wait without flow control (its margin)
RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(' + RESPONSE_ID_PREFIX.encode() + rb'[A-Za-z0-9_-]{1,200})"')
HEAD_BYTES = 512  # the id is in the first bytes of the response (non-streamed) or of its first event (streamed)


def gone(response_id: str, where: str | None) -> OpenAIError:
    """The follow-up's stored response is on no endpoint of the pool."""
    reason = (
        f"the endpoint that stored it ({where}) has left the pool or does not answer"
        if where
        else "no endpoint stores it"
    )
    return OpenAIError(
        f"Response with id '{response_id}' not found: {reason}. Start the conversation again without "
        "previous_response_id.",
        404,
        param="previous_response_id",
        code="previous_response_not_found",
    )


def _put_newest(table: OrderedDict[str, str], key: str, value: str, limit: int) -> None:
    """`key` -> `value` as the newest entry of `table`, the oldest dropped past `limit` entries."""
    table[key] = value
    table.move_to_end(key)
    if len(table) > limit:
        table.popitem(last=False)


class ResponseLocator:
    def __init__(self) -> None:
        self.learnt: OrderedDict[str, str] = OrderedDict()  # response id -> "ip:port"
        self.sessions: OrderedDict[str, str] = OrderedDict()  # agent session -> "ip:port" of its last stored answer
        self.lookups = asyncio.Semaphore(MAX_LOOKUPS)
        self._session: aiohttp.ClientSession | None = None
        self.learnt_from_responses = 0  # ids learnt from the responses that came through
        self.routed_known = 0  # follow-ups (and GETs, DELETEs) routed by what was known
        self.found_by_asking = 0
        self.not_found = 0

    def learn(self, response_id: str, hostport: str) -> None:
        _put_newest(self.learnt, response_id, hostport, MAX_LEARNT)

    def learn_from_body(self, head: bytes, hostport: str) -> bool:
        """Learn the id in a response's first bytes; False when they hold none (yet)."""
        match = RESPONSE_ID.search(head, 0, HEAD_BYTES)
        if match is None:
            return False
        self.learn(match.group(1).decode(), hostport)
        self.learnt_from_responses += 1
        return True

    def routed(self, session: str, hostport: str) -> None:
        """An answer to be stored, for this agent session, was sent to `hostport`: where the session's follow-up
        most likely finds its previous response when the id is not learnt."""
        _put_newest(self.sessions, session, hostport, MAX_SESSIONS)

    def known(self, response_id: str) -> str | None:
        return self.learnt.get(response_id)

    def collect(self):
        """The follow-ups' outcomes (EPPMetrics.register)."""
        outcomes = CounterMetricFamily(
            "llm_d_epp_stored_response_lookups",
            "Requests for a stored Responses answer (previous_response_id, GET, DELETE) by how its endpoint was found:"
            " known (learnt from a response or an earlier look-up), asked (the pool asked), not_found.",
            labels=["outcome"],
        )
        outcomes.add_metric(["known"], self.routed_known)
        outcomes.add_metric(["asked"], self.found_by_asking)
        outcomes.add_metric(["not_found"], self.not_found)
        yield outcomes
        yield GaugeMetricFamily(
            "llm_d_epp_stored_response_ids", "Response ids whose endpoint this EPP knows.", value=len(self.learnt)
        )

    async def find(self, response_id: str, hostports: list[str], session: str | None = None) -> str | None:
        """Ask the endpoints for the response: first the one this agent `session`'s last stored answer went to
        (`routed`), when it is among `hostports`, then all the others at once; the one that has it, learnt, or
        None."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=LOOKUP_SECONDS), connector=aiohttp.TCPConnector(limit=0)
            )
        async with self.lookups:
            likely = self.sessions.get(session) if session is not None else None
            if likely in hostports:
                if await self._has(likely, response_id) is not None:
                    self.learn(response_id, likely)
                    self.found_by_asking += 1
                    return likely
                hostports = [h for h in hostports if h != likely]
            asks = [asyncio.ensure_future(self._has(hostport, response_id)) for hostport in hostports]
            try:
                for done in asyncio.as_completed(asks):
                    hostport = await done
                    if hostport is not None:
                        self.learn(response_id, hostport)
                        self.found_by_asking += 1
                        return hostport
            finally:
                for ask in asks:
                    ask.cancel()
        self.not_found += 1
        return None

    async def _has(self, hostport: str, response_id: str) -> str | None:
        try:
            async with self._session.get(f"http://{hostport}/v1/responses/{response_id}") as answer:
                return hostport if answer.status == 200 else None
        except (TimeoutError, aiohttp.ClientError, OSError) as error:
            log.debug("asking %s for response %s: %s", hostport, response_id, error)
            return None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
