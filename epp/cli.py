"""`epp`: the Endpoint Picker. Serves Envoy's ext_proc on --grpc-port, gRPC health on --grpc-health-port and
Prometheus metrics on --metrics-port; discovers the pool from --pool-file and scrapes every endpoint."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import re
import resource
import signal
import sys

import uvloop
import zmq

from epp.app import EndpointPicker
from epp.config import ConfigError
from epp.datalayer.kv_events import DEFAULT_MAX_ENTRIES
from epp.datalayer.pool_file import PoolFileError
from epp.handlers.extproc import DEFAULT_MAX_BODY_BYTES
from epp.replicas import DEFAULT_REPLICA_PORT, parse_peers
from epp.scheduling.decisions import DEFAULT_DECISIONS, DEFAULT_DECISIONS_PER_SECOND
from epp.transport.h2 import MAX_CONNECTIONS
from protocol import extproc
from protocol.cli import Parser, command_parser
from protocol.http_listener import MAX_CONNECTIONS as MAX_HTTP_CONNECTIONS
from protocol.kv_events import DEFAULT_SUBSCRIBER_PORT
from protocol.limits import give_large_blocks_back, raise_open_files_limit

log = logging.getLogger("epp")
# How long a thread that runs Python (a long prompt's tokenizing and block hashing in a worker, the KV-event
# subscriber) keeps the GIL before the event loop that answers Envoy gets it back; CPython's default is 5 ms, and a
# wake-up of the loop behind such a thread could wait that long. Heterogeneous workload, 16 req/s on 8 sims, 4 pairs:
# Envoy's arrival-to-upstream-send, medians, 16.9 -> 14.8 ms for 200-token prompts, 54.9 -> 49.7 ms for 6,000-token ones.
GIL_SWITCH_INTERVAL_SECONDS = 0.0005
# Kubernetes' default terminationGracePeriodSeconds, which our Deployment sets a little above it
# (manifests/base/epp.yaml): a stream in flight is one request until its response ends.
DEFAULT_DRAIN_TIMEOUT_SECONDS = 30.0


def duration(text: str) -> float:
    """Seconds from "50ms", "1s", "2m" or a plain number of seconds."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s|m)?\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (use e.g. 50ms, 1s)")
    value, unit = float(match.group(1)), match.group(2) or "s"
    return value * {"ms": 0.001, "s": 1.0, "m": 60.0}[unit]


def count(text: str) -> int:
    """A whole number >= 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"not a whole number >= 0: {text!r}")
    return value


def ratio(text: str) -> float:
    """A number within [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"not a number within [0, 1]: {text!r}")
    return value


