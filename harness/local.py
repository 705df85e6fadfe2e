"""`epp-local`: the whole stack on loopback — N model servers, the EPP and a real Envoy — supervised together.

epp-local --model-servers 4            # prints the gateway URL; Ctrl-C stops everything
epp-local --model-servers 4 --demo     # + a mixed workload through the gateway and a live table
epp-local --model-server-url http://127.0.0.1:8000 --model-server-url http://127.0.0.1:8001 --table
                                       # the EPP and Envoy in front of model servers you already run
epp-local --print-envoy-config         # the Envoy bootstrap it runs (python -m harness.envoy: Kubernetes')
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families

from epp.config import ConfigError
from epp.config.loader import load as load_config
from epp.datalayer.pool_file import PoolFileError, load_pool_file
from epp.flowcontrol import FlowControlConfig
from epp.scheduling.scheduler import Scheduler
from harness.bench.ports import free_port_block, free_ports
from harness.conformance.msp import NotAModelServer, base_url, default_model
from harness.envoy import EnvoyProcess, render_bootstrap, terminate
from protocol import extproc
from protocol.cli import Parser, command_parser, positive_int
from protocol.kv_events import DEFAULT_SUBSCRIBER_PORT
from protocol.metrics import DEFAULT_ENGINE

DEMO_ADAPTERS = ("sql-lora", "chat-lora")
ALLOW_EXPERIMENTAL_PLUGINS = "--allow-experimental-plugins"  # the EPP's flag for plugins of the Alpha level
# the file in the stack's workdir Envoy writes each request's own timings to (StackConfig.gateway_timings)
GATEWAY_TIMINGS = "gateway-timings.log"
# an EPP's turns to pick by outcome, since it started (epp/replicas.py TURN_OUTCOMES), on its /metrics page
REPLICA_TURNS = re.compile(r'^inference_extension_replica_turns_total\{outcome="(\w+)"\} (\S+)$', re.M)


@dataclass
class StackConfig:
    model_servers: int = 4
    backend: str = "sim"
    host: str = "127.0.0.1"
    base_port: int = extproc.MODEL_SERVER_PORT
    grpc_port: int = extproc.EPP_GRPC_PORT
    grpc_health_port: int = extproc.EPP_GRPC_HEALTH_PORT
    metrics_port: int = extproc.EPP_METRICS_PORT
    listener_port: int = extproc.ENVOY_LISTENER_PORT
    admin_port: int = extproc.ENVOY_ADMIN_PORT
    fail_open: bool = False
    message_timeout: float = 10.0  # Envoy's ext_proc message_timeout (the EPP extends it for queued requests)
    request_body_mode: str | None = None  # FULL_DUPLEX_STREAMED, or BUFFERED with FailOpen
    response_body_mode: str = "NONE"
    observed_responses_percent: int = 100  # of the requests, with FULL_DUPLEX_STREAMED (harness.envoy.render_bootstrap)
    access_log_percent: int = 100  # of the requests whose access-log record goes to the EPP (render_bootstrap)
    separate_model_server_processes: bool = False  # one process per model server (so one can be killed)
    model: str = "sim-llama-8b"
    # A pool file of model servers already running (vLLM, SGLang, ours): the stack starts none and its EPP reads this
    # file (edits reach it while it runs); None: the stack starts `model_servers` of its own
    model_server_pool: Path | None = None
    config_file: str | None = None
    config_text: str | None = None
    pool_extra: dict = field(default_factory=dict)  # more pool-file keys: objectives, models, rewrites
    modelserver_args: list[str] = field(default_factory=list)
    epp_args: list[str] = field(default_factory=list)
    # more environment for the EPP (another checkout's PYTHONPATH: harness.bench.overhead.build_environment)
    epp_env: dict[str, str] = field(default_factory=dict)
    workdir: Path | None = None
    # KV events: every model server binds its publisher (at its port + publisher_port_offset, a free block; vLLM
    # --kv-events-config tcp://*:PORT) and every EPP subscribes to each (epp --kv-events-connect-port-offset);
    # None: on; 0: no events (the approximate index only)
    kv_events_port: int | None = None
    hash_seed: str = "0"  # PYTHONHASHSEED of the servers and the EPP: vLLM's block hashes are seeded by it
    # Active-active: this many EPPs behind Envoy (round robin), each subscribed to every server's publisher, and
    # with replica_sharing each telling the others its in-flight load and prefix-index learning (epp --replica-peers)
    epp_replicas: int = 1
    replica_sharing: bool = True
    replica_turns: bool = True  # sharing replicas pick in turns (epp --replica-turns)
    # With epp_replicas above 1: Envoy routes to the first replica only; the others are shadows that run as replicas do
    # (scrapes, KV-event subscriptions, the replica channel) and get no request: what N replicas cost the machine
    # beyond their requests (epp-bench compare --replica-routing first)
    epp_shadows: bool = False
    # An OpenTelemetry collector (OTLP/gRPC "host:port") Envoy exports its request traces to (harness.envoy); the EPP
    # and the model servers trace when their own --otlp-traces-endpoint flag is among epp_args / modelserver_args
    otlp_traces_endpoint: str | None = None
    # Envoy writes each request's own timings to workdir/GATEWAY_TIMINGS (harness.envoy.TIMINGS_FORMAT)
    gateway_timings: bool = False

    @classmethod
    def on_free_ports(cls, model_servers: int = 4, base_port: int | None = None, **settings) -> StackConfig:
        """A stack on free loopback ports (its model servers' a block of consecutive ones, or from `base_port`: those
        of a stack already running), beside whatever else runs: as the benchmarks and the tests start theirs."""
        if base_port is None:
            base_port = free_port_block(model_servers) if model_servers else extproc.MODEL_SERVER_PORT
        grpc, health, metrics, listener, admin = free_ports(5)
        return cls(
            model_servers=model_servers,
            base_port=base_port,
            grpc_port=grpc,
            grpc_health_port=health,
            metrics_port=metrics,
            listener_port=listener,
            admin_port=admin,
            **settings,
        )


def python_module(module: str) -> list[str]:
    """The start of a command line that runs `module` of this interpreter's environment: `-P` keeps the working
    directory off the module path, so that the process runs the code this harness imports, not a checkout that
    happens to be the directory it was started from (PYTHONPATH pointing at another checkout measured the
    directory's code: docs/2026-11-30-replicas-notebook.md, "Bursts on three replicas: 17 rounds of main, and two
    tries")."""
    return [sys.executable, "-P", "-m", module]


def epp_command(
    pool_file: str, host: str, grpc: int, health: int, metrics: int, kv_events_port: int, extra: Sequence[str] = ()
) -> list[str]:
    """The command line of an EPP on a pool file (the local stack's and the benchmarks')."""
    return [
        *python_module("epp"),
        "--pool-file",
        pool_file,
        "--bind-address",
        host,
        "--grpc-port",
        str(grpc),
        "--grpc-health-port",
        str(health),
        "--metrics-port",
        str(metrics),
        "--kv-events-port",
        str(kv_events_port),
        *extra,
    ]


def last_line(log: Path) -> str:
    """The last line of a process's log that says something (its error, when it exited on one)."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return next((line.strip() for line in reversed(lines) if line.strip()), "(its log is empty)")


def wait_until_serving(process: subprocess.Popen, url: str, log: Path, timeout: float = 60.0) -> None:
    """Until the process (an EPP: its metrics page) answers a GET of `url`; RuntimeError naming its log if it exits or
    times out first."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).read()
            return
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"no answer from {url}: see {log}") from None
            time.sleep(0.1)


