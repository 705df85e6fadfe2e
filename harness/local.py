"""`epp-local`: the whole stack on loopback — N model servers, the EPP and a real Envoy — supervised together.

epp-local --model-servers 4            # prints the gateway URL; Ctrl-C stops everything
epp-local --model-servers 4 --demo     # + a mixed workload through the gateway and a live table
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import yaml

from harness.bench.ports import free_port_block, free_ports
from harness.envoy import EnvoyProcess, render_bootstrap, terminate
from protocol import extproc
from protocol.kv_events import DEFAULT_SUBSCRIBER_PORT

DEMO_ADAPTERS = ("sql-lora", "chat-lora")


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
    # Active-active: this many EPPs behind Envoy (round robin), each subscribed to every server's publisher.
    epp_replicas: int = 1


def epp_command(
    pool_file: str, host: str, grpc: int, health: int, metrics: int, kv_events_port: int, extra: Sequence[str] = ()
) -> list[str]:
    """The command line of an EPP on a pool file (the local stack's and the benchmarks')."""
    return [
        sys.executable,
        "-m",
        "epp",
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


def wait_until_serving(epp: subprocess.Popen, metrics_url: str, log: Path, timeout: float = 60.0) -> None:
    """Until the EPP answers on its metrics port; RuntimeError naming its log if it exits or times out first."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(metrics_url, timeout=1).read()
            return
        except OSError:
            if epp.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"epp did not start serving; see {log}") from None
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
        # (grpc, health, metrics) of each EPP replica; the first are the config's
        self.epp_ports = [(config.grpc_port, config.grpc_health_port, config.metrics_port)]
        self.publisher_port_offset: int | None = None
        self.replay_port_offset: int | None = None  # each server's replay socket (a late EPP catches up from it)
        if config.kv_events_port is None:
            config.kv_events_port = DEFAULT_SUBSCRIBER_PORT
        if config.epp_replicas > 1:
            taken = set(self.ports())
            more = [p for p in free_ports(len(taken) + 3 * (config.epp_replicas - 1)) if p not in taken]
            self.epp_ports += [tuple(more[i : i + 3]) for i in range(0, 3 * (config.epp_replicas - 1), 3)]
        if config.kv_events_port:
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
        return [f"http://{c.host}:{c.base_port + i}" for i in range(c.model_servers)]

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
        groups = (
            [(f"modelserver-{i}", c.base_port + i, 1) for i in range(c.model_servers)]
            if c.separate_model_server_processes
            else [("modelserver", c.base_port, c.model_servers)]
        )
        for name, port, replicas in groups:
            argv = [
                sys.executable,
                "-m",
                "modelserver",
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
        path = self.workdir / "pool.yaml"
        endpoints = [{"name": f"ms-{i}", "address": c.host, "port": c.base_port + i} for i in range(c.model_servers)]
        path.write_text(yaml.safe_dump({"endpoints": endpoints, **c.pool_extra}))
        return path

    def start_epp(self) -> None:
        c = self.config
        pool_file = str(self.write_pool_file())
        for name, (grpc, health, metrics) in zip(self.epp_names, self.epp_ports, strict=True):
            argv = epp_command(pool_file, c.host, grpc, health, metrics, c.kv_events_port or 0, c.epp_args)
            if self.publisher_port_offset is not None:
                argv += ["--kv-events-connect-port-offset", str(self.publisher_port_offset)]
            if self.replay_port_offset is not None:
                argv += ["--kv-events-replay-port-offset", str(self.replay_port_offset)]
            if c.config_file:
                argv += ["--config-file", c.config_file]
            if c.config_text:
                argv += ["--config-text", c.config_text]
            self._spawn(name, argv, c.epp_env)

    def start_envoy(self) -> None:
        c = self.config
        bootstrap = render_bootstrap(
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
            more_epp_endpoints=[f"{c.host}:{grpc}" for grpc, _, _ in self.epp_ports[1:]],
        )
        path = self.workdir / "envoy.yaml"
        path.write_text(bootstrap)
        self.envoy = EnvoyProcess(path, c.admin_port, self.workdir / "envoy.log")
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
                    raise RuntimeError(f"{name} exited with {process.returncode}; see {self.workdir / name}.log")
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
        named = {c.base_port + i: f"model server {i}" for i in range(c.model_servers)}
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
        if self.publisher_port_offset is not None:
            for i in range(c.model_servers):
                named[c.base_port + i + self.publisher_port_offset] = f"model server {i} KV events"
        if self.replay_port_offset is not None:
            for i in range(c.model_servers):
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
            await asyncio.gather(
                *(
                    self._wait_http(n, f"{u}/health", timeout)
                    for n, u in zip(self._server_names(), self.model_server_urls, strict=True)
                ),
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="epp-local", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-servers", type=int, default=4)
    p.add_argument("--backend", choices=["sim", "torch"], default="sim")
    p.add_argument("--model", default=None, help="model name (sim) or directory (torch; default: a tiny model)")
    p.add_argument("--base-port", type=int, default=extproc.MODEL_SERVER_PORT)
    p.add_argument("--grpc-port", type=int, default=extproc.EPP_GRPC_PORT)
    p.add_argument("--grpc-health-port", type=int, default=extproc.EPP_GRPC_HEALTH_PORT)
    p.add_argument("--metrics-port", type=int, default=extproc.EPP_METRICS_PORT)
    p.add_argument("--listener-port", type=int, default=extproc.ENVOY_LISTENER_PORT)
    p.add_argument("--admin-port", type=int, default=extproc.ENVOY_ADMIN_PORT)
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
        "ports; each subscribes to every server's KV events",
    )
    p.add_argument("--fail-open", action="store_true", help="Envoy keeps serving (round robin) when the EPP is down")
    p.add_argument("--config-file", help="EndpointPickerConfig YAML for the EPP")
    p.add_argument(
        "--response-body-mode",
        choices=["NONE", "FULL_DUPLEX_STREAMED"],
        default="NONE",
        help="Envoy sends response bodies through the EPP (FULL_DUPLEX_STREAMED): what predicted-latency-scorer\n"
        "learns from (each streamed token costs an ext_proc round trip)",
    )
    p.add_argument(
        "--observed-responses-percent",
        type=functools.partial(_percent, lowest=1),
        default=100,
        help="with --response-body-mode FULL_DUPLEX_STREAMED: the share of requests (1-100) whose response bodies\n"
        "go through the EPP; the others bypass it",
    )
    p.add_argument(
        "--access-log-percent",
        type=functools.partial(_percent, lowest=0),
        default=100,
        help="the share of requests (0-100) whose access-log record Envoy sends to the EPP: what the latency\n"
        "predictor learns TTFT from without the response bodies (0: none; then it learns from bodies only)",
    )
    p.add_argument("--demo", action="store_true", help="send a mixed workload and show a live table")
    p.add_argument("--once", action="store_true", help="with --demo: exit after the workload")
    p.add_argument("--requests", type=int, default=64, help="with --demo: how many requests")
    return p


async def run(args: argparse.Namespace, stop: asyncio.Event) -> int:
    model = args.model or ("sim-llama-8b" if args.backend == "sim" else None)
    workdir = Path(tempfile.mkdtemp(prefix="epp-local-"))
    modelserver_args = [
        "--enable-lora",
        "--max-loras",
        "2",
        "--num-gpu-blocks",
        "4096",
        "--lora-modules",
        *(f"{a}={workdir / a}" for a in DEMO_ADAPTERS),
    ]
    if args.backend == "torch" and model is None:
        from modelserver.torch.tiny import make_tiny_model

        model = str(workdir / "tiny-model")
        make_tiny_model(model, lora_names=DEMO_ADAPTERS)
    if args.backend == "torch":  # real adapter files: the tiny model's, or DIR/loras/<name> of the user's model
        adapters = [a for a in DEMO_ADAPTERS if (Path(model) / "loras" / a / "adapter_config.json").is_file()]
        if args.demo and len(adapters) < len(DEMO_ADAPTERS):
            print(
                f"epp-local: the demo sends LoRA requests and needs PEFT adapters {', '.join(DEMO_ADAPTERS)} in "
                f"{Path(model) / 'loras'} (`modelserver make-tiny-model DIR --lora sql-lora --lora chat-lora` makes "
                "a tiny model with them); without --demo the stack runs without adapters",
                file=sys.stderr,
            )
            return 2
        modelserver_args = modelserver_args[: -len(DEMO_ADAPTERS)] + [
            f"{a}={Path(model) / 'loras' / a}" for a in adapters
        ]
        if not adapters:
            modelserver_args.remove("--lora-modules")
    config = StackConfig(
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
        fail_open=args.fail_open,
        response_body_mode=args.response_body_mode,
        observed_responses_percent=args.observed_responses_percent,
        access_log_percent=args.access_log_percent,
        model=model,
        config_file=args.config_file,
        modelserver_args=modelserver_args,
        workdir=workdir,
    )
    stack = LocalStack(config)
    say(f"starting {args.model_servers} {args.backend} model servers, the EPP and Envoy (logs in {workdir}) ...")
    try:
        stack.check_ports_free()
    except RuntimeError as error:
        say(f"epp-local: {error}", sys.stderr)
        return 2
    await stack.start()
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
        adapters = ", ".join(DEMO_ADAPTERS) if args.backend == "sim" else "see --lora-modules"
        say(f"gateway ready: {stack.gateway_url}/v1  (OpenAI API; model {model!r}, adapters {adapters})")
        say(f"EPP metrics: {stack.epp_metrics_url}   Envoy admin: http://127.0.0.1:{args.admin_port}")
        if args.demo:
            from harness.demo import run_demo

            try:
                ok = await run_demo(stack, model, DEMO_ADAPTERS, args.requests, stop, once=args.once)
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


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)

    async def main_async() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGHUP: the terminal was closed
            loop.add_signal_handler(sig, stop.set)
        return await run(args, stop)

    sys.exit(asyncio.run(main_async()))


if __name__ == "__main__":
    main()
