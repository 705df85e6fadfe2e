"""`modelserver`: an OpenAI-compatible model server with vLLM's flags and metrics (`--backend sim|torch`).

`modelserver make-tiny-model DIR` writes a small random Llama-style model and tokenizer (needs the torch extra).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import importlib.util
import logging
import math
import resource
import signal
import sys
from dataclasses import fields, replace
from pathlib import Path

import uvloop

from modelserver.api.server import ModelServer, ServerSettings, runtime_lora_updating_from_env
from modelserver.engine.config import EngineConfig
from modelserver.engine.engine import AsyncEngine
from modelserver.engine.kv_events import ZmqEventPublisher, should_bind
from modelserver.engine.sim import SimExecutor, SimTiming
from modelserver.metrics import default_stat_loggers
from modelserver.tracing import RequestTracer
from protocol import tracing
from protocol.cli import Parser, command_parser, positive_int
from protocol.kv_events import DEFAULT_HASH_ALGO, HASH_ALGOS, KVEventsConfig, default_topic
from protocol.limits import give_large_blocks_back, raise_open_files_limit
from protocol.tokenizer import load_tokenizer

log = logging.getLogger("modelserver")
SIM_TIMING_HELP = {  # the --sim-* flags (modelserver/engine/sim.py, SimTiming)
    "prefill_overhead": "seconds per step that prefills",
    "prefill_time_per_token": "seconds per uncached prompt token",
    "decode_base": "seconds per decode step at batch size 1",
    "decode_per_seq": "extra seconds per sequence in the decode batch",
    "lora_load_time": "seconds to load an adapter into a GPU slot",
    "lora_cold_load_time": "extra seconds when the adapter is not in host memory (--max-cpu-loras)",
    "jitter": "relative standard deviation of the step time",
}


def _lora_module(text: str) -> tuple[str, str]:
    name, eq, path = text.partition("=")
    if not eq or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules expects name=path, got {text!r}")
    return name, path


def build_parser() -> Parser:
    p = command_parser("modelserver", __doc__)
    p.add_argument(
        "--backend",
        choices=["sim", "torch"],
        default="sim",
        help="sim: a timing model instead of the forward pass (no GPU, no weights); torch: a real transformer",
    )
    p.add_argument("--model", default="sim-llama-8b", help="local model directory (torch) or a name (sim)")
    p.add_argument("--served-model-name", default=None, help="name clients use in `model` (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (the first, with --replicas)")
    p.add_argument(
        "--replicas", type=positive_int, default=1, help="independent servers on port .. port+N-1, one process"
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    p.add_argument("--num-gpu-blocks", type=int, default=None, help="KV blocks (sim: 8192; torch: from memory)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens one engine step may compute")
    p.add_argument("--max-num-seqs", type=int, default=256, help="requests running at once (the batch)")
    p.add_argument("--max-model-len", type=int, default=8192, help="longest prompt + output, in tokens")
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV blocks of a prompt prefix seen before",
    )
    p.add_argument(
        "--prefix-caching-hash-algo",
        choices=HASH_ALGOS,
        default=DEFAULT_HASH_ALGO,
        help="vLLM's block hash: sha256 (pickle) or sha256_cbor (canonical CBOR); seeded by PYTHONHASHSEED",
    )
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters")
    p.add_argument("--max-loras", type=int, default=1, help="adapters in the batch at once (GPU slots)")
    p.add_argument(
        "--max-cpu-loras", type=int, default=None, help="adapters kept loaded in CPU memory (default: --max-loras)"
    )
    p.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank served")
    p.add_argument(
        "--lora-modules",
        nargs="*",
        type=_lora_module,
        default=[],
        metavar="NAME=PATH",
        help="adapters served from the start (turns LoRA on)",
    )
    p.add_argument("--lora-root", action="append", default=[], help="directory runtime-loaded adapters must be in")
    p.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (as VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)",
    )
    p.add_argument("--disable-log-stats", action="store_true", help="no periodic throughput line in the log")
    p.add_argument(
        "--show-hidden-metrics-for-version", default=None, help="also export the metrics vLLM hid after this version"
    )
    p.add_argument(
        "--kv-events-config",
        type=KVEventsConfig.from_json,
        default=None,
        help="vLLM's KV events JSON, e.g. "
        '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}\'; with several --replicas a bound port '
        "is offset by the replica index; no topic: kv@<host:port>@<model> per replica",
    )
    p.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        help="OpenTelemetry collector (OTLP/gRPC, host:port or URL) for request traces, as vLLM's flag: an "
        "llm_request span per request with gen_ai.* attributes and queue, prefill and decode spans under it, "
        "continuing the request's traceparent (needs the `tracing` extra)",
    )
    p.add_argument(
        "--trace-sampling-ratio",
        type=float,
        default=1.0,
        help="share of new traces kept (a request that brings a traceparent keeps its decision; default %(default)s)",
    )
    p.add_argument("--kv-cache-metrics-sample", type=float, default=0.0, help="fraction of KV blocks sampled")
    p.add_argument(
        "--max-request-body-bytes",
        type=positive_int,
        default=ServerSettings.max_request_body_bytes,
        help="larger request bodies are answered 413",
    )
    p.add_argument(
        "--max-buffered-body-bytes",
        type=positive_int,
        default=ServerSettings.max_buffered_body_bytes,
        help="request body bytes each server receives at once, all connections together; a request that would go "
        "over it is answered 503",
    )
    p.add_argument(
        "--max-connections",
        type=positive_int,
        default=ServerSettings.max_connections,
        help="HTTP connections each server's port takes at once; one beyond is answered 503 and closed",
    )
    p.add_argument(
        "--max-stored-responses",
        type=int,
        default=4096,
        help="Responses API: stored responses kept for previous_response_id (oldest dropped first)",
    )
    p.add_argument(
        "--max-stored-response-bytes",
        type=int,
        default=256 * 1024 * 1024,
        help="Responses API: bytes the stored responses and their conversations may take (oldest dropped first)",
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed (sim: its timing noise, per replica)")
    p.add_argument("--device", default="auto", help="torch: cuda, cpu or auto")
    p.add_argument("--dtype", default="auto", help="torch: bfloat16, float16, float32 or auto")
    p.add_argument(
        "--gpu-memory-utilization", type=float, default=0.9, help="torch on a GPU: the share of its memory used"
    )
    sim = p.add_argument_group("sim backend timing (seconds)")
    for f in fields(SimTiming):
        if f.name not in ("seed", "speed"):
            sim.add_argument(
                f"--sim-{f.name.replace('_', '-')}", type=float, default=f.default, help=SIM_TIMING_HELP[f.name]
            )
    sim.add_argument(
        "--sim-speed",
        type=float,
        nargs="+",
        default=[1.0],
        metavar="SPEED",
        help="each replica's GPU speed relative to the defaults' (step times divided by it), cycled over --replicas: "
        "`1 0.5` makes every other replica half as fast, a pool mixing two GPU generations",
    )
    sim.add_argument("--sim-zero-delay", action="store_true", help="all modelled times 0 (overhead benchmarks)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    lora = "--enable-lora or --lora-modules"
    for flag in ("--max-loras", "--max-cpu-loras", "--max-lora-rank"):
        p.needs(flag, lora, lambda a: a.enable_lora or bool(a.lora_modules))
    p.needs(
        "--lora-root",
        "--allow-runtime-lora-updating (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)",
        lambda a: a.allow_runtime_lora_updating or runtime_lora_updating_from_env(),
    )
    for flag in ("--device", "--dtype", "--gpu-memory-utilization"):
        p.needs(flag, "--backend torch", lambda a: a.backend == "torch")
    for action in sim._group_actions:
        p.needs(action.option_strings[0], "--backend sim", lambda a: a.backend == "sim")
    return p


def _sim_timing(args: argparse.Namespace, index: int) -> SimTiming:
    """Replica `index`'s timing: its own seed and its speed from --sim-speed."""
    if args.sim_zero_delay:
        return SimTiming.zero()
    values = {f.name: getattr(args, f"sim_{f.name}") for f in fields(SimTiming) if f.name not in ("seed", "speed")}
    return SimTiming(**values, seed=args.seed + index, speed=args.sim_speed[index % len(args.sim_speed)])


