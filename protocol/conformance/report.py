"""A report shaped like the Gateway API Inference Extension's ConformanceReport: MUST checks are the profile's
core, SHOULD checks its extended part."""

from __future__ import annotations

import datetime

from protocol.conformance.framework import Level, Outcome, Result


def _part(results: list[Result]) -> dict:
    stats = {o: sum(1 for r in results if r.outcome is o) for o in Outcome}
    return {
        "result": "failure" if stats[Outcome.FAIL] else ("skipped" if not stats[Outcome.PASS] else "success"),
        "statistics": {"Passed": stats[Outcome.PASS], "Failed": stats[Outcome.FAIL], "Skipped": stats[Outcome.SKIP]},
        "failedTests": [r.check.name for r in results if r.outcome is Outcome.FAIL],
        "skippedTests": [r.check.name for r in results if r.outcome is Outcome.SKIP],
    }


def conformance_report(profile: str, results: list[Result], implementation: dict, url: str) -> dict:
    return {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "ConformanceReport",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "implementation": implementation,
        "mode": "default",
        "target": url,
        "profiles": [
            {
                "name": profile,
                "core": _part([r for r in results if r.check.level is Level.MUST]),
                "extended": _part([r for r in results if r.check.level is Level.SHOULD]),
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
