"""`gateway-conformance`: check a gateway's data path against the Endpoint Picker Protocol and the Gateway API
Inference Extension's v1.6 Gateway-profile conformance tests (what one gateway without Kubernetes can show).

    gateway-conformance [--envoy-template BOOTSTRAP.tmpl] [--workdir DIR] [--report report.yaml] [--only NAME ...]

Real Envoys from our bootstrap template or yours (one per InferencePool: FailClose, FailOpen, h2c, a missing EPP),
our EPP in test mode and echo model servers, all on loopback. Prints one line per check (PASS / FAIL / SKIP, with
its MUST or SHOULD level) and exits 1 if a MUST check failed. The report (--report) is a ConformanceReport with two
profiles: `Gateway` (upstream's 14 tests by name; those that need a Gateway API implementation and a cluster are
skipped, each saying why) and `GatewayDataPath` (the cases upstream misses).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from harness.conformance import gateway
from harness.conformance.cli import finish, report_options, show
from harness.conformance.framework import Result
from harness.envoy import TEMPLATE


async def run(args: argparse.Namespace) -> list[Result]:
    target = gateway.Gateway(envoy_template=args.envoy_template)
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
        target.workdir = args.workdir
    print(f"Gateway conformance: Envoy bootstrap {args.envoy_template} (logs in {target.workdir})")
    try:
        await target.start()
        return await gateway.suite.run(target, set(args.only) if args.only else None, show)
    finally:
        await target.stop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="gateway-conformance", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--envoy-template", type=Path, default=TEMPLATE, help="Envoy bootstrap template to test")
    p.add_argument(
        "--workdir", type=Path, help="where the Envoy, EPP and pool files and logs go (default: a new temp dir)"
    )
    report_options(p)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    results = asyncio.run(run(args))
    finish(
        args,
        results,
        str(args.envoy_template),
        inference_extension_version=gateway.INFERENCE_EXTENSION_VERSION,
        gateway_api_version=gateway.GATEWAY_API_VERSION,
    )


if __name__ == "__main__":
    main()