class LocalStack:
    """Starts and stops the three kinds of processes; usable from tests (with free ports) and the CLI."""

    def __init__(self, config: StackConfig):
        self.config = config
        self._tmp = None
        if config.workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="epp-local-")
            config.workdir = Path(self._tmp.name)
        self.workdir = config.workdir
        # the running servers' pool, when the stack starts none of its own
        self.external = load_pool_file(config.model_server_pool) if config.model_server_pool is not None else None
        # (grpc, health, metrics) of each EPP replica; the first are the config's
        self.epp_ports = [(config.grpc_port, config.grpc_health_port, config.metrics_port)]
        self.replica_ports: list[int] = []  # each replica's UDP port for the replica channel, when they share
        self.publisher_port_offset: int | None = None
        self.replay_port_offset: int | None = None  # each server's replay socket (a late EPP catches up from it)
        if config.kv_events_port is None:
            config.kv_events_port = DEFAULT_SUBSCRIBER_PORT
        if config.epp_replicas > 1:
            taken = set(self.ports())
            more = [p for p in free_ports(len(taken) + 3 * (config.epp_replicas - 1)) if p not in taken]
            self.epp_ports += [tuple(more[i : i + 3]) for i in range(0, 3 * (config.epp_replicas - 1), 3)]
        if config.epp_replicas > 1 and config.replica_sharing:
            taken = set(self.ports())
            self.replica_ports = [p for p in free_ports(len(taken) + config.epp_replicas) if p not in taken][
                : config.epp_replicas
            ]
        if config.kv_events_port and self.external is None:  # servers it did not start publish where they do
            self.publisher_port_offset = self._free_block_offset()
            self.replay_port_offset = self._free_block_offset()
        self.processes: dict[str, subprocess.Popen] = {}
        self._started: dict[str, tuple[list[str], dict[str, str] | None]] = {}  # name -> (argv, env): restart
        self.envoy: EnvoyProcess | None = None

    def _free_block_offset(self) -> int:
        """The offset from the servers' ports of a block of free ports, one per server, clear of the stack's."""
        taken, count = set(self.ports()), self.config.model_servers
        while True:
            base = free_port_block(count)
            if not taken & set(range(base, base + count)):
                return base - self.config.base_port

    @property
    def model_server_urls(self) -> list[str]:
        c = self.config
        if self.external is not None:
            return [f"http://{e.hostport}" for e in self.external.endpoints]
        return [f"http://{c.host}:{c.base_port + i}" for i in range(c.model_servers)]

    @property
    def model_server_engines(self) -> list[str]:
        """The engine of each of `model_server_urls` (which metric names it publishes)."""
        if self.external is not None:
            return [e.engine for e in self.external.endpoints]
        return [DEFAULT_ENGINE] * self.config.model_servers

    @property
    def gateway_url(self) -> str:
        return f"http://{self.config.host}:{self.config.listener_port}"

    @property
    def epp_metrics_url(self) -> str:
        return f"http://{self.config.host}:{self.config.metrics_port}/metrics"

    @property
    def epp_names(self) -> list[str]:
        return ["epp"] + [f"epp-{i}" for i in range(1, len(self.epp_ports))]

    @property
    def epp_metrics_urls(self) -> list[str]:
        return [f"http://{self.config.host}:{metrics}/metrics" for _, _, metrics in self.epp_ports]

    def restart(self, name: str) -> subprocess.Popen:
        """Start process `name` again as it was first started (after it died or was killed)."""
        return self._spawn(name, *self._started[name])

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        self._started[name] = (argv, env)
        log = (self.workdir / f"{name}.log").open("ab")
        process = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONHASHSEED": self.config.hash_seed, **(env or {})},
        )
        log.close()
        self.processes[name] = process
        return process

    def start_model_servers(self) -> None:
        c = self.config
        if self.external is not None:
            return
        groups = (
            [(f"modelserver-{i}", c.base_port + i, 1) for i in range(c.model_servers)]
            if c.separate_model_server_processes
            else [("modelserver", c.base_port, c.model_servers)]
        )
        for name, port, replicas in groups:
            argv = [
                *python_module("modelserver"),
                "--backend",
                c.backend,
                "--model",
                c.model,
                "--host",
                c.host,
                "--port",
                str(port),
                "--replicas",
                str(replicas),
                *self.kv_events_args(port),
                *c.modelserver_args,
            ]
            self._spawn(name, argv)

    def kv_events_args(self, port: int) -> list[str]:
        """The --kv-events-config of the model servers from `port` on: bind a publisher at port +
        publisher_port_offset (each replica of a process at its own port + the offset; vLLM binds only an endpoint
        with '*'), and a replay socket; nothing when the caller configures it or events are off."""
        c = self.config
        if not c.kv_events_port or "--kv-events-config" in c.modelserver_args:
            return []
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{port + self.publisher_port_offset}",
            "replay_endpoint": f"tcp://*:{port + self.replay_port_offset}",
        }
        return ["--kv-events-config", json.dumps(config)]

    def write_pool_file(self) -> Path:
        c = self.config
        if c.model_server_pool is not None:
            return c.model_server_pool
        path = self.workdir / "pool.yaml"
        endpoints = [{"name": f"ms-{i}", "address": c.host, "port": c.base_port + i} for i in range(c.model_servers)]
        path.write_text(yaml.safe_dump({"endpoints": endpoints, **c.pool_extra}))
        return path

    def start_epp(self) -> None:
        c = self.config
        pool_file = str(self.write_pool_file())
        for index, (name, (grpc, health, metrics)) in enumerate(zip(self.epp_names, self.epp_ports, strict=True)):
            argv = epp_command(pool_file, c.host, grpc, health, metrics, c.kv_events_port or 0, c.epp_args)
            if self.publisher_port_offset is not None:
                argv += ["--kv-events-connect-port-offset", str(self.publisher_port_offset)]
            if self.replay_port_offset is not None:
                argv += ["--kv-events-replay-port-offset", str(self.replay_port_offset)]
            if self.replica_ports:
                peers = ",".join(f"{c.host}:{port}" for port in self.replica_ports)
                argv += ["--replica-port", str(self.replica_ports[index]), "--replica-peers", peers]
                if not c.replica_turns:
                    argv.append("--no-replica-turns")
            if c.config_file:
                argv += ["--config-file", c.config_file]
            if c.config_text:
                argv += ["--config-text", c.config_text]
            self._spawn(name, argv, c.epp_env)

    def envoy_bootstrap(self) -> str:
        """The bootstrap of the stack's Envoy (`epp-local --print-envoy-config` prints it)."""
        c = self.config
        routed = self.epp_ports[:1] if c.epp_shadows else self.epp_ports
        return render_bootstrap(
            epp_host=c.host,
            epp_port=c.grpc_port,
            listener_port=c.listener_port,
            admin_port=c.admin_port,
            fail_open=c.fail_open,
            bind_address=c.host,
            request_body_mode=c.request_body_mode,
            response_body_mode=c.response_body_mode,
            observed_responses_percent=c.observed_responses_percent,
            access_log_percent=c.access_log_percent,
            message_timeout=c.message_timeout,
            fallback_endpoints=[u.removeprefix("http://") for u in self.model_server_urls],
            more_epp_endpoints=[f"{c.host}:{grpc}" for grpc, _, _ in routed[1:]],
            epp_health_ports=[health for _, health, _ in routed],
            otlp_traces_endpoint=c.otlp_traces_endpoint,
            records_forwarded=c.replica_sharing,
            timings_log=self.workdir / GATEWAY_TIMINGS if c.gateway_timings else None,
        )

    def start_envoy(self) -> None:
        path = self.workdir / "envoy.yaml"
        path.write_text(self.envoy_bootstrap())
        self.envoy = EnvoyProcess(path, self.config.admin_port, self.workdir / "envoy.log")
        self.envoy.start()

    def _server_names(self) -> list[str]:
        c = self.config
        if c.separate_model_server_processes:
            return [f"modelserver-{i}" for i in range(c.model_servers)]
        return ["modelserver"] * c.model_servers

    async def _wait_http(self, name: str, url: str, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            while True:
                process = self.processes.get(name)
                if process is not None and process.poll() is not None:
                    log = self.workdir / f"{name}.log"
                    raise RuntimeError(f"{name} exited with code {process.returncode}: {last_line(log)} (log: {log})")
                with contextlib.suppress(aiohttp.ClientError, OSError, asyncio.TimeoutError):
                    async with session.get(url) as response:
                        if response.status == 200:
                            return
                if loop.time() > deadline:
                    raise TimeoutError(f"{name} not ready at {url} after {timeout}s; see {self.workdir / name}.log")
                await asyncio.sleep(0.1)

    def ports(self) -> dict[int, str]:
        """Every port the stack listens on, and what listens there."""
        c = self.config
        own_servers = range(c.model_servers if self.external is None else 0)
        named = {c.base_port + i: f"model server {i}" for i in own_servers}
        named.update(
            {
                c.grpc_port: "EPP ext_proc (--grpc-port)",
                c.grpc_health_port: "EPP health (--grpc-health-port)",
                c.metrics_port: "EPP metrics (--metrics-port)",
                c.listener_port: "Envoy (--listener-port)",
                c.admin_port: "Envoy admin (--admin-port)",
            }
        )
        for i, ports in enumerate(self.epp_ports[1:], 1):
            named.update(dict(zip(ports, (f"EPP {i} ext_proc", f"EPP {i} health", f"EPP {i} metrics"), strict=True)))
        for i, port in enumerate(self.replica_ports):
            named[port] = f"EPP {i} replica channel (UDP)"
        if self.publisher_port_offset is not None:
            for i in own_servers:
                named[c.base_port + i + self.publisher_port_offset] = f"model server {i} KV events"
        if self.replay_port_offset is not None:
            for i in own_servers:
                named[c.base_port + i + self.replay_port_offset] = f"model server {i} KV event replay"
        return named

    def check_ports_free(self) -> None:
        """Fail before starting anything when another process holds one of our ports (it would answer instead).
        Probed as the servers bind (SO_REUSEADDR): a connection in TIME_WAIT on a port does not keep them out."""
        for port, what in self.ports().items():
            with socket.socket() as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    probe.bind((self.config.host, port))
                except OSError:
                    raise RuntimeError(
                        f"port {port} ({what}) on {self.config.host} is in use by another process; stop it or choose "
                        "other ports (--base-port, --grpc-port, ...)"
                    ) from None

    def exited_child(self) -> str | None:
        """A description of a child that exited on its own (name, code, last log lines); None while all run."""
        children = [(name, p) for name, p in self.processes.items()]
        if self.envoy is not None and self.envoy.process is not None:
            children.append(("envoy", self.envoy.process))
        for name, process in children:
            if process.poll() is not None:
                log = self.workdir / f"{name}.log"
                tail = log.read_text(errors="replace").splitlines()[-15:] if log.exists() else []
                return f"{name} exited with code {process.returncode}; last lines of {log}:\n" + "\n".join(tail)
        return None

    async def start(self, timeout: float = 60.0) -> None:
        self.check_ports_free()
        try:
            self.start_model_servers()
            self.start_epp()
            self.start_envoy()
            own_servers = (
                zip(self._server_names(), self.model_server_urls, strict=True) if self.external is None else ()
            )
            await asyncio.gather(
                *(self._wait_http(n, f"{u}/health", timeout) for n, u in own_servers),
                *(self._wait_http(n, u, timeout) for n, u in zip(self.epp_names, self.epp_metrics_urls, strict=True)),
                self.envoy.wait_ready(timeout),
            )
        except BaseException:
            self.stop()
            raise

    def stop_process(self, name: str, timeout: float = 10.0) -> None:
        terminate(self.processes.pop(name, None), timeout)

    def stop(self) -> None:
        """In the reverse of the start order: each process goes before the servers it is a client of (Envoy, then
        the EPP whose scrapers keep connections to the model servers, then the model servers), so the clients close
        their connections first and TIME_WAIT stays on their ephemeral ports. A model server that closes a scraper's
        kept-alive connection itself leaves its own port in TIME_WAIT."""
        if self.envoy is not None:
            self.envoy.stop()
        for name in reversed(list(self.processes)):
            self.stop_process(name)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def _percent(text: str, lowest: int) -> int:
    value = int(text) if text.strip().isdecimal() else -1
    if not lowest <= value <= 100:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole percentage within {lowest}..100")
    return value


def build_parser() -> Parser:
    p = command_parser("epp-local", __doc__)
    own = p.add_argument_group("the model servers epp-local starts (unless you give yours, below)")
    own.add_argument("--model-servers", type=positive_int, default=4, help="how many")
    own.add_argument(
        "--backend", choices=["sim", "torch"], default="sim", help="sim: no GPU, no weights; torch: a real model"
    )
    own.add_argument("--base-port", type=int, default=extproc.MODEL_SERVER_PORT, help="the first one's port")
    yours = p.add_argument_group("model servers you already run (vLLM, SGLang, `modelserver`): epp-local starts none")
    where = yours.add_mutually_exclusive_group()
    where.add_argument(
        "--model-server-url",
        action="append",
        default=[],
        metavar="URL",
        help="a model server's base URL, e.g. http://127.0.0.1:8000 (repeat for each)",
    )
    where.add_argument(
        "--pool-file",
        type=Path,
        help="a pool file listing them (the EPP's format: epp/datalayer/pool_file.py); edits reach the EPP live",
    )
    p.add_argument(
        "--model",
        default=None,
        help="model name (sim) or directory (torch; default: a tiny model); with your own servers, the model the "
        "demo requests (default: the first that the first server lists)",
    )
    p.add_argument("--grpc-port", type=int, default=extproc.EPP_GRPC_PORT, help="the EPP's ext_proc port")
    p.add_argument("--grpc-health-port", type=int, default=extproc.EPP_GRPC_HEALTH_PORT, help="the EPP's health port")
    p.add_argument("--metrics-port", type=int, default=extproc.EPP_METRICS_PORT, help="the EPP's /metrics port")
    p.add_argument("--listener-port", type=int, default=extproc.ENVOY_LISTENER_PORT, help="the gateway's port")
    p.add_argument("--admin-port", type=int, default=extproc.ENVOY_ADMIN_PORT, help="Envoy's admin port")
    p.add_argument(
        "--kv-events-port",
        type=int,
        default=DEFAULT_SUBSCRIBER_PORT,
        help="0: no KV events; else each model server binds a KV-event publisher (at a free port beside its own) "
        "and the EPP subscribes to each",
    )
    p.add_argument(
        "--epp-replicas",
        type=int,
        default=1,
        help="EPP replicas, all active, behind Envoy (round robin); the first on the ports above, the others on free\n"
        "ports; each subscribes to every server's KV events and tells the others its in-flight load and what its\n"
        "prefix index learnt (epp --replica-peers, docs/replicas.md)",
    )
    p.add_argument(
        "--no-replica-sharing",
        action="store_true",
        help="with --epp-replicas: each replica counts only its own in-flight load (the comparison sharing is for)",
    )
    p.add_argument("--fail-open", action="store_true", help="Envoy keeps serving (round robin) when the EPP is down")
    p.add_argument("--config-file", help="EndpointPickerConfig YAML for the EPP (default: its built-in profile)")
    p.add_argument(
        "--allow-experimental-plugins",
        action="store_true",
        help="the EPP's flag: let the config use plugins of the Alpha stability level (docs/plugins.md)",
    )
    p.add_argument(
        "--response-body-mode",
        choices=["NONE", "FULL_DUPLEX_STREAMED"],
        default="NONE",
        help="Envoy sends response bodies through the EPP (FULL_DUPLEX_STREAMED): what predicted-latency-scorer "
        "learns from (each streamed token costs an ext_proc round trip)",
    )
    p.add_argument(
        "--observed-responses-percent",
        type=functools.partial(_percent, lowest=1),
        default=100,
        help="with --response-body-mode FULL_DUPLEX_STREAMED: the share of requests (1-100) whose response bodies "
        "go through the EPP; the others bypass it",
    )
    p.add_argument(
        "--access-log-percent",
        type=functools.partial(_percent, lowest=0),
        default=100,
        help="the share of requests (0-100) whose access-log record Envoy sends to the EPP: what the latency "
        "predictor learns TTFT from without the response bodies (0: none; then it learns from bodies only)",
    )
    p.add_argument("--demo", action="store_true", help="send a mixed workload and show a live table")
    p.add_argument("--once", action="store_true", help="with --demo: exit after the workload")
    p.add_argument("--requests", type=positive_int, default=64, help="with --demo: how many requests")
    p.add_argument("--table", action="store_true", help="show the live table of the model servers (no workload)")
    p.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="keep the processes' logs here (default: a new temporary folder, removed on exit unless something failed)",
    )
    p.add_argument(
        "--print-envoy-config", action="store_true", help="print the Envoy bootstrap epp-local runs, and exit"
    )
    p.needs("--once", "--demo", lambda a: a.demo)
    p.needs("--no-replica-sharing", "--epp-replicas 2 or more", lambda a: a.epp_replicas > 1)
    p.needs("--requests", "--demo", lambda a: a.demo)
    p.needs("--table", "no --demo (the demo shows the table)", lambda a: not a.demo)
    p.needs(
        "--observed-responses-percent",
        "--response-body-mode FULL_DUPLEX_STREAMED",
        lambda a: a.response_body_mode == "FULL_DUPLEX_STREAMED",
    )
    yours_given = "epp-local's own model servers (leave out --model-server-url and --pool-file)"
    for flag in ("--model-servers", "--backend", "--base-port"):
        p.needs(flag, yours_given, lambda a: not (a.model_server_url or a.pool_file))
    return p