def _offset_port(endpoint: str | None, index: int) -> str | None:
    """Replica `index` binds port + index (as vLLM offsets by data-parallel rank); connect endpoints are shared."""
    if not endpoint or index == 0 or not should_bind(endpoint) or not endpoint.startswith("tcp://"):
        return endpoint
    base, _, port = endpoint.rpartition(":")
    return endpoint if port == "*" else f"{base}:{int(port) + index}"


def build_kv_events(args: argparse.Namespace, index: int) -> ZmqEventPublisher | None:
    config: KVEventsConfig | None = args.kv_events_config
    if config is None or not config.enabled:
        return None
    config = replace(
        config,
        endpoint=_offset_port(config.endpoint, index),
        replay_endpoint=_offset_port(config.replay_endpoint, index),
    )
    topic = config.topic or default_topic(f"{args.host}:{args.port + index}", args.served_model_name)
    return ZmqEventPublisher(config, topic)


def build_engine(args: argparse.Namespace, index: int, tokenizer) -> AsyncEngine:
    config = EngineConfig(
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks or 8192,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        prefix_caching_hash_algo=args.prefix_caching_hash_algo,
        enable_lora=args.enable_lora or bool(args.lora_modules),
        max_loras=args.max_loras,
        max_cpu_loras=args.max_cpu_loras,
        max_lora_rank=args.max_lora_rank,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_metrics_sample=args.kv_cache_metrics_sample,
    )
    if args.backend == "torch":
        try:
            from modelserver.torch.executor import TorchExecutor
        except ImportError as exc:
            raise SystemExit(f"--backend torch needs the torch executor and `pip install .[torch]`: {exc}") from None
        executor = TorchExecutor.from_args(args, config)
        config.num_gpu_blocks = executor.num_gpu_blocks
    else:
        timing = _sim_timing(args, index)
        executor = SimExecutor(timing, config.block_size, config.num_gpu_blocks, tokenizer.filler_token_ids())
    return AsyncEngine(
        config,
        executor,
        model_name=args.served_model_name,
        engine_index=0,
        stat_loggers=default_stat_loggers(
            config,
            args.served_model_name,
            log_stats=not args.disable_log_stats,
            show_hidden_metrics_for_version=args.show_hidden_metrics_for_version,
        ),
        lora_modules=dict(args.lora_modules),
        kv_events=build_kv_events(args, index),
        tracer=build_tracer(args),
    )


