"""A report in the shape of the Gateway API Inference Extension's ConformanceReport (its conformance suite writes
Gateway API's `ConformanceReport` with `GatewayAPIInferenceExtensionVersion` beside it): top-level version fields,
`implementation`, and one entry of `profiles` per profile, each with a `summary`, its `core` tests (our MUST checks)
and, when it has any, its `extended` tests (our SHOULD checks), each part with result (success, partial when tests
were skipped and none failed, failure), statistics, failedTests and skippedTests, as upstream computes them.
`target` and `details` (per check: level, result, message, seconds) are our additions; a reader that knows only
upstream's fields can ignore them."""

from __future__ import annotations

import datetime
from dataclasses import asdict, dataclass, field

from harness.conformance.framework import Level, Outcome, Result

# The upstream releases whose protocol each suite checks (Model Server Protocol; the gateway's v1.6 tests).
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
    result = "failure" if stats[Outcome.FAIL] else "partial" if stats[Outcome.SKIP] else "success"
    part = {
        "result": result,
        "statistics": {"Failed": stats[Outcome.FAIL], "Passed": stats[Outcome.PASS], "Skipped": stats[Outcome.SKIP]},
    }
    if stats[Outcome.FAIL]:
        part["failedTests"] = [r.check.name for r in results if r.outcome is Outcome.FAIL]
    if stats[Outcome.SKIP]:
        part["skippedTests"] = [r.check.name for r in results if r.outcome is Outcome.SKIP]
    return part


def _said(part: dict) -> str:
    if part["result"] == "failure":
        return f"failed with {part['statistics']['Failed']} test failures"
    if part["result"] == "partial":
        return f"partially succeeded with {part['statistics']['Skipped']} test skips"
    return "succeeded"


def _profile(name: str, results: list[Result], target: str) -> dict:
    core = _part([r for r in results if r.check.level is Level.MUST])
    should = [r for r in results if r.check.level is Level.SHOULD]
    profile = {"core": core}
    summary = f"Core tests {_said(core)}"
    if should:
        profile["extended"] = _part(should)
        summary += f". Extended tests {_said(profile['extended'])}"
    profile |= {
        "name": name,
        "summary": summary + ".",
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
    return profile


def conformance_report(
    results: list[Result],
    implementation: Implementation,
    target: str,
    inference_extension_version: str = INFERENCE_EXTENSION_VERSION,
    gateway_api_version: str = GATEWAY_API_VERSION,
) -> dict:
    """The report of `results`, one profile per `check.profile` in the order the checks ran."""
    profiles: dict[str, list[Result]] = {}
    for r in results:
        profiles.setdefault(r.check.profile, []).append(r)
    return {
        "GatewayAPIInferenceExtensionVersion": inference_extension_version,
        "apiVersion": "gateway.networking.k8s.io/v1",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "gatewayAPIChannel": "standard",
        "gatewayAPIVersion": gateway_api_version,
        "implementation": {k: v for k, v in asdict(implementation).items() if v},
        "kind": "ConformanceReport",
        "mode": "default",
        "profiles": [_profile(name, rs, target) for name, rs in profiles.items()],
    }