def servers_pool(urls: list[str]) -> dict:
    """A pool file's content for model servers given by URL; ValueError naming a URL that is not http://HOST:PORT."""
    endpoints = []
    for url in urls:
        try:
            parsed = urllib.parse.urlsplit(base_url(url))
        except NotAModelServer as error:
            raise ValueError(f"--model-server-url: {error}") from None
        if parsed.scheme != "http" or parsed.path not in ("", "/"):
            raise ValueError(
                f"--model-server-url {url}: give http://HOST:PORT (Envoy forwards plain HTTP, with the request's path)"
            )
        endpoints.append({"address": parsed.hostname, "port": parsed.port or 80})
    return {"endpoints": endpoints}


def stack_config(args: argparse.Namespace, workdir: Path) -> StackConfig:
    """The stack the command line describes (the model to serve is settled by `run`)."""
    pool = args.pool_file
    if args.model_server_url:
        pool = workdir / "servers.yaml"
        pool.write_text(yaml.safe_dump(servers_pool(args.model_server_url)))
    return StackConfig(
        model_servers=args.model_servers,
        backend=args.backend,
        base_port=args.base_port,
        grpc_port=args.grpc_port,
        grpc_health_port=args.grpc_health_port,
        metrics_port=args.metrics_port,
        listener_port=args.listener_port,
        admin_port=args.admin_port,
        kv_events_port=args.kv_events_port,
        epp_replicas=args.epp_replicas,
        replica_sharing=not args.no_replica_sharing,
        fail_open=args.fail_open,
        response_body_mode=args.response_body_mode,
        observed_responses_percent=args.observed_responses_percent,
        access_log_percent=args.access_log_percent,
        model_server_pool=pool.resolve() if pool is not None else None,
        config_file=args.config_file,
        epp_args=[ALLOW_EXPERIMENTAL_PLUGINS] if args.allow_experimental_plugins else [],
        workdir=workdir,
    )


