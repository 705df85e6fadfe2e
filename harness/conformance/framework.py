"""A small check runner: named checks with a MUST/SHOULD level, run in order against one target, each PASS, FAIL
or SKIP with a reason. Used by the console script and by the pytest plugin."""

from __future__ import annotations

import asyncio
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Level(StrEnum):
    MUST = "MUST"
    SHOULD = "SHOULD"


class Outcome(StrEnum):
    PASS = "PASS"
    FAIL = "FAIL"
    SKIP = "SKIP"


class Skip(Exception):
    """Raised by a check that does not apply to this target (e.g. no LoRA adapter given)."""


class CheckFailed(AssertionError):
    pass


def expect(condition: Any, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


@dataclass(frozen=True)
class Check:
    name: str
    level: Level
    description: str
    run: Callable[[Any], Awaitable[None]]
    profile: str  # the report's profile the check belongs to (its suite's name unless it says otherwise)


@dataclass
class Result:
    check: Check
    outcome: Outcome
    message: str = ""
    seconds: float = 0.0


@dataclass
class Suite:
    name: str
    checks: list[Check] = field(default_factory=list)

    def check(self, name: str, level: Level, description: str, profile: str | None = None):
        def register(fn: Callable[[Any], Awaitable[None]]):
            self.checks.append(Check(name, level, description, fn, profile or self.name))
            return fn

        return register

    async def run_one(self, check: Check, context: Any, timeout: float = 120.0) -> Result:
        started = time.monotonic()
        try:
            await asyncio.wait_for(check.run(context), timeout)
            outcome, message = Outcome.PASS, ""
        except Skip as skip:
            outcome, message = Outcome.SKIP, str(skip)
        except CheckFailed as failure:
            outcome, message = Outcome.FAIL, str(failure)
        except TimeoutError:
            outcome, message = Outcome.FAIL, f"timed out after {timeout:.0f}s"
        except Exception as exc:  # a target that breaks the client fails the check, never the runner
            outcome, message = Outcome.FAIL, f"{type(exc).__name__}: {exc}"
            if not str(exc):
                message += " " + traceback.format_exc(limit=2)
        return Result(check, outcome, message, time.monotonic() - started)

    async def run(self, context: Any, selected: set[str] | None = None, on_result=None) -> list[Result]:
        results = []
        for check in self.checks:
            if selected and check.name not in selected:
                continue
            result = await self.run_one(check, context)
            results.append(result)
            if on_result is not None:
                on_result(result)
        return results
