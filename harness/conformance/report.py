"""A report shaped like the Gateway API Inference Extension's ConformanceReport (conformance/reports/ upstream):
top-level version fields, `implementation`, and one profile whose `core` holds the MUST checks and `extended` the
SHOULD checks, each with result, statistics, failedTests and skippedTests. `details` (per-check message and time)
is our addition; a reader that knows only upstream's fields can ignore it."""

from __future__ import annotations

import datetime
from dataclasses import asdict, dataclass, field

from harness.conformance.framework import Level, Outcome, Result

# The upstream release whose protocol (Model Server Protocol, Endpoint Picker Protocol, InferencePool v1) we check.
INFERENCE_EXTENSION_VERSION = "v1.0.0"
GATEWAY_API_VERSION = "v1.3.0"


@dataclass
class Implementation:
    """Who is under test, as upstream's report names it (flags --organization, --project, --url, --version,
    --contact of the console script)."""

    organization: str = "unknown"
    project: str = "unknown"
    url: str = ""
    version: str = "unknown"
    contact: list[str] = field(default_factory=list)


def _part(results: list[Result]) -> dict:
    stats = {o: sum(1 for r in results if r.outcome is o) for o in Outcome}
    part = {
        "result": "failure" if stats[Outcome.FAIL] else ("skipped" if not stats[Outcome.PASS] else "success"),
        "statistics": {"Failed": stats[Outcome.FAIL], "Passed": stats[Outcome.PASS], "Skipped": stats[Outcome.SKIP]},
    }
    if stats[Outcome.FAIL]:
        part["failedTests"] = [r.check.name for r in results if r.outcome is Outcome.FAIL]
    if stats[Outcome.SKIP]:
        part["skippedTests"] = [r.check.name for r in results if r.outcome is Outcome.SKIP]
    return part


def _summary(core: dict, extended: dict) -> str:
    failed = core["statistics"]["Failed"]
    text = f"Core tests failed with {failed} test failures." if failed else "Core tests succeeded."
    if extended["statistics"]["Failed"]:
        text += f" Extended tests failed with {extended['statistics']['Failed']} test failures."
    elif extended["statistics"]["Passed"]:
        text += " Extended tests succeeded."
    return text


def conformance_report(profile: str, results: list[Result], implementation: Implementation, target: str) -> dict:
    core = _part([r for r in results if r.check.level is Level.MUST])
    extended = _part([r for r in results if r.check.level is Level.SHOULD])
    return {
        "GatewayAPIInferenceExtensionVersion": INFERENCE_EXTENSION_VERSION,
        "apiVersion": "gateway.networking.k8s.io/v1",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "gatewayAPIChannel": "standard",
        "gatewayAPIVersion": GATEWAY_API_VERSION,
        "implementation": {k: v for k, v in asdict(implementation).items() if v},
        "kind": "ConformanceReport",
        "mode": "default",
        "profiles": [
            {
                "core": core,
                "extended": extended,
                "name": profile,
                "summary": _summary(core, extended),
                "target": target,
                "details": [
                    {
                        "name": r.check.name,
                        "level": str(r.check.level),
                        "result": str(r.outcome),
                        "message": r.message,
                        "seconds": round(r.seconds, 3),
                    }
                    for r in results
                ],
            }
        ],
    }
