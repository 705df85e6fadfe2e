"""`msp-conformance`: check a model server against the Model Server Protocol the EPP relies on.

    msp-conformance --url http://host:8000 [--model NAME] [--lora-adapter A [--lora-adapter B]]
                    [--engine vllm|sglang|trtllm-serve|triton-tensorrt-llm] [--report report.yaml] [--only NAME ...]

Checks a model server. Prints one line per check (PASS / FAIL / SKIP, with its MUST or SHOULD level) and exits 1 if
a MUST check failed. The gateway data-path suite runs our EPP, so it lives with it: `gateway-conformance`
(`epp/conformance/`).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import yaml

from protocol.conformance.framework import Level, Outcome, Result
from protocol.conformance.msp import Target, default_model, open_session, served_adapters, suite
from protocol.conformance.report import Implementation, conformance_report
from protocol.metrics import ENGINES


async def run(args: argparse.Namespace) -> list[Result]:
    async with open_session() as session:
        model = args.model or await default_model(session, args.url)
        adapters = args.lora_adapter or await served_adapters(session, args.url, model)
        target = Target(args.url.rstrip("/"), model, args.engine, adapters, args.load_requests, session)

        print(f"Model Server Protocol conformance: {args.url} (model {model!r}, engine {args.engine})")
        return await suite.run(target, set(args.only) if args.only else None, show)


def show(result: Result) -> None:
    note = f" — {result.message}" if result.message else ""
    print(f"{result.outcome:<4} {result.check.level:<6} {result.check.name}{note}", flush=True)


def finish(args: argparse.Namespace, suite_name: str, results: list[Result], target: str) -> None:
    counts = {o: sum(1 for r in results if r.outcome is o) for o in Outcome}
    print(f"{counts[Outcome.PASS]} passed, {counts[Outcome.FAIL]} failed, {counts[Outcome.SKIP]} skipped")
    if args.report:
        implementation = Implementation(
            args.organization, args.project, args.implementation_url, args.version, args.contact
        )
        report = conformance_report(suite_name, results, implementation, target)
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
    report_options(p)
    args = p.parse_args(argv)
    results = asyncio.run(run(args))
    finish(args, suite.name, results, args.url)
