"""pytest entry for the Model Server Protocol suite (see protocol.conformance.pytest_plugin)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from protocol.conformance.framework import Level, Outcome
from protocol.conformance.msp import Target, default_model, suite


@pytest.mark.parametrize("check", suite.checks, ids=[c.name for c in suite.checks])
def test_model_server_protocol(request, check):
    url = request.config.getoption("--msp-url", default=None)
    if not url:
        pytest.skip("no --msp-url given")

    async def run():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            model = request.config.getoption("--msp-model") or await default_model(session, url.rstrip("/"))
            target = Target(url.rstrip("/"), model, request.config.getoption("--msp-engine"),
                            request.config.getoption("--msp-lora-adapter"), session=session)  # fmt: skip
            return await suite.run_one(check, target)

    result = asyncio.run(run())
    if result.outcome is Outcome.SKIP:
        pytest.skip(result.message)
    if result.outcome is Outcome.FAIL:
        if check.level is Level.SHOULD:
            pytest.xfail(f"SHOULD: {result.message}")
        pytest.fail(f"MUST: {result.message}")