def replica_peers(text: str) -> list[tuple[str, int]]:
    """--replica-peers: a comma list of host:port."""
    try:
        return parse_peers(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> Parser:
    p = command_parser("epp", __doc__)
    p.add_argument("--grpc-port", type=int, default=extproc.EPP_GRPC_PORT, help="Envoy's ext_proc (gRPC) port")
    p.add_argument("--grpc-health-port", type=int, default=extproc.EPP_GRPC_HEALTH_PORT, help="gRPC health port")
    p.add_argument("--metrics-port", type=int, default=extproc.EPP_METRICS_PORT, help="Prometheus /metrics port")
    p.add_argument("--bind-address", default="0.0.0.0", help="address the three servers listen on")
    p.add_argument("--pool-file", help="static pool (YAML); see epp/datalayer/pool_file.py")
    p.add_argument("--pool-name", help="InferencePool to watch (Kubernetes discovery)")
    p.add_argument("--pool-namespace", default="default", help="with --pool-name: the InferencePool's namespace")
    p.add_argument(
        "--pool-group", default="inference.networking.k8s.io", help="with --pool-name: the InferencePool's API group"
    )
    p.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster config, else ~/.kube/config)")
    p.add_argument(
        "--ha-enable-leader-election",
        action="store_true",
        help="several replicas: only the Lease holder serves (reports ready)",
    )
    p.add_argument(
        "--replica-port",
        type=int,
        default=DEFAULT_REPLICA_PORT,
        help="UDP port of the channel on which active-active replicas share their in-flight load and prefix-index "
        "learning (docs/replicas.md); with --replica-peers",
    )
    p.add_argument(
        "--replica-peers",
        type=replica_peers,
        default=[],
        help="the other replicas, host:port,...: a host that resolves to several addresses (a headless Service) means "
        "all of them, resolved again every few seconds; this replica skips itself (default: no sharing)",
    )
    p.add_argument(
        "--replica-share-pages",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="replicas share the model servers' metrics pages: each reads a share of the pool and sends its peers "
        "what it read, and reads an endpoint itself when that page is late (docs/replicas.md); with --replica-peers",
    )
    p.add_argument(
        "--replica-turns",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="replicas pick in turns: the replica with the lowest instance id grants them one at a time with the "
        "pool's load, so requests that reach several replicas at once are placed as one EPP would place them; a turn "
        "not granted within 10 ms is taken anyway (docs/replicas.md); with --replica-peers",
    )
    p.add_argument(
        "--replica-secret-file",
        help="file holding a secret shared by the replicas: every datagram on the replica channel is signed "
        "(HMAC-SHA256) and unsigned ones are ignored",
    )
    p.add_argument(
        "--refresh-metrics-interval", type=duration, default=0.05, help="scrape interval of each endpoint (seconds)"
    )
    p.add_argument(
        "--refresh-metrics-idle-interval",
        type=duration,
        default=None,
        help="scrape interval of an endpoint with no running, waiting or in-flight request while no request arrived "
        "for as long, until one arrives "
        "(capped at half the staleness threshold; default: 5x --refresh-metrics-interval; the same value as "
        "--refresh-metrics-interval turns it off)",
    )
    p.add_argument(
        "--metrics-staleness-threshold",
        type=duration,
        default=2.0,
        help="an endpoint with no good scrape for as long is routed to only when no fresh one is left (seconds)",
    )
    p.add_argument("--scrape-timeout", type=duration, default=1.0, help="timeout of one scrape (seconds)")
    config = p.add_mutually_exclusive_group()
    config.add_argument("--config-file", help="EndpointPickerConfig YAML (default: the built-in profile)")
    config.add_argument("--config-text", help="EndpointPickerConfig YAML, inline")
    p.add_argument(
        "--allow-experimental-plugins",
        action="store_true",
        help="let the config use plugins of the Alpha stability level (docs/plugins.md; llm-d router's flag)",
    )
    p.add_argument(
        "--ext-proc-transport",
        choices=["h2", "grpcio"],
        default="h2",
        help="h2: the EPP's lean gRPC server on the event loop (cleartext; fastest); grpcio: grpcio aio",
    )
    p.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies are answered 413 (the model servers' default limit)",
    )
    p.add_argument(
        "--max-buffered-body-bytes",
        type=int,
        default=8 * DEFAULT_MAX_BODY_BYTES,
        help="request body bytes all ext_proc streams together may buffer at once; over it, 413",
    )
    p.add_argument(
        "--max-ext-proc-connections",
        type=int,
        default=MAX_CONNECTIONS,
        help="open connections the ext_proc port accepts (ext_proc and access log together); beyond them a new "
        "connection gets GOAWAY (h2) or is closed (grpcio)",
    )
    p.add_argument(
        "--kv-events-port",
        type=int,
        default=DEFAULT_SUBSCRIBER_PORT,
        help="port of each endpoint's KV-event publisher (vLLM --kv-events-config endpoint tcp://*:5557): the EPP "
        "subscribes to every endpoint's own publisher as the pool lists it (llm-d's pod discovery), so an "
        "endpoint's events come from that endpoint only; it runs only when the scheduling profile has a scorer that "
        "reads the events (precise-prefix-cache-scorer, in the default profile); 0: off",
    )
    p.add_argument(
        "--kv-events-connect-port-offset",
        type=int,
        default=None,
        help="each endpoint's publisher listens at its serving port + this offset instead of --kv-events-port "
        "(several servers on one address: each binds its own)",
    )
    p.add_argument(
        "--kv-events-bind",
        action="store_true",
        help="bind --kv-events-port on --bind-address instead, for servers that connect to the EPP (vLLM endpoint "
        "tcp://<epp>:5557); a message counts only when its sender's IP address is the one its topic names, so any "
        "process on a server's host can speak for it: only where the network lets nothing else reach the port",
    )
    p.add_argument(
        "--kv-events-replay-port-offset",
        type=int,
        default=None,
        help="each server's KV event replay socket (vLLM replay_endpoint) listens on its serving port + this "
        "offset: a sequence gap is then replayed instead of dropping the server's entries",
    )
    p.add_argument(
        "--kv-index-max-entries",
        type=int,
        default=DEFAULT_MAX_ENTRIES,
        help="cap on the KV-event index's (block hash, endpoint) entries, ~150-208 bytes each (the default: under "
        "~500 MiB); over it, the largest endpoint's oldest go",
    )
    # Observability: the status page, the endpoints' scores in the gateway's metadata, traces (docs/observability.md)
    p.add_argument(
        "--status-decisions",
        type=count,
        default=DEFAULT_DECISIONS,
        help="scheduling decisions the status page (GET / on --metrics-port) keeps, with every candidate's scores "
        "(default %(default)s; 0: none kept)",
    )
    p.add_argument(
        "--status-decisions-per-second",
        type=count,
        default=DEFAULT_DECISIONS_PER_SECOND,
        help="decisions the status page keeps a second at most: past it, the first of each second are kept and the "
        "rest counted (default %(default)s: the ring then spans ten seconds or more; 0: every decision, which "
        "cost a busy EPP 1.09x its CPU per request)",
    )
    p.add_argument(
        "--emit-endpoint-scores",
        action="store_true",
        help="put every scored endpoint's weighted total in the request's dynamic metadata (envoy.lb namespace, key "
        "x-gateway-destination-endpoint-scores: a struct ip:port -> score), as llm-d's router, for the gateway to log",
    )
    p.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        help="OpenTelemetry collector (OTLP/gRPC, host:port or URL) to export request traces to: a gateway.request "
        "span per request with flow control and scheduling under it, its traceparent sent upstream (default: no "
        "tracing)",
    )
    p.add_argument(
        "--trace-sampling-ratio",
        type=ratio,
        default=1.0,
        help="share of new traces kept (a trace continued from the client or the gateway keeps its own decision; "
        "default %(default)s)",
    )
    p.add_argument(
        "--drain-timeout",
        type=duration,
        default=DEFAULT_DRAIN_TIMEOUT_SECONDS,
        help="on SIGTERM or SIGINT: report not ready (gRPC health), tell the gateway to open new ext_proc streams "
        "elsewhere (HTTP/2 GOAWAY; no new connection is accepted) and wait up to this long for the streams in flight, "
        "which last until their responses end, before exiting; keep it below the pod's terminationGracePeriodSeconds "
        "(seconds; 0: exit at once)",
    )
    p.add_argument("-v", "--verbosity", type=int, default=0, help="0 info, 1+ debug")
    flag_rules(p)
    return p


