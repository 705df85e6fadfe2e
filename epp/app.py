"""The EPP as one object: `EndpointPicker` builds its parts from the command line's settings (`epp.cli`) and the
EndpointPickerConfig (read once, `epp.config.loader`), starts them and stops them.

The parts, bottom up: the pool's source (a pool file or Kubernetes) and the datastore with its endpoint sources (the
scraper, the KV-event subscriber when the profile reads KV events); the scheduler; flow control; the director; the
ext_proc transport (h2 or grpcio) and its handlers; gRPC health; the metrics port: the /metrics page, to which each
part registers its collector, and the status page (`epp.status`, at /); leader election (Kubernetes, several replicas);
the channel to peer replicas (`epp.replicas`, --replica-peers)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from aiohttp import web
from grpc_health.v1 import health_pb2_grpc
from prometheus_client import CONTENT_TYPE_LATEST

from epp.config import ConfigError
from epp.config.loader import load
from epp.datalayer.datastore import Datastore, PoolCollector
from epp.datalayer.endpoint import PoolState
from epp.datalayer.kv_events import KVBlockIndex, KVEventSubscriber
from epp.datalayer.pool_file import PoolFileSource
from epp.datalayer.scraper import Scraper
from epp.datalayer.source import PoolSource
from epp.flowcontrol import FlowControlCollector, FlowControlConfig, FlowController
from epp.handlers import accesslog
from epp.handlers.extproc import BufferedBodyCollector, stream_factory
from epp.handlers.wire import ExtProcRequest
from epp.health import HealthState
from epp.metrics import EPPMetrics, MetricsPage
from epp.replicas import ReplicaChannel
from epp.requestcontrol.director import Director
from epp.requestcontrol.tracing import OTLPExporter, RequestTracing
from epp.scheduling.decisions import DecisionLog
from epp.scheduling.scheduler import Scheduler
from epp.status import StatusPage
from epp.transport.grpcio import access_log_service, ext_proc_service
from epp.transport.h2 import ExtProcServer, UnaryMethod
from protocol.http_listener import HttpListener
from protocol.limits import ByteBudget

if TYPE_CHECKING:
    from epp.leader import LeaseElector

log = logging.getLogger("epp")
# Quiet endpoints (nothing running, waiting or in flight, and no request for that long) are scraped this many times
# less often until a request arrives (epp/datalayer/scraper.py): any traffic keeps the busy interval, so routing
# under load reads pages as fresh as before, and an idle EPP scrapes 5x less (`epp-bench idle`).
IDLE_INTERVAL_FACTOR = 5
# The metrics port's idle keep-alive connections are closed after this (aiohttp's default keeps them an hour): longer
# than Prometheus's usual scrape interval, so its connection is reused.
METRICS_KEEPALIVE_SECONDS = 75.0


def _kubernetes_api(kubeconfig: str | None):
    """The API client; ConfigError, in one line naming the fix, when there is no cluster configuration."""
    from kubernetes import client, config

    try:
        if kubeconfig:
            config.load_kube_config(config_file=kubeconfig)
        else:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
    except (config.ConfigException, OSError) as exc:
        where = f"--kubeconfig {kubeconfig}" if kubeconfig else "not in a cluster, and no ~/.kube/config"
        raise ConfigError(
            f"--pool-name needs a Kubernetes cluster: {where} ({exc}); give --kubeconfig FILE, or --pool-file for a "
            "static pool"
        ) from None
    configuration = client.Configuration.get_default_copy()
    configuration.retries = False  # our watchers back off and log an outage once; urllib3 would retry and warn
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
    return client.ApiClient(configuration)


def grpc_limits(max_connections: int) -> list[tuple[str, int]]:
    """grpcio's options that bound what peers make a gRPC port hold (the health port, and ext_proc with
    --ext-proc-transport grpcio), as the h2 transport bounds its own: by default grpcio takes any number of
    connections and waits 120 s for each handshake, and 3,000 connections to the health port that each sent a preface
    and 16 KB left the EPP's RSS 56 MB above idle after they closed (tests/integration/test_memory_after_flood.py).
    Beyond `max_connections` a new connection is closed."""
    return [("grpc.max_allowed_incoming_connections", max_connections), ("grpc.server_handshake_timeout_ms", 10_000)]


class EndpointPicker:
    """Built from the parsed command line (`epp.cli.build_parser`); raises ConfigError, PoolFileError for a bad
    config or pool file. `run(stop)` serves until `stop` is set, then stops every part."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        try:
            text = Path(args.config_file).read_text() if args.config_file else args.config_text
        except OSError as exc:
            raise ConfigError(f"cannot read --config-file {args.config_file}: {exc.strerror or exc}") from None
        config = load(text)
        self.scheduler = Scheduler.from_sections(config, allow_experimental_plugins=args.allow_experimental_plugins)
        if args.status_decisions:
            self.scheduler.decisions = DecisionLog(args.status_decisions, args.status_decisions_per_second)
        self.flow_config = FlowControlConfig.from_sections(config)
        self.pool_name = args.pool_name or Path(args.pool_file).stem
        self.source, initial, self.elector = self._pool_source()
        self.scraper = Scraper(
            args.refresh_metrics_interval,
            args.scrape_timeout,
            args.metrics_staleness_threshold,
            idle_interval=args.refresh_metrics_idle_interval or IDLE_INTERVAL_FACTOR * args.refresh_metrics_interval,
        )
        self.subscriber = self._kv_event_subscriber()
        sources = [self.scraper] if self.subscriber is None else [self.scraper, self.subscriber]
        self.datastore = Datastore(sources, self.scheduler.on_pool_changed)
        self.datastore.apply(initial)
        self.metrics = EPPMetrics(self.pool_name)
        self.flow_control = self._flow_control()
        self.tracing = (
            RequestTracing(OTLPExporter(args.otlp_traces_endpoint), args.trace_sampling_ratio)
            if args.otlp_traces_endpoint
            else None
        )
        self.director = Director(
            self.datastore, self.scheduler, self.metrics, self.flow_control, args.emit_endpoint_scores, self.tracing
        )
        self.replicas = self._replica_channel()
        self.body_budget = ByteBudget(args.max_buffered_body_bytes)
        self.server = self._ext_proc_server()
        self.health = HealthState()
        # kubelet's probes and the gateways that health-check the EPP, the ones that connect to ext_proc
        idle = ("grpc.max_connection_idle_ms", 75_000)
        self.health_server = grpc.aio.server(options=[*grpc_limits(args.max_ext_proc_connections), idle])
        health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, self.health_server)
        self._register_collectors()
        self.metrics_listener = HttpListener("the metrics port", "epp.metrics_port")
        self.metrics_runner = self._metrics_page()
        # Readiness: the pool is known (the pool file is read at start; Kubernetes: every resource listed once),
        # with leader election this replica serves, and it is not draining (stop). Recomputed whenever one changes.
        self.readiness = {"pool synced": bool(args.pool_file), "serving": self.elector is None, "not draining": True}
        self.tasks: list[asyncio.Task] = []

    def _pool_source(self) -> tuple[PoolSource, PoolState, LeaseElector | None]:
        """The pool's source, the pool as known before it runs, and the leader elector when there is one."""
        args = self.args
        if args.pool_file:
            source = PoolFileSource(args.pool_file)
            return source, source.initial(), None
        # the Kubernetes client is a third of the EPP's import time: only an EPP that reads its pool from a cluster
        # loads it
        from epp.datalayer.kubernetes import KubernetesSource
        from epp.leader import LeaseElector

        api = _kubernetes_api(args.kubeconfig)
        source = KubernetesSource(api, args.pool_name, args.pool_namespace, args.pool_group)
        elector = None
        if args.ha_enable_leader_election:
            identity = os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"
            elector = LeaseElector(api, f"{args.pool_name}-epp", args.pool_namespace, identity)
        return source, PoolState(), elector

    def _kv_event_subscriber(self) -> KVEventSubscriber | None:
        """The KV-event subscriber, when it is on (--kv-events-port) and a plugin of the profile reads the events."""
        args = self.args
        if not (args.kv_events_port and self.scheduler.requires_kv_events):
            return None
        index = KVBlockIndex(args.kv_index_max_entries)
        if args.kv_events_bind:
            subscriber = KVEventSubscriber(
                index,
                f"tcp://{args.bind_address.replace('0.0.0.0', '*')}:{args.kv_events_port}",
                replay_port_offset=args.kv_events_replay_port_offset,
            )
            where = f"bound on {subscriber.endpoint}; a sender must be at the address its topic names"
        else:
            subscriber = KVEventSubscriber(
                index,
                publisher_port=args.kv_events_port,
                connect_port_offset=args.kv_events_connect_port_offset,
                replay_port_offset=args.kv_events_replay_port_offset,
            )
            where = (
                f"subscribing to each endpoint's publisher at port {args.kv_events_port}"
                if args.kv_events_connect_port_offset is None
                else f"subscribing to each endpoint's publisher at its port {args.kv_events_connect_port_offset:+d}"
            )
        self.scheduler.use_kv_index(index)
        log.info("KV events: %s", where)
        return subscriber

    def _replica_channel(self) -> ReplicaChannel | None:
        """The channel to the peer replicas (--replica-peers), told of every change of the director's in-flight
        counts and of every pick the shared prefix index records."""
        args = self.args
        if not args.replica_peers:
            return None
        secret = None
        if args.replica_secret_file:
            try:
                secret = Path(args.replica_secret_file).read_bytes().strip()
            except OSError as exc:
                raise ConfigError(
                    f"cannot read --replica-secret-file {args.replica_secret_file}: {exc.strerror}"
                ) from None
            if not secret:
                raise ConfigError(f"--replica-secret-file {args.replica_secret_file} is empty")
        channel = ReplicaChannel(
            self.datastore,
            self.scheduler.shared_prefix_index,
            args.replica_port,
            args.replica_peers,
            args.bind_address,
            secret,
        )
        self.director.load_changed = channel.load_changed
        if args.replica_turns:
            channel.turns = True
            self.director.turn = channel.turn
        channel.release_prefilled = self.director.release_prefilled
        self.director.forward_record = channel.forward_record
        self.scheduler.use_replicas(channel.position)
        channel.match_record = self.director.match_record
        predictor = self.scheduler.latency_predictor
        if predictor is not None:
            predictor.observed = channel.observed
            channel.predictor = predictor
        if args.replica_share_pages:
            scraper = self.scraper
            scraper.peer_page, scraper.page_read, scraper.peers_busy = (
                channel.peer_page,
                channel.page_read,
                channel.peers_busy,
            )
            channel.apply_page = scraper.apply_page
        return channel

    def _flow_control(self) -> FlowController | None:
        if not self.flow_config.enabled:
            return None
        flow_control = FlowController(
            self.flow_config,
            self.scheduler.detector.room_in(self.datastore),
            observer=self.metrics.flow_control_outcome,
            poll_interval=self.args.refresh_metrics_interval,  # a scrape may have shown room
        )
        self.scraper.pending = lambda: flow_control.count  # a queued request waits for a page that shows room
        return flow_control

    def _ext_proc_server(self) -> ExtProcServer | grpc.aio.Server:
        """The ext_proc transport (--ext-proc-transport), serving the handlers and the access log's Export."""
        args = self.args
        director = self.director
        new_stream = stream_factory(director, self.body_budget, args.max_request_body_bytes)
        traced = self.tracing is not None

        export_access_log = accesslog.ExportHandler(director.on_access_log)
        if args.ext_proc_transport == "h2":
            export = UnaryMethod(accesslog.ExportRecords, export_access_log, accesslog.MAX_EXPORT_BYTES)
            return ExtProcServer(
                new_stream, {accesslog.EXPORT_PATH: export}, args.max_ext_proc_connections, ExtProcRequest, traced
            )
        server = grpc.aio.server(
            options=[("grpc.max_receive_message_length", 64 * 1024 * 1024), *grpc_limits(args.max_ext_proc_connections)]
        )
        server.add_generic_rpc_handlers(
            [ext_proc_service(new_stream, ExtProcRequest, traced), access_log_service(export_access_log)]
        )
        return server

    def _register_collectors(self) -> None:
        """Each part's metrics, in the page's order."""
        metrics = self.metrics
        metrics.register(PoolCollector(self.pool_name, self.datastore))
        metrics.register(self.scheduler)
        metrics.register(self.director.responses)
        metrics.register(
            FlowControlCollector(metrics, self.flow_control, self.datastore, self.scheduler.detector.saturation)
        )
        if self.subscriber is not None:
            metrics.register(self.subscriber)
        if self.replicas is not None:
            metrics.register(self.replicas)
        metrics.register(BufferedBodyCollector(self.body_budget))
        if isinstance(self.server, ExtProcServer):
            metrics.register(self.server)

    def _metrics_page(self) -> web.AppRunner:
        page = MetricsPage(self.metrics.registry)

        async def metrics_handler(request: web.Request) -> web.Response:
            return web.Response(body=await page.get(), headers={"Content-Type": CONTENT_TYPE_LATEST})

        app = web.Application(middlewares=[self.metrics_listener.middleware])
        app.router.add_get("/metrics", metrics_handler)
        status = StatusPage(self.pool_name, self.datastore, self.scheduler, self.flow_control, self.scheduler.decisions)
        status.add_routes(app)
        return web.AppRunner(app, access_log=None, keepalive_timeout=METRICS_KEEPALIVE_SECONDS)

    async def _report_health(self) -> None:
        await self.health.set(live=True, ready=all(self.readiness.values()))

    def _on_pool(self, state: PoolState) -> None:
        self.datastore.apply(state)
        if not self.readiness["pool synced"]:
            self.readiness["pool synced"] = True
            log.info("pool %s synced: %d endpoints", self.pool_name, len(state.endpoints))
            asyncio.get_running_loop().create_task(self._report_health())

    def _on_serving(self, serving: bool):
        self.readiness["serving"] = serving
        return self._report_health()

    async def start(self) -> None:
        """Watch the pool, open the three servers, report health, run for leadership. The three servers' ports are
        bound here, not when the application is built, so that building one (a test, a config check) holds none."""
        args = self.args
        self.tasks.append(asyncio.create_task(self.source.run(self._on_pool)))
        if isinstance(self.server, ExtProcServer):
            await self.server.start(args.bind_address, args.grpc_port)
        else:
            self.server.add_insecure_port(f"{args.bind_address}:{args.grpc_port}")
            await self.server.start()
        self.health_server.add_insecure_port(f"{args.bind_address}:{args.grpc_health_port}")
        await self.health_server.start()
        if self.replicas is not None:
            await self.replicas.start()
        await self.metrics_runner.setup()
        await self.metrics_listener.start(self.metrics_runner.server, args.bind_address, args.metrics_port)
        await self._report_health()
        if self.elector is not None:
            self.elector.on_change = self._on_serving
            self.tasks.append(asyncio.create_task(self.elector.run()))
        log.info(
            "epp ready: ext_proc %s:%d, health %d, metrics %d, %d endpoints",
            args.bind_address,
            args.grpc_port,
            args.grpc_health_port,
            args.metrics_port,
            len(self.datastore.endpoints),
        )
        print(f"epp ready on {args.bind_address}:{args.grpc_port}", flush=True)

    async def stop(self) -> None:
        """Drain, then stop every part, whatever start reached. The drain (--drain-timeout): not ready (the gateway's
        health checks and Kubernetes' readiness probe stop sending streams here), the Lease given up so that a
        standby takes over, and the ext_proc transport's streams in flight finished while the gateway opens new
        ones on another replica (GOAWAY); the scrapes and the in-flight accounting keep running for them."""
        self.readiness["not draining"] = False
        await self._report_health()
        for task in self.tasks:
            task.cancel()
        # Awaited here, not left to asyncio.run's last cancellation (which would cut the elector's release short).
        await asyncio.gather(*self.tasks, return_exceptions=True)
        log.info("draining: new ext_proc streams go elsewhere, those in flight have up to %gs", self.args.drain_timeout)
        await self.server.stop(grace=self.args.drain_timeout)
        await self.health.set(live=False, ready=False)
        await self.health_server.stop(grace=None)
        if self.replicas is not None:
            await self.replicas.stop()
        self.metrics_listener.close()
        await self.metrics_runner.cleanup()
        await self.datastore.close()
        await self.director.responses.close()
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.exporter.close)  # the last spans go out

    async def run(self, stop: asyncio.Event) -> None:
        """Start, serve until `stop` is set, stop."""
        try:
            await self.start()
            # What start-up built (modules, protobuf descriptors, the scheduler and its plugins) lives as long as
            # the process: frozen, a full collection no longer walks it. Unfrozen, each took 42-48 ms, a stall of
            # every request on the loop (epp-bench chaos, model-name flood: worst well-behaved latency 32-60 ms);
            # frozen 0.6 ms.
            gc.collect()
            gc.freeze()
            await stop.wait()
        finally:
            await self.stop()