def own_servers_setup(args: argparse.Namespace, config: StackConfig) -> str | None:
    """Settle the model and the adapters of the servers epp-local starts; an error message when it cannot."""
    workdir = config.workdir
    model = args.model or ("sim-llama-8b" if args.backend == "sim" else None)
    adapters = list(DEMO_ADAPTERS)
    if args.backend == "torch" and model is None:
        from modelserver.torch.tiny import make_tiny_model

        model = str(workdir / "tiny-model")
        make_tiny_model(model, lora_names=DEMO_ADAPTERS)
    if args.backend == "torch":  # real adapter files: the tiny model's, or DIR/loras/<name> of the user's model
        adapters = [a for a in DEMO_ADAPTERS if (Path(model) / "loras" / a / "adapter_config.json").is_file()]
        if args.demo and len(adapters) < len(DEMO_ADAPTERS):
            return (
                f"the demo sends LoRA requests and needs PEFT adapters {', '.join(DEMO_ADAPTERS)} in "
                f"{Path(model) / 'loras'} (`modelserver make-tiny-model DIR --lora sql-lora --lora chat-lora` makes "
                "a tiny model with them); without --demo the stack runs without adapters"
            )
    adapter_dir = Path(model) / "loras" if args.backend == "torch" else workdir
    config.model = model
    config.modelserver_args = ["--enable-lora", "--max-loras", "2", "--num-gpu-blocks", "4096"]
    if adapters:
        config.modelserver_args += ["--lora-modules", *(f"{a}={adapter_dir / a}" for a in adapters)]
    # the pool declares what its servers serve: the EPP's metrics count every request under its model's own name
    # from the first one (an undeclared name is `other` until a server has answered it), and other names get 404
    config.pool_extra = {"models": [model, *adapters]}
    return None