def flag_rules(p: Parser) -> None:
    """The flags that mean something only beside another one: given alone they are refused, not ignored."""
    kubernetes = "--pool-name (Kubernetes discovery)"
    for flag in ("--pool-namespace", "--pool-group", "--kubeconfig", "--ha-enable-leader-election"):
        p.needs(flag, kubernetes, lambda a: a.pool_name is not None)
    for flag in ("--replica-port", "--replica-secret-file", "--replica-share-pages", "--replica-turns"):
        p.needs(flag, "--replica-peers", lambda a: bool(a.replica_peers))
    kv_flags = ("--kv-events-bind", "--kv-events-connect-port-offset", "--kv-events-replay-port-offset")
    for flag in (*kv_flags, "--kv-index-max-entries"):
        p.needs(flag, "KV events on (--kv-events-port not 0)", lambda a: bool(a.kv_events_port))
    p.needs("--kv-events-connect-port-offset", "no --kv-events-bind (it binds instead)", lambda a: not a.kv_events_bind)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if bool(args.pool_file) == bool(args.pool_name):
        parser.error("give exactly one of --pool-file FILE (a static pool) or --pool-name NAME (an InferencePool)")
    logging.basicConfig(
        level=logging.DEBUG if args.verbosity > 0 else logging.INFO,
        format='{"ts":"%(asctime)s","level":"%(levelname)s","logger":"%(name)s","msg":"%(message)s"}',
    )

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await EndpointPicker(args).run(stop)

    sys.setswitchinterval(GIL_SWITCH_INTERVAL_SECONDS)
    give_large_blocks_back()
    open_files = raise_open_files_limit()
    # the ext_proc and health ports take --max-ext-proc-connections each, the metrics port MAX_HTTP_CONNECTIONS
    wanted = 2 * args.max_ext_proc_connections + MAX_HTTP_CONNECTIONS + 256
    if open_files != resource.RLIM_INFINITY and open_files < wanted:
        log.warning(
            "open files are limited to %d: fewer than the ext_proc and health ports' connections (2 x "
            "--max-ext-proc-connections, %d), the metrics port's (%d) and the EPP's own sockets",
            open_files,
            args.max_ext_proc_connections,
            MAX_HTTP_CONNECTIONS,
        )
    try:
        with contextlib.suppress(KeyboardInterrupt):
            uvloop.run(run())  # less per-callback overhead than asyncio's loop on the ext_proc path
    except (ConfigError, PoolFileError, OSError, zmq.ZMQError) as exc:
        raise SystemExit(f"epp: {exc}") from None