def build_tracer(args: argparse.Namespace) -> RequestTracer | None:
    """The request tracer when --otlp-traces-endpoint names a collector."""
    if not args.otlp_traces_endpoint:
        return None
    try:
        tracer = tracing.tracer(args.otlp_traces_endpoint, args.trace_sampling_ratio, "modelserver")
    except (tracing.TracingUnavailable, ValueError) as error:
        raise SystemExit(f"modelserver: {error}") from None
    return RequestTracer(tracer, args.served_model_name)


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    tokenizer = load_tokenizer(args.model if args.backend == "torch" else None)
    servers: list[ModelServer] = []
    engines: list[AsyncEngine] = []
    try:
        for index in range(args.replicas):
            engine = build_engine(args, index, tokenizer)
            await engine.start()
            engines.append(engine)
            settings = ServerSettings(
                served_model_name=args.served_model_name,
                model_path=args.model,
                max_model_len=args.max_model_len,
                backend=args.backend,
                lora_roots=args.lora_root,
                allow_runtime_lora_updating=args.allow_runtime_lora_updating or runtime_lora_updating_from_env(),
                max_request_body_bytes=args.max_request_body_bytes,
                max_buffered_body_bytes=args.max_buffered_body_bytes,
                max_connections=args.max_connections,
                max_stored_responses=args.max_stored_responses,
                max_stored_response_bytes=args.max_stored_response_bytes,
            )
            server = ModelServer(engine, tokenizer, settings)
            servers.append(server)
            await server.start(args.host, args.port + index)
            print(f"ready on http://{args.host}:{args.port + index}", flush=True)
        await stop.wait()
    finally:
        for server in servers:
            await server.stop()
        for engine in engines:
            await engine.stop()


def check_arguments(args: argparse.Namespace) -> str | None:
    """The mistake, in one line naming the fix, that the parsed flags make before anything starts; None if none."""
    if args.max_buffered_body_bytes < args.max_request_body_bytes:
        return (
            f"--max-buffered-body-bytes {args.max_buffered_body_bytes} is below --max-request-body-bytes "
            f"{args.max_request_body_bytes}: a body of the largest size allowed could never be received"
        )
    if not all(math.isfinite(speed) and speed > 0 for speed in args.sim_speed):
        return f"--sim-speed: every speed must be a finite number > 0, got {args.sim_speed}"
    if args.backend != "torch":
        return None  # the sim reads no model or adapter files
    if importlib.util.find_spec("torch") is None:
        return "--backend torch needs PyTorch, which is not installed: pip install -e '.[torch]'"
    for name, path in args.lora_modules:  # the torch executor would need them only at their first use
        missing = [f for f in ("adapter_config.json", "adapter_model.safetensors") if not (Path(path) / f).is_file()]
        if missing:
            return f"--lora-modules {name}={path}: no {' or '.join(missing)} there (a PEFT adapter dir)"
    if not Path(args.model, "config.json").is_file():
        return (
            f"--model {args.model}: no config.json there; the torch backend loads a local Hugging Face model "
            "directory (`modelserver make-tiny-model DIR` makes a small one)"
        )
    return None


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "make-tiny-model":
        if importlib.util.find_spec("torch") is None:
            raise SystemExit(
                "modelserver make-tiny-model needs PyTorch, which is not installed: pip install -e '.[torch]'"
            )
        from modelserver.torch.tiny import main as make_tiny_model

        make_tiny_model(argv[1:])
        return
    args = build_parser().parse_args(argv)
    args.served_model_name = args.served_model_name or args.model
    error = check_arguments(args)
    if error:
        raise SystemExit(f"modelserver: {error}")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(name)s %(message)s"
    )

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(args, stop)

    give_large_blocks_back()
    open_files = raise_open_files_limit()
    # one server's port full, and the process's own files: --replicas (several sim servers in one process, for a
    # local pool) share the limit, which a test's traffic never comes near
    if open_files != resource.RLIM_INFINITY and open_files < args.max_connections + 256:
        log.warning(
            "open files are limited to %d: fewer than --max-connections (%d) and the server's own files; beyond it "
            "a new connection is closed unanswered",
            open_files,
            args.max_connections,
        )
    try:
        with contextlib.suppress(KeyboardInterrupt):
            uvloop.run(run())  # cheaper callbacks when many replicas share one loop
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        raise SystemExit(f"modelserver: {exc} (another process holds the port: stop it, or choose --port)") from None