async def your_servers_model(args: argparse.Namespace, stack: LocalStack) -> str:
    """The model the demo requests from servers epp-local did not start: --model, or the first one the first
    server that answers lists. A warning line for each server that does not answer as a model server;
    NotAModelServer when none does."""
    async with aiohttp.ClientSession() as session:
        answers = await asyncio.gather(
            *(default_model(session, url) for url in stack.model_server_urls), return_exceptions=True
        )
    models = []
    for answer in answers:
        if isinstance(answer, NotAModelServer):
            say(f"epp-local: warning: {answer}; the EPP routes to it once it serves its metrics", sys.stderr)
        elif isinstance(answer, BaseException):
            raise answer
        else:
            models.append(answer)
    if not models:
        raise NotAModelServer(str(answers[0]) if len(answers) == 1 else f"none of the {len(answers)} servers answers")
    return args.model or models[0]


async def ready_endpoints(stack: LocalStack, wait: float = 3.0) -> int:
    """How many of the pool's endpoints the EPP reads metrics from (its inference_pool_ready_pods), once all are or
    `wait` seconds have passed."""
    deadline = time.monotonic() + wait
    ready = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while True:
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                async with session.get(stack.epp_metrics_url) as response:
                    page = await response.text()
                for family in text_string_to_metric_families(page):
                    if family.name == "inference_pool_ready_pods":
                        ready = int(sum(sample.value for sample in family.samples))
            if ready >= len(stack.model_server_urls) or time.monotonic() > deadline:
                return ready
            await asyncio.sleep(0.2)


