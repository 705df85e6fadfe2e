"""`msp-conformance`: check a model server against the Model Server Protocol the EPP relies on.

    msp-conformance --url http://host:8000 [--model NAME] [--lora-adapter A [--lora-adapter B]]
                    [--engine vllm|sglang|trtllm-serve|triton-tensorrt-llm] [--report report.yaml] [--only NAME ...]
                    [--kv-events-endpoint tcp://host:5557 | --kv-events-bind tcp://127.0.0.1:5557]
                    [--kv-replay-endpoint tcp://host:5558] [--kv-hash-seed SEED] [--kv-hash-algo sha256|sha256_cbor]

Checks a model server (and, given where its vLLM KV events are published, those events). Prints one line per check (PASS / FAIL / SKIP, with its MUST or SHOULD level) and exits 1 if
a MUST check failed. The gateway data-path suite runs our EPP, so it lives with it: `gateway-conformance`
(`harness/conformance/`).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import yaml

from harness.conformance.framework import Level, Outcome, Result
from harness.conformance.msp import KVEventsTarget, Target, default_model, open_session, served_adapters, suite
from harness.conformance.report import Implementation, conformance_report
from protocol.kv_events import DEFAULT_HASH_ALGO, HASH_ALGOS
from protocol.metrics import ENGINES


async def run(args: argparse.Namespace) -> list[Result]:
    async with open_session() as session:
        model = args.model or await default_model(session, args.url)
        adapters = args.lora_adapter or await served_adapters(session, args.url, model)
        target = Target(
            args.url.rstrip("/"), model, args.engine, adapters, args.load_requests, session, kv_events_target(args)
        )

        print(f"Model Server Protocol conformance: {args.url} (model {model!r}, engine {args.engine})")
        return await suite.run(target, set(args.only) if args.only else None, show)


def kv_events_target(args: argparse.Namespace) -> KVEventsTarget | None:
    if args.kv_events_endpoint and args.kv_events_bind:
        raise SystemExit("give --kv-events-endpoint or --kv-events-bind, not both")
    endpoint = args.kv_events_endpoint or args.kv_events_bind
    if not endpoint:
        return None
    return KVEventsTarget(
        endpoint,
        bind=bool(args.kv_events_bind),
        replay_endpoint=args.kv_replay_endpoint,
        topic=args.kv_events_topic,
        hash_seed=args.kv_hash_seed,
        hash_algo=args.kv_hash_algo,
    )


def kv_events_options(add, prefix: str = "") -> None:
    """Declare the KV event options with `add` (argparse's add_argument or pytest's addoption; `prefix`: the pytest
    plugin's "msp-")."""
    add(f"--{prefix}kv-events-endpoint", default=None, help="connect to the server's KV event PUB socket here")
    add(
        f"--{prefix}kv-events-bind",
        default=None,
        help="bind a SUB socket here; the server's --kv-events-config endpoint connects to it",
    )
    add(f"--{prefix}kv-replay-endpoint", default=None, help="the server's KV event replay (ROUTER) endpoint")
    add(f"--{prefix}kv-events-topic", default="", help="subscribe to topics starting with this (default: all)")
    add(f"--{prefix}kv-hash-seed", default=None, help="the server's PYTHONHASHSEED (checks block hashes exactly)")
    add(f"--{prefix}kv-hash-algo", default=DEFAULT_HASH_ALGO, choices=HASH_ALGOS, help="its --prefix-caching-hash-algo")


def show(result: Result) -> None:
    note = f" — {result.message}" if result.message else ""
    print(f"{result.outcome:<4} {result.check.level:<6} {result.check.name}{note}", flush=True)


def finish(args: argparse.Namespace, results: list[Result], target: str, **versions: str) -> None:
    """Print the totals, write the report (`versions`: conformance_report's version fields) and exit: 1 when a MUST
    check failed."""
    counts = {o: sum(1 for r in results if r.outcome is o) for o in Outcome}
    print(f"{counts[Outcome.PASS]} passed, {counts[Outcome.FAIL]} failed, {counts[Outcome.SKIP]} skipped")
    if args.report:
        implementation = Implementation(
            args.organization, args.project, args.implementation_url, args.version, args.contact
        )
        report = conformance_report(results, implementation, target, **versions)
        args.report.write_text(yaml.safe_dump(report, sort_keys=False))
    must_failed = any(r.outcome is Outcome.FAIL and r.check.level is Level.MUST for r in results)
    sys.exit(1 if must_failed else 0)


def report_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--only", nargs="*", help="run only these checks")
    p.add_argument("--report", type=Path, help="write a ConformanceReport YAML here")
    g = p.add_argument_group("implementation under test (report fields)")
    g.add_argument("--organization", default="unknown")
    g.add_argument("--project", default="unknown")
    g.add_argument("--implementation-url", default="", help="the project's home page")
    g.add_argument("--version", default="unknown")
    g.add_argument("--contact", action="append", default=[])


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(
        prog="msp-conformance", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--url", required=True, help="base URL of the model server")
    p.add_argument("--model", help="model name to request (default: the first base model of /v1/models)")
    p.add_argument("--lora-adapter", action="append", default=[], help="a LoRA adapter the server serves (repeat)")
    p.add_argument("--engine", choices=sorted(ENGINES), default="vllm", help="which metric names to expect")
    p.add_argument(
        "--load-requests",
        type=int,
        default=32,
        help="concurrent long requests that first load the server (then 4x, up to 64x, until requests queue)",
    )
    kv_events_options(p.add_argument_group("KV cache events").add_argument)
    report_options(p)
    args = p.parse_args(argv)
    results = asyncio.run(run(args))
    finish(args, results, args.url)
