"""`epp-bench`: benchmarks of the EPP on a local sim pool.

Each subcommand prints its measurements and the files it wrote (or that it wrote none). They report and exit 0,
except `chaos`, which exits 1 when an attack misses a goal it reports, `failover`, which exits 1 when a fault failed
a request it should not have, and `flood`, which exits 1 when a target left requests unaccounted for.

epp-bench overhead [--servers 4] [--sequential 2000] [--concurrency 32] [--requests 2000] [--ext-proc-transport h2|grpcio]
                   [--streamed] [--pin] [--epp-config FILE ...] [--epp-flags FLAGS ...] [--rounds 1]
                   [--epp-replicas N] [--against DIR [--pairs 4]] [--out DIR]
epp-bench kv-index [--cap 150000] [--entries 400000] [--batches 300] [--switch-interval 1000] [--against DIR [--rounds 2]]
epp-bench handler-cpu [--requests 4000] [--batch 16] [--rounds 9] [--streamed] [--kv-events] [--config-file FILE]
                      [--evict-mb N] [--instructions] [--tracing off|bare|on]
epp-bench agent-cpu [--rate 2] [--duration 30] [--profile N]
epp-bench replica-channel [--replicas 3] [--rates 24 200] [--duration 20] [--servers 8] [--blocks 190] [--rounds 2]
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from epp.config import ConfigError
from epp.scheduling.scheduler import Scheduler
from harness.bench import (
    agent_cpu,
    chaos,
    compare,
    decision,
    failover,
    flood,
    handler_cpu,
    idle,
    kv_events,
    kv_index,
    overhead,
    replica_channel,
    sim_capacity,
    tokenize,
)
from harness.bench.workloads import WORKLOADS
from protocol.cli import Parser, command_parser, positive_int


def _exit(signum: int, frame) -> None:
    raise SystemExit(128 + signum)


def say_written(paths: list[Path], note: str) -> None:
    """The files a subcommand wrote, and `note`: what it did not write and why (or how to have it written)."""
    wrote = f"wrote {', '.join(map(str, paths))}" if paths else "wrote no files"
    print(f"{wrote}{'; ' + note if note else ''}")


def build_parser() -> Parser:
    parser = command_parser("epp-bench", __doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    over = sub.add_parser("overhead", help="added latency and throughput: Envoy+EPP vs plain Envoy")
    over.add_argument("--servers", type=int, default=4, help="sim model servers")
    over.add_argument(
        "--sequential",
        type=int,
        default=2000,
        help="requests one at a time, per target (the p99 is the 20th slowest of 2,000; of 400 it was the 5th, and "
        "the floors' p99 / plain Envoy's ranged 1.05-2.12 between runs)",
    )
    over.add_argument("--concurrency", type=int, default=32, help="concurrent requests of the throughput runs")
    over.add_argument("--requests", type=int, default=2000, help="requests per throughput run")
    over.add_argument("--ext-proc-transport", choices=["h2", "grpcio"], default="h2", help="the EPP's gRPC server")
    over.add_argument("--out", type=Path, default=None, help="directory for overhead.json and overhead.md")
    over.add_argument(
        "--against",
        type=Path,
        default=None,
        help="another checkout of this repository (its `epp` package built, or run as Python): its EPP against this "
        "one's in the same runs, the two swapped between two EPP targets in each pair of runs (overhead.compare_builds)",
    )
    over.add_argument("--pairs", type=int, default=4, help="pairs of runs for --against")
    over.add_argument(
        "--rounds",
        type=positive_int,
        default=1,
        help="pairs of throughput passes over the targets (forward, then back): more passes, each EPP variant compared "
        "with the default EPP pass by pass",
    )
    over.needs("--pairs", "--against DIR", lambda a: a.against is not None)
    over.add_argument(
        "--streamed", action="store_true", help='"stream": true requests: their access-log records train the predictor'
    )
    over.add_argument(
        "--pin",
        action="store_true",
        help="the client and the model servers on half the CPUs, every target's processes on the other half",
    )
    over.add_argument(
        "--epp-config",
        type=Path,
        action="append",
        default=[],
        help="an EndpointPickerConfig file: one more target, the EPP with it (repeatable)",
    )
    over.add_argument(
        "--epp-flags",
        action="append",
        default=[],
        metavar="FLAGS",
        help='more command-line flags for the EPP, quoted as one argument (e.g. "--status-decisions 0"): one more\n'
        "target, the EPP with them (repeatable)",
    )
    over.add_argument(
        "--epp-replicas",
        type=int,
        default=1,
        help="above 1: two more targets, that many EPP replicas behind one Envoy sharing their load and not (what\n"
        "sharing costs a replica per request)",
    )
    agent = sub.add_parser("agent-cpu", help="the EPP's request path per agent request in process (agentic plan)")
    agent.add_argument("--rate", type=float, default=2.0, help="sessions per second of the plan")
    agent.add_argument("--duration", type=float, default=30.0, help="seconds of the plan")
    agent.add_argument("--profile", type=int, default=0, help="print cProfile's N heaviest functions (own time)")
    cpu = sub.add_parser("handler-cpu", help="the EPP's CPU per request in process: transport, handler, scheduling")
    cpu.add_argument("--requests", type=int, default=4000, help="requests per round")
    cpu.add_argument("--batch", type=int, default=16, help="requests per read (1: one at a time)")
    cpu.add_argument("--rounds", type=int, default=9, help="the least round is reported")
    cpu.add_argument(
        "--streamed", action="store_true", help='"stream": true requests: their access-log records train the predictor'
    )
    cpu.add_argument(
        "--kv-events",
        action="store_true",
        help="the endpoints publish KV events (as vLLM with --kv-events-config): precise-prefix-cache-scorer "
        "tokenizes each prompt and hashes its blocks",
    )
    cpu.add_argument(
        "--config-file", type=Path, default=None, help="the EPP's EndpointPickerConfig (default: its default profile)"
    )
    cpu.add_argument(
        "--evict-mb",
        type=int,
        default=0,
        help="MiB of memory written before each read, untimed: caches as other processes leave them (16-24: as a "
        "live EPP behind Envoy on a 2-core host finds them)",
    )
    cpu.add_argument(
        "--tracing",
        choices=list(handler_cpu.TRACING),
        default="off",
        help="every request traced (on: its spans encoded as the exporter does, but not sent), tracing's floor (bare: "
        "ids, the traceparent upstream and one span without attributes) or not",
    )
    cpu.add_argument(
        "--instructions",
        action="store_true",
        help="count instructions per request under valgrind's callgrind (exact and repeatable) instead of CPU time; "
        "with --evict-mb, the lines of code and data fetched from beyond a simulated 1 MiB cache too",
    )
    capacity = sub.add_parser("sim-capacity", help="how many sim servers one core carries at a request rate")
    capacity.add_argument("--replicas", type=int, default=16, help="sim servers in one process")
    capacity.add_argument("--rates", type=float, nargs="+", default=[16.0, 32.0, 64.0], help="requests per second")
    capacity.add_argument("--duration", type=float, default=20.0, help="seconds per rate")
    cmp = sub.add_parser("compare", help="routing quality of our EPP, plain Envoy and the Rust routers")
    workloads = sorted(p.stem for p in WORKLOADS.glob("*.yaml"))
    cmp.add_argument("--workload", default="shared-prefix", choices=workloads, help="one of: " + ", ".join(workloads))
    targets = [*compare.EPP_TARGETS, *compare.ENVOY_TARGETS, *compare.PEER_TARGETS, *sorted(compare.ORACLE_TARGETS)]
    cmp.add_argument(
        "--targets",
        nargs="+",
        choices=targets,
        metavar="TARGET",
        default=[
            "epp",
            "prefix-only",
            "queue-only",
            "round-robin",
            "least-request",
            "random",
            "sglang-cache-aware",
            "sglang-round-robin",
            "vllm-cache-aware",
        ],
        help="any of: " + ", ".join(targets) + " (the Rust routers need the [bench] extra)",
    )
    cmp.add_argument(
        "--rates", type=float, nargs="+", default=[8.0, 16.0, 24.0], help="requests per second (open loop)"
    )
    cmp.add_argument("--concurrency", type=int, nargs="+", default=[], help="closed-loop clients (instead of --rates)")
    cmp.add_argument("--duration", type=float, default=60.0, help="seconds per target and load")
    cmp.add_argument(
        "--warmup",
        type=float,
        default=0.0,
        help="seconds of the same workload before each target's measured run, not counted (online learning warms)",
    )
    cmp.add_argument("--servers", type=int, default=8, help="sim model servers")
    cmp.add_argument(
        "--epp-replicas",
        type=int,
        nargs="+",
        default=[1],
        help="run each EPP target on this many EPP replicas behind its Envoy (several counts: one run each)",
    )
    cmp.add_argument(
        "--replica-sharing",
        choices=["on", "off"],
        nargs="+",
        default=["on"],
        help="with --epp-replicas above 1: the replicas share their in-flight load and prefix learning (on), or "
        "each counts its own (off); both: one run each",
    )
    cmp.add_argument(
        "--replica-routing",
        choices=["all", "first"],
        nargs="+",
        default=["all"],
        help="with --epp-replicas above 1: Envoy routes to every replica (all), or to the first only while the others\n"
        "run beside it as shadows, scraping and reading KV events but routing nothing (first: what the replicas cost\n"
        "beyond their requests, the floor of N against 1); both: one run each",
    )
    cmp.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run every target and variant this many times at each load, in rounds; the report gives each run, the\n"
        "spread of each configuration over the rounds, and the replica ratios' mean and range (the noise a goal\n"
        "within a few percent must be read against)",
    )
    cmp.add_argument(
        "--burst",
        type=int,
        default=0,
        help="arrivals (requests, or agent sessions) come this many at once, at the same mean rate (0: the "
        "workload's own)",
    )
    cmp.add_argument("--scale", type=float, default=1.0, help="shrink prompt lengths (smoke runs)")
    cmp.add_argument(
        "--profile",
        action="store_true",
        help="py-spy samples each run's first EPP over the measured run (runs/*/epp.pyspy.txt, collapsed stacks): "
        "the report gives the share of its samples in the replica channel and what it feeds",
    )
    cmp.add_argument(
        "--load-generator",
        choices=["builtin", "inference-perf"],
        default="builtin",
        help="inference-perf: the standard client drives the load (shared-prefix workloads; "
        "`make bench-inference-perf` installs it)",
    )
    cmp.add_argument("--out", type=Path, default=Path("bench-results"), help="directory for the report and plots")
    cmp.needs("--rates", "no --concurrency (a run is open loop at --rates or closed loop)", lambda a: not a.concurrency)
    flood_cmd = sub.add_parser("flood", help="tenants of different priority past the pool's capacity (flow control)")
    flood_cmd.add_argument("--targets", nargs="+", default=list(flood.TARGETS), help="what routes the flood")
    flood_cmd.add_argument("--overloads", type=float, nargs="+", default=[1.5, 2.0], help="offered rate / capacity")
    flood_cmd.add_argument("--duration", type=float, default=30.0, help="seconds per target and overload")
    flood_cmd.add_argument("--servers", type=int, default=4, help="sim model servers")
    flood_cmd.add_argument("--out", type=Path, default=None, help="directory for flood.md and flood.json")
    sub.add_parser("decision", help="scheduler decision time vs pool size (8, 32, 128) and prompt length")
    sub.add_parser("tokenize", help="exact tokens and block hashes (precise prefix scorer) at 1k, 8k, 64k tokens")
    events_cmd = sub.add_parser("kv-events", help="the EPP's CPU for KV events and its step-to-index delay")
    events_cmd.add_argument("--servers", type=int, default=8, help="sim model servers publishing events")
    events_cmd.add_argument("--rate", type=float, default=30.0, help="requests per second per server")
    events_cmd.add_argument("--prompt-tokens", type=int, default=2000, help="tokens per prompt")
    events_cmd.add_argument("--seconds", type=float, default=10.0, help="measuring window")
    events_cmd.add_argument("--num-gpu-blocks", type=int, default=20000, help="per server: evictions start past it")
    events_cmd.add_argument("--step-ms", type=float, default=20.0, help="engine step: one batch per step")
    events_cmd.add_argument(
        "--late-join",
        action="store_true",
        help="the servers ran before the EPP, whose replay offset leads nowhere: how long until every server's first "
        "batch is in its index (each replay waits its 1 s timeout)",
    )
    index_cmd = sub.add_parser("kv-index", help="prefix indexes: memory per entry, a huge KV event batch's loop stall")
    index_cmd.add_argument("--cap", type=int, default=150_000, help="the index's cap, and the big batch's hashes")
    index_cmd.add_argument("--entries", type=int, default=400_000, help="entries for the memory measurement")
    index_cmd.add_argument(
        "--batches", type=int, default=300, help="500-hash batches (and approximate-index picks) below and at the cap"
    )
    index_cmd.add_argument(
        "--against",
        type=Path,
        default=None,
        help="another checkout of this repository: its KV-event index and approximate index (their modules loaded "
        "beside this one's) measured in the same run, alternating with this checkout's",
    )
    index_cmd.add_argument("--rounds", type=int, default=2, help="measurements of each checkout, with --against")
    index_cmd.needs("--rounds", "--against DIR", lambda a: a.against is not None)
    index_cmd.add_argument(
        "--switch-interval",
        type=float,
        default=1000.0,
        help="sys.setswitchinterval during the stall test (1000: threads switch only where the code yields, as in "
        "the compiled release build; 0.005: CPython's default)",
    )
    chaos_cmd = sub.add_parser("chaos", help="attacks and faults on a local stack while a well-behaved client runs")
    chaos_cmd.add_argument("--seconds", type=float, default=4.0, help="per attack")
    fail_cmd = sub.add_parser(
        "failover", help="an EPP replica killed, one drained, a model server killed, each under streaming load"
    )
    fail_cmd.add_argument("--servers", type=int, default=8, help="sim model servers (one process each)")
    fail_cmd.add_argument("--replicas", type=int, default=3, help="EPP replicas behind Envoy")
    fail_cmd.add_argument("--clients", type=int, default=32, help="streaming clients, back to back")
    fail_cmd.add_argument("--seconds", type=float, default=6.0, help="per fault")
    fail_cmd.add_argument("--fail-close", action="store_true", help="FailClose instead of FailOpen")
    fail_cmd.add_argument("--drain-timeout", type=float, default=10.0, help="the replicas' --drain-timeout (seconds)")
    channel_cmd = sub.add_parser(
        "replica-channel", help="the replica channel's CPU per request: N replicas in process, sharing and not"
    )
    channel_cmd.add_argument("--replicas", type=int, default=3, help="replica processes")
    channel_cmd.add_argument("--rates", type=float, nargs="+", default=[24.0, 200.0], help="requests a second, all")
    channel_cmd.add_argument("--duration", type=float, default=20.0, help="seconds a run")
    channel_cmd.add_argument("--servers", type=int, default=8, help="endpoints in the pool")
    channel_cmd.add_argument("--blocks", type=int, default=190, help="block hashes a prompt (prefix deltas)")
    channel_cmd.add_argument("--rounds", type=int, default=2, help="pairs of runs (not sharing, sharing) a rate")
    idle_cmd = sub.add_parser("idle", help="CPU of an idle EPP that only scrapes N endpoints")
    idle_cmd.add_argument("--endpoints", type=int, nargs="+", default=[8, 64, 256], help="pool sizes")
    idle_cmd.add_argument("--seconds", type=float, default=10.0, help="measuring window per pool size")
    idle_cmd.add_argument("--epp-arg", action="append", default=[], help="extra flag for the EPP (repeatable)")
    idle_cmd.add_argument(
        "--busy",
        action="store_true",
        help="pages show a running request and the quiet interval is off: scraping as under traffic",
    )
    idle_cmd.add_argument(
        "--whole-pages",
        action="store_true",
        help="the page server ignores the scraper's sample filter (name[]) and sends whole pages",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    # SIGTERM (`timeout`, a CI job's end) and SIGHUP (the terminal closed) end a benchmark as Ctrl-C does: through
    # its `finally`, which stops the processes it started in sessions of their own (they outlived it before)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit)
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "flood":
        results = asyncio.run(flood.flood(args.targets, args.overloads, args.duration, args.servers, args.out))
        if args.out:
            say_written([args.out / "flood.md", args.out / "flood.json"], "")
        else:
            say_written([], "--out DIR keeps the report")
        lost = [f"{r.target} at {r.overload:g}x" for r in results if r.accounted is False]
        if lost:
            raise SystemExit(f"epp-bench flood: requests not all accounted for: {', '.join(lost)}")
        return
    if args.command == "decision":
        decision.main()
    if args.command == "tokenize":
        tokenize.main()
    if args.command == "kv-index":
        other = None
        if args.rounds < 1:
            parser.error("--rounds must be at least 1")
        if args.against is not None:
            try:
                other = (str(args.against), kv_index.load(args.against.resolve()))
            except (ValueError, ImportError) as error:
                parser.error(f"--against {args.against}: {error}")
        kv_index.main(args.cap, args.entries, args.batches, args.switch_interval, other, args.rounds)
    if args.command == "replica-channel":
        replica_channel.main(args.replicas, args.rates, args.duration, args.servers, args.blocks, args.rounds)
    if args.command == "kv-events":
        kv_events.report(
            kv_events.measure(
                args.servers,
                args.rate,
                args.prompt_tokens,
                args.seconds,
                args.num_gpu_blocks,
                args.step_ms,
                args.late_join,
            )
        )
    if args.command == "compare":
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        began = time.time()  # the plots written since, this run's

        sharing = [choice == "on" for choice in args.replica_sharing]
        shadows = [choice == "first" for choice in args.replica_routing]
        if args.repeats < 1:
            parser.error("--repeats must be at least 1")
        runs = (
            args.repeats
            * len(args.concurrency or args.rates)
            * sum(len(compare.replica_variants(t, args.epp_replicas, sharing, shadows)) for t in args.targets)
        )
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} runs"),
            TimeElapsedColumn(),
        ) as bar:
            task = bar.add_task("starting", total=runs)
            started = []

            def progress(message: str) -> None:
                bar.log(message)
                if message.startswith("skip"):
                    bar.advance(task)
                    return
                if started:
                    bar.advance(task)
                started.append(message)
                bar.update(task, description=message.split(" for ")[0])

            results = asyncio.run(
                compare.compare(
                    args.workload,
                    args.targets,
                    args.rates,
                    args.duration,
                    args.servers,
                    args.out,
                    args.scale,
                    progress=progress,
                    concurrencies=args.concurrency,
                    load_generator=args.load_generator,
                    warmup=args.warmup,
                    replicas=args.epp_replicas,
                    sharing=sharing,
                    burst=args.burst,
                    shadows=shadows,
                    profile=args.profile,
                    repeats=args.repeats,
                )
            )
            bar.update(task, completed=runs, description="done")
        print(compare.markdown(results))
        plots = sorted(p for p in args.out.glob("*.png") if p.stat().st_mtime >= began)
        say_written(
            [args.out / f"{args.workload}.md", args.out / f"{args.workload}.json", *plots],
            "" if plots else "no plots (matplotlib is not installed: pip install -e '.[bench]')",
        )
    if args.command == "chaos":
        report = asyncio.run(chaos.run(seconds=args.seconds))
        print(chaos.markdown(report))
        missed = [r.attack for r in report.results if chaos.missed_goals(report, r)]
        if missed:
            raise SystemExit(f"epp-bench chaos: goals missed by: {', '.join(missed)} (the table says which and why)")
    if args.command == "failover":
        report = asyncio.run(
            failover.run(
                servers=args.servers,
                replicas=args.replicas,
                clients=args.clients,
                seconds=args.seconds,
                fail_open=not args.fail_close,
                drain_timeout=args.drain_timeout,
            )
        )
        print(failover.markdown(report))
        missed = failover.missed_goals(report)
        if missed:
            raise SystemExit(f"epp-bench failover: requests failed in: {', '.join(missed)}")
    if args.command == "idle":
        print(
            idle.markdown(
                idle.measure(
                    args.endpoints, args.seconds, epp_args=args.epp_arg, busy=args.busy, whole_pages=args.whole_pages
                )
            )
        )
    if args.command == "sim-capacity":
        sim_capacity.main(args.replicas, args.rates, args.duration)
    if args.command == "agent-cpu":
        print(agent_cpu.measure(args.rate, args.duration, args.profile).markdown())
    if args.command == "handler-cpu":
        if args.instructions:
            per_request = handler_cpu.instructions(
                args.requests, args.batch, args.streamed, args.config_file, args.kv_events, args.evict_mb, args.tracing
            )
            fetched = (
                f"; from beyond a 1 MiB cache after {args.evict_mb} MiB written before each read: "
                f"{per_request['ILmr']:,.0f} lines of code, {per_request['DLmr']:,.0f} of data read and "
                f"{per_request['DLmw']:,.0f} written"
                if args.evict_mb
                else ""
            )
            print(
                f"EPP handler path: {per_request['Ir']:,.0f} instructions per request{fetched} (callgrind; the "
                "harness's own building of the requests taken off)"
            )
        else:
            config = args.config_file.read_text() if args.config_file else handler_cpu.DEFAULT_CONFIG
            result = handler_cpu.measure(
                args.requests,
                args.batch,
                args.rounds,
                args.streamed,
                config,
                args.evict_mb,
                args.kv_events,
                tracing=args.tracing,
            )
            print(result.markdown())
    if args.command == "overhead" and args.pin:
        try:
            overhead.split_cpus(os.sched_getaffinity(0))  # refused now, not after the pool has started
        except ValueError as error:
            parser.error(f"--pin: {error}")
    if args.command == "overhead" and args.against is not None:
        if args.pairs < 1:
            parser.error("--pairs must be at least 1")
        if args.epp_config or args.epp_flags or args.rounds != 1:
            parser.error(
                "--against compares the two builds' defaults in --pairs runs: leave out --epp-config, --epp-flags and "
                "--rounds"
            )
        other = args.against.resolve()
        try:
            overhead.build_environment(other)  # refused now, not after the pool has started
        except (ValueError, subprocess.CalledProcessError) as error:
            parser.error(f"--against {args.against}: {error}")
        comparison = asyncio.run(
            overhead.compare_builds(
                other,
                args.pairs,
                args.servers,
                args.sequential,
                args.concurrency,
                args.requests,
                args.ext_proc_transport,
                args.streamed,
                args.pin,
            )
        )
        report = comparison.markdown()
        print(report)
        written = []
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            runs = [overhead.as_dict(run) for run in comparison.runs]
            written = [args.out / "builds.json", args.out / "builds.md"]
            written[0].write_text(json.dumps({"other": comparison.other, "runs": runs}, indent=2))
            written[1].write_text(report + "\n")
        say_written(written, "" if written else "--out DIR keeps the report")
    elif args.command == "overhead":
        epp_configs = {}
        for path in args.epp_config:
            if path.stem in epp_configs:
                parser.error(f"--epp-config: two files named {path.stem}")
            try:
                epp_configs[path.stem] = path.read_text()
                Scheduler.from_config(epp_configs[path.stem])  # refused now, not after the pool has started
            except (OSError, ConfigError) as error:
                parser.error(f"--epp-config {path}: {error}")
        result = asyncio.run(
            overhead.measure(
                args.servers,
                args.sequential,
                args.concurrency,
                args.requests,
                transport=args.ext_proc_transport,
                streamed=args.streamed,
                epp_configs=epp_configs,
                pin=args.pin,
                epp_flags=[shlex.split(flags) for flags in args.epp_flags],
                epp_replicas=args.epp_replicas,
                rounds=args.rounds,
            )
        )
        report = result.markdown()
        print(report)
        written = []
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            written = [args.out / "overhead.json", args.out / "overhead.md"]
            written[0].write_text(json.dumps(overhead.as_dict(result), indent=2))
            written[1].write_text(report + "\n")
        say_written(written, "" if written else "--out DIR keeps the report")


if __name__ == "__main__":
    main()