async def run(args: argparse.Namespace, stop: asyncio.Event, workdir: Path) -> int:
    config = stack_config(args, workdir)
    stack = LocalStack(config)
    if stack.external is None:
        error = own_servers_setup(args, config)
        if error:
            say(f"epp-local: {error}", sys.stderr)
            return 2
        model = config.model
        adapters = DEMO_ADAPTERS if args.backend == "sim" else tuple(config.pool_extra["models"][1:])
        what = f"{args.model_servers} {args.backend} model servers, the EPP and Envoy"
    else:
        if not stack.external.endpoints:
            say(f"epp-local: the pool file {config.model_server_pool} lists no endpoints", sys.stderr)
            return 2
        try:
            model = await your_servers_model(args, stack)
        except NotAModelServer as error:
            say(f"epp-local: {error}", sys.stderr)
            return 2
        adapters = ()
        what = f"the EPP and Envoy in front of {len(stack.model_server_urls)} model servers"
    say(f"starting {what} (logs in {workdir}) ...")
    try:
        stack.check_ports_free()
    except RuntimeError as error:
        say(f"epp-local: {error}", sys.stderr)
        return 2
    try:
        await stack.start()
    except (RuntimeError, TimeoutError) as error:
        say(f"epp-local: {error}", sys.stderr)
        return 1
    failed: list[str] = []

    async def watch_children() -> None:
        while not stop.is_set():
            exited = stack.exited_child()
            if exited is not None:
                failed.append(exited)
                stop.set()
                return
            await asyncio.sleep(0.5)

    watcher = asyncio.create_task(watch_children())
    try:
        # "ready" only once the EPP has read the servers' metrics: it routes to no endpoint before (503)
        ready, total = await ready_endpoints(stack), len(stack.model_server_urls)
        listed = f"adapters {', '.join(adapters)}" if adapters else "no adapters"
        say(f"gateway ready: {stack.gateway_url}/v1  (OpenAI API; model {model!r}, {listed})")
        status_page = stack.epp_metrics_url.removesuffix("metrics")
        say(f"EPP status page: {status_page}  (every endpoint, flow control, the last decisions and why)")
        say(f"EPP metrics: {stack.epp_metrics_url}   Envoy admin: http://127.0.0.1:{args.admin_port}")
        if stack.external is not None:
            note = "" if ready == total else f"; the others are not routed to (why: the WARNINGs in {workdir}/epp.log)"
            say(f"the EPP reads the metrics of {ready} of the {total} model servers{note}")
        if args.demo or args.table:
            from harness.demo import run_demo

            try:
                total = args.requests if args.demo else 0
                ok = await run_demo(stack, model, adapters, total, stop, once=args.once)
            except BrokenPipeError:  # the terminal or pipe went away: stop like Ctrl-C
                say("")
                return 0
            if args.once and not failed:
                return 0 if ok else 1
        else:
            say("Ctrl-C (or closing the terminal) stops everything.")
        await stop.wait()
        if failed:
            say(f"epp-local: {failed[0]}", sys.stderr)
            return 1
        return 0
    finally:
        watcher.cancel()
        say("stopping ...")
        stack.stop()


