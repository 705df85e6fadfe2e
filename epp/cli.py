"""`epp`: the Endpoint Picker. Serves Envoy's ext_proc on --grpc-port, gRPC health on --grpc-health-port and
Prometheus metrics on --metrics-port; discovers the pool from --pool-file and scrapes every endpoint."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import re
import resource
import signal
import socket
import sys
from pathlib import Path

import grpc
import uvloop
import zmq
from aiohttp import web
from grpc_health.v1 import health_pb2_grpc
from prometheus_client import CONTENT_TYPE_LATEST

from epp.config import ConfigError
from epp.datalayer.datastore import Datastore, PoolCollector
from epp.datalayer.endpoint import PoolState
from epp.datalayer.kubernetes import KubernetesSource
from epp.datalayer.kv_events import KVBlockIndex, KVEventSubscriber
from epp.datalayer.pool_file import PoolFileError, PoolFileSource
from epp.datalayer.scraper import Scraper
from epp.flowcontrol import FlowControlCollector, FlowControlConfig, FlowController
from epp.handlers import Reply, accesslog
from epp.handlers.budget import ByteBudget
from epp.handlers.extproc import DEFAULT_MAX_BODY_BYTES, BufferedBodyCollector, RequestStream
from epp.handlers.wire import ExtProcRequest
from epp.health import HealthState
from epp.leader import LeaseElector
from epp.metrics import EPPMetrics, MetricsPage
from epp.requestcontrol.director import Director
from epp.scheduling.scheduler import Scheduler
from epp.transport.grpcio import access_log_service, ext_proc_service
from epp.transport.h2 import MAX_CONNECTIONS, ExtProcServer, UnaryMethod
from protocol import extproc
from protocol.kv_events import DEFAULT_SUBSCRIBER_PORT

log = logging.getLogger("epp")
# Quiet endpoints (nothing running, waiting or in flight, and no request for that long) are scraped this many times
# less often until a request arrives (epp/datalayer/scraper.py): any traffic keeps the busy interval, so routing
# under load reads pages as fresh as before, and an idle EPP scrapes 5x less (`epp-bench idle`).
IDLE_INTERVAL_FACTOR = 5
# How long a thread that runs Python (a long prompt's tokenizing and block hashing in a worker, the KV-event
# subscriber) keeps the GIL before the event loop that answers Envoy gets it back; CPython's default is 5 ms, and a
# wake-up of the loop behind such a thread could wait that long. Heterogeneous workload, 16 req/s on 8 sims, 4 pairs:
# Envoy's arrival-to-upstream-send, medians, 16.9 -> 14.8 ms for 200-token prompts, 54.9 -> 49.7 ms for 6,000-token ones.
GIL_SWITCH_INTERVAL_SECONDS = 0.0005


def duration(text: str) -> float:
    """Seconds from "50ms", "1s", "2m" or a plain number of seconds."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s|m)?\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (use e.g. 50ms, 1s)")
    value, unit = float(match.group(1)), match.group(2) or "s"
    return value * {"ms": 0.001, "s": 1.0, "m": 60.0}[unit]


