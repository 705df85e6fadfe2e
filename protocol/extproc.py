# cython: annotation_typing=True
"""Names of the Endpoint Picker Protocol between the EPP and the proxy (Envoy or any Gateway)."""

# The EPP's pick: a request header and dynamic metadata, value "ip:port" or a comma list (primary first).
DESTINATION_ENDPOINT_HEADER = "x-gateway-destination-endpoint"
DESTINATION_ENDPOINT_NAMESPACE = "envoy.lb"
DESTINATION_ENDPOINT_KEY = DESTINATION_ENDPOINT_HEADER
# llm-d's router (--emit-endpoint-scores): beside the pick in the same namespace, a struct "ip:port" -> the scheduler's
# weighted total for every endpoint it scored, the ones it did not pick included.
DESTINATION_ENDPOINT_SCORES_KEY = "x-gateway-destination-endpoint-scores"

# Gateway-private headers (not part of the protocol) in which our EPP repeats the 2nd and 3rd endpoint of its pick
# for our Envoy bootstrap: retry n goes to the ORIGINAL_DST cluster that reads header n.
FALLBACK_ENDPOINT_HEADERS = ("x-gateway-destination-endpoint-fallback-1", "x-gateway-destination-endpoint-fallback-2")

# Candidate subset the proxy allows, in the request's metadata_context (list or comma string).
SUBSET_HINT_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_HINT_KEY = "x-gateway-destination-endpoint-subset"

# The endpoint that actually served the request, in the response's metadata_context.
SERVED_ENDPOINT_NAMESPACE = "envoy.lb"
SERVED_ENDPOINT_KEY = "x-gateway-destination-endpoint-served"

# Request headers the EPP reads.
REQUEST_ID_HEADER = "x-request-id"
# The longest x-request-id the EPP keeps as the request's id (a UUID is 36 characters); a longer one is replaced by
# the EPP's own on the routed request, and an access-log record with one is not read: the ids key tables that
# wait for records, and a client's header or a sender of records may be up to the proxy's header limit (60 KB).
MAX_REQUEST_ID_CHARS = 256
# llm-d router v1's names (pkg/epp/metadata/consts.go); each reads its older name as a deprecated alias, and the new
# name wins when a request carries both (`canonical_headers`).
OBJECTIVE_HEADER = "x-llm-d-inference-objective"
FAIRNESS_ID_HEADER = "x-llm-d-inference-fairness-id"
MODEL_NAME_REWRITE_HEADER = "x-llm-d-model-name-rewrite"
SLO_TTFT_HEADER = "x-llm-d-slo-ttft-ms"  # the request's time-to-first-token objective, milliseconds
SLO_TPOT_HEADER = "x-llm-d-slo-tpot-ms"  # its time-per-output-token objective, milliseconds
HEADER_ALIASES = {
    OBJECTIVE_HEADER: "x-gateway-inference-objective",
    FAIRNESS_ID_HEADER: "x-gateway-inference-fairness-id",
    MODEL_NAME_REWRITE_HEADER: "x-gateway-model-name-rewrite",
    SLO_TTFT_HEADER: "x-slo-ttft-ms",
    SLO_TPOT_HEADER: "x-slo-tpot-ms",
}


def canonical_headers(headers: dict[str, str]) -> dict[str, str]:
    """`headers` (lower-case names), with each deprecated alias's value copied under its current name unless the
    current name is there (present, even empty, it wins, as in llm-d); in place, and returned."""
    for name, alias in HEADER_ALIASES.items():
        if alias in headers and name not in headers:  # (the alias first: seldom there)
            headers[name] = headers[alias]
    return headers


# On every request the EPP drops (an ImmediateResponse 429 or 503), llm-d's header naming why, with llm-d's values
# (pkg/common/error/error.go): a drop without a more precise reason gets its status's.
DROPPED_REASON_HEADER = "x-llm-d-request-dropped-reason"
DROPPED_SATURATED = "rejected-saturated"  # 429: endpoints exist, none has room (shed, a full queue, filtered out)
DROPPED_NO_ENDPOINTS = "rejected-no-endpoints"  # 503: no endpoint can serve it
DROPPED_TTL_EXPIRED = "rejected-ttl-expired"  # 429: its wait in flow control outlived its TTL
DROPPED_REASONS_BY_STATUS = {429: DROPPED_SATURATED, 503: DROPPED_NO_ENDPOINTS}
# A client's session (session-affinity-scorer's default header) and the agents' own session headers, as llm-d's
# agent-identity plugin reads them, first match wins: Claude Code, OpenCode, Codex (and its older spelling).
SESSION_ID_HEADER = "x-session-id"
AGENT_SESSION_HEADERS = ("x-claude-code-session-id", "x-session-affinity", "session-id", "session_id")
MAX_SESSION_ID_CHARS = 256  # longer values are not keys (a header can be up to the proxy's limit)

# Largest body chunk the EPP sends back to the proxy in FULL_DUPLEX_STREAMED mode.
MAX_BODY_CHUNK_BYTES = 62_000

# Default ports (the project's fixed names).
MODEL_SERVER_PORT = 8000
EPP_GRPC_PORT = 9002
EPP_GRPC_HEALTH_PORT = 9003
EPP_METRICS_PORT = 9090
ENVOY_LISTENER_PORT = 8081
ENVOY_ADMIN_PORT = 19000


def agent_identity(headers: dict[str, str], names: tuple[str, ...] = AGENT_SESSION_HEADERS) -> str | None:
    """The first non-empty of the named session headers (at most MAX_SESSION_ID_CHARS), or None."""
    for name in names:
        value = headers.get(name)
        if value and len(value) <= MAX_SESSION_ID_CHARS:
            return value
    return None