def say(text: str, stream=None) -> None:
    """print, except that a closed terminal or pipe (SIGHUP, `| head`) never stops the shutdown."""
    stream = stream or sys.stdout
    try:
        print(text, file=stream, flush=True)
    except (BrokenPipeError, OSError):
        with contextlib.suppress(OSError):  # later writes (and the interpreter's final flush) go nowhere
            os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())


def check_arguments(parser: Parser, args: argparse.Namespace) -> None:
    """The mistakes found before anything starts, each as one line naming the fix (SystemExit)."""
    if args.backend == "torch" and importlib.util.find_spec("torch") is None:
        parser.error("--backend torch needs PyTorch, which is not installed: pip install -e '.[torch]'")
    if args.config_file:
        try:
            config = load_config(Path(args.config_file).read_text())
            Scheduler.from_sections(config, allow_experimental_plugins=args.allow_experimental_plugins)
            FlowControlConfig.from_sections(config)
        except OSError as error:
            raise SystemExit(f"epp-local: --config-file {args.config_file}: {error.strerror}") from None
        except ConfigError as error:
            raise SystemExit(f"epp-local: --config-file {args.config_file}: {error}") from None
    if args.pool_file:
        try:
            load_pool_file(args.pool_file)
        except PoolFileError as error:
            raise SystemExit(f"epp-local: --pool-file: {error}") from None
    try:
        servers_pool(args.model_server_url)
    except ValueError as error:
        parser.error(str(error))


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    check_arguments(parser, args)
    if args.print_envoy_config:
        with tempfile.TemporaryDirectory(prefix="epp-local-") as workdir:
            print(LocalStack(stack_config(args, Path(workdir))).envoy_bootstrap(), end="")
        return
    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    workdir = args.log_dir or Path(tempfile.mkdtemp(prefix="epp-local-"))

    async def main_async() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGHUP: the terminal was closed
            loop.add_signal_handler(sig, stop.set)
        return await run(args, stop, workdir)

    code = 1
    try:
        code = asyncio.run(main_async())
    finally:
        # the logs are kept when a process failed (or --log-dir asks), and a temporary folder removed otherwise
        failed_logs = code != 0 and any(workdir.glob("*.log"))
        if failed_logs:
            say(f"epp-local: logs kept in {workdir}", sys.stderr)
        elif args.log_dir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