def _kubernetes_api(kubeconfig: str | None):
    from kubernetes import client, config

    if kubeconfig:
        config.load_kube_config(config_file=kubeconfig)
    else:
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
    configuration = client.Configuration.get_default_copy()
    configuration.retries = False  # our watchers back off and log an outage once; urllib3 would retry and warn
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
    return client.ApiClient(configuration)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="epp", description=__doc__)
    p.add_argument("--grpc-port", type=int, default=extproc.EPP_GRPC_PORT)
    p.add_argument("--grpc-health-port", type=int, default=extproc.EPP_GRPC_HEALTH_PORT)
    p.add_argument("--metrics-port", type=int, default=extproc.EPP_METRICS_PORT)
    p.add_argument("--bind-address", default="0.0.0.0", help="address the three servers listen on")
    p.add_argument("--pool-file", help="static pool (YAML); see epp/datalayer/pool_file.py")
    p.add_argument("--pool-name", help="InferencePool to watch (Kubernetes discovery)")
    p.add_argument("--pool-namespace", default="default")
    p.add_argument("--pool-group", default="inference.networking.k8s.io")
    p.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster config, else ~/.kube/config)")
    p.add_argument(
        "--ha-enable-leader-election",
        action="store_true",
        help="several replicas: only the Lease holder serves (reports ready)",
    )
    p.add_argument("--refresh-metrics-interval", type=duration, default=0.05)
    p.add_argument(
        "--refresh-metrics-idle-interval",
        type=duration,
        default=None,
        help="scrape interval of an endpoint with no running, waiting or in-flight request while no request arrived "
        "for as long, until one arrives "
        "(capped at half the staleness threshold; default: 5x --refresh-metrics-interval; the same value as "
        "--refresh-metrics-interval turns it off)",
    )
    p.add_argument("--metrics-staleness-threshold", type=duration, default=2.0)
    p.add_argument("--scrape-timeout", type=duration, default=1.0)
    p.add_argument("--config-file", help="EndpointPickerConfig YAML")
    p.add_argument("--config-text", help="EndpointPickerConfig YAML, inline")
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
        help="open connections the h2 transport accepts (ext_proc and access log together); beyond them a new "
        "connection gets GOAWAY",
    )
    p.add_argument(
        "--kv-events-port",
        type=int,
        default=DEFAULT_SUBSCRIBER_PORT,
        help="port of the ZMQ SUB socket for the model servers' KV events (vLLM --kv-events-config), bound on "
        "--bind-address, as llm-d's EPP; it runs only when the scheduling profile has a scorer that reads the "
        "events (precise-prefix-cache-scorer, in the default profile); 0: off",
    )
    p.add_argument(
        "--kv-events-connect-port-offset",
        type=int,
        default=None,
        help="instead of binding --kv-events-port, connect to each endpoint's own publisher at its address and its "
        "serving port + this offset (servers that bind, e.g. vLLM's tcp://*:5557 beside port 8000: -2443); "
        "every EPP replica then receives every server's events",
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
        default=4_000_000,
        help="cap on the KV-event index's (block hash, endpoint) entries; over it, the largest endpoint's oldest go",
    )
    p.add_argument("-v", "--verbosity", type=int, default=0, help="0 info, 1+ debug")
    return p


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    config_text = Path(args.config_file).read_text() if args.config_file else args.config_text
    scheduler = Scheduler.from_config(config_text)
    flow_config = FlowControlConfig.from_text(config_text)
    elector = None
    if args.pool_file:
        source = PoolFileSource(args.pool_file)
        initial = source.initial()
    else:
        api = _kubernetes_api(args.kubeconfig)
        source = KubernetesSource(api, args.pool_name, args.pool_namespace, args.pool_group)
        initial = PoolState()
        if args.ha_enable_leader_election:
            identity = os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"
            elector = LeaseElector(api, f"{args.pool_name}-epp", args.pool_namespace, identity)
    scraper = Scraper(
        args.refresh_metrics_interval,
        args.scrape_timeout,
        args.metrics_staleness_threshold,
        idle_interval=args.refresh_metrics_idle_interval or IDLE_INTERVAL_FACTOR * args.refresh_metrics_interval,
    )
    sources = [scraper]
    subscriber = None
    if args.kv_events_port and scheduler.requires_kv_events:
        index = KVBlockIndex(args.kv_index_max_entries)
        subscriber = KVEventSubscriber(
            index,
            f"tcp://{args.bind_address.replace('0.0.0.0', '*')}:{args.kv_events_port}",
            connect_port_offset=args.kv_events_connect_port_offset,
            replay_port_offset=args.kv_events_replay_port_offset,
        )
        scheduler.use_kv_index(index)
        sources.append(subscriber)
        log.info(
            "KV events: %s",
            f"bound on {subscriber.endpoint}"
            if subscriber.endpoint
            else f"connecting to each endpoint's port {args.kv_events_connect_port_offset:+d}",
        )
    datastore = Datastore(sources, scheduler.on_pool_changed)
    datastore.apply(initial)
    pool_name = args.pool_name or Path(args.pool_file).stem
    detector = scheduler.detector
    flow_control = None
    body_budget = ByteBudget(args.max_buffered_body_bytes)
    metrics = EPPMetrics(pool_name)
    if flow_config.enabled:
        flow_control = FlowController(
            flow_config,
            lambda in_flight: detector.has_room(datastore.endpoints, in_flight),
            observer=metrics.flow_control_outcome,
            poll_interval=args.refresh_metrics_interval,  # a scrape may have shown room
        )
        scraper.pending = lambda: flow_control.count  # a queued request waits for a page that shows room
    director = Director(datastore, scheduler, metrics, flow_control)

    def new_stream(reply: Reply) -> RequestStream:
        return RequestStream(director, reply, body_budget, args.max_request_body_bytes)

    export_access_log = accesslog.ExportHandler(director.on_access_log)
    if args.ext_proc_transport == "h2":
        server = ExtProcServer(
            new_stream,
            {
                accesslog.EXPORT_PATH: UnaryMethod(
                    accesslog.ExportRecords, export_access_log, accesslog.MAX_EXPORT_BYTES
                )
            },
            args.max_ext_proc_connections,
            ExtProcRequest,
        )
    else:
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 * 1024 * 1024)])
        server.add_generic_rpc_handlers(
            [ext_proc_service(new_stream, ExtProcRequest), access_log_service(export_access_log)]
        )
        server.add_insecure_port(f"{args.bind_address}:{args.grpc_port}")
    metrics.register(PoolCollector(pool_name, datastore))
    metrics.register(scheduler)
    metrics.register(FlowControlCollector(metrics, flow_control, datastore, detector.saturation))
    if subscriber is not None:
        metrics.register(subscriber)
    metrics.register(BufferedBodyCollector(body_budget))
    if isinstance(server, ExtProcServer):
        metrics.register(server)
    health = HealthState()
    health_server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.servicer, health_server)
    health_server.add_insecure_port(f"{args.bind_address}:{args.grpc_health_port}")

    metrics_page = MetricsPage(metrics.registry)

    async def metrics_handler(request: web.Request) -> web.Response:
        return web.Response(body=await metrics_page.get(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", metrics_handler)
    runner = web.AppRunner(app, access_log=None)
    # Readiness: the pool is known (the pool file is read at start; Kubernetes: every resource listed once) and,
    # with leader election, this replica serves. Recomputed whenever either changes.
    readiness = {"pool synced": bool(args.pool_file), "serving": elector is None}

    async def report_health() -> None:
        await health.set(live=True, ready=all(readiness.values()))

    def on_pool(state: PoolState) -> None:
        datastore.apply(state)
        if not readiness["pool synced"]:
            readiness["pool synced"] = True
            log.info("pool %s synced: %d endpoints", pool_name, len(state.endpoints))
            asyncio.get_running_loop().create_task(report_health())

    def on_serving(serving: bool):
        readiness["serving"] = serving
        return report_health()

    watcher = asyncio.create_task(source.run(on_pool))
    tasks = [watcher]
    try:
        if args.ext_proc_transport == "h2":
            await server.start(args.bind_address, args.grpc_port)
        else:
            await server.start()
        await health_server.start()
        await runner.setup()
        await web.TCPSite(runner, args.bind_address, args.metrics_port).start()
        await report_health()
        if elector is not None:
            elector.on_change = on_serving
            tasks.append(asyncio.create_task(elector.run()))
        log.info(
            "epp ready: ext_proc %s:%d, health %d, metrics %d, %d endpoints",
            args.bind_address,
            args.grpc_port,
            args.grpc_health_port,
            args.metrics_port,
            len(datastore.endpoints),
        )
        print(f"epp ready on {args.bind_address}:{args.grpc_port}", flush=True)
        # What start-up built (modules, protobuf descriptors, the scheduler and its plugins) lives as long as the
        # process: frozen, a full collection no longer walks it. Unfrozen, each took 42-48 ms, a stall of every
        # request on the loop (epp-bench chaos, model-name flood: worst well-behaved latency 32-60 ms); frozen 0.6 ms.
        gc.collect()
        gc.freeze()
        await stop.wait()
    finally:
        for task in tasks:
            task.cancel()
        # Awaited here, not left to asyncio.run's last cancellation (which would cut the elector's release short).
        await asyncio.gather(*tasks, return_exceptions=True)
        await health.set(live=False, ready=False)
        await server.stop(grace=1.0)
        await health_server.stop(grace=None)
        await runner.cleanup()
        await datastore.close()


def raise_open_files_limit() -> int:
    """The soft limit on open files raised to the hard one, as Go's runtime does for GIE's EPP: the connections it
    accepts (up to --max-ext-proc-connections) and the ones it opens (a scrape and a KV-event socket per endpoint)
    must not hit a distribution's default soft limit of 1,024. Returns the limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if bool(args.pool_file) == bool(args.pool_name):
        raise SystemExit("epp: give exactly one of --pool-file or --pool-name")
    logging.basicConfig(
        level=logging.DEBUG if args.verbosity > 0 else logging.INFO,
        format='{"ts":"%(asctime)s","level":"%(levelname)s","logger":"%(name)s","msg":"%(message)s"}',
    )

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(args, stop)

    sys.setswitchinterval(GIL_SWITCH_INTERVAL_SECONDS)
    open_files = raise_open_files_limit()
    if open_files != resource.RLIM_INFINITY and open_files < args.max_ext_proc_connections + 256:
        log.warning(
            "open files are limited to %d: fewer than --max-ext-proc-connections (%d) and the EPP's own sockets",
            open_files,
            args.max_ext_proc_connections,
        )
    try:
        with contextlib.suppress(KeyboardInterrupt):
            uvloop.run(run())  # less per-callback overhead than asyncio's loop on the ext_proc path
    except (ConfigError, PoolFileError, OSError, zmq.ZMQError) as exc:
        raise SystemExit(f"epp: {exc}") from None
