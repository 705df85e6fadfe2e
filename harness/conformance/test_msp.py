"""pytest entry for the Model Server Protocol suite (see harness.conformance.pytest_plugin)."""

from __future__ import annotations

import asyncio

import pytest

from harness.conformance.cli import kv_events_target
from harness.conformance.framework import Level, Outcome
from harness.conformance.msp import Target, default_model, open_session, served_adapters, suite


@pytest.mark.parametrize("check", suite.checks, ids=[c.name for c in suite.checks])
def test_model_server_protocol(request, check):
    url = request.config.getoption("--msp-url", default=None)
    if not url:
        pytest.skip("no --msp-url given")

    async def run():
        async with open_session() as session:
            base = url.rstrip("/")
            model = request.config.getoption("--msp-model") or await default_model(session, base)
            adapters = request.config.getoption("--msp-lora-adapter") or await served_adapters(session, base, model)
            target = Target(
                base,
                model,
                request.config.getoption("--msp-engine"),
                adapters,
                request.config.getoption("--msp-load-requests"),
                session=session,
                kv=kv_events_target(_KVOptions(request.config)),
            )
            return await suite.run_one(check, target)

    result = asyncio.run(run())
    if result.outcome is Outcome.SKIP:
        pytest.skip(result.message)
    if result.outcome is Outcome.FAIL:
        if check.level is Level.SHOULD:
            pytest.xfail(f"SHOULD: {result.message}")
        pytest.fail(f"MUST: {result.message}")


class _KVOptions:
    """The plugin's --msp-kv-* options under msp-conformance's names."""

    def __init__(self, config):
        self._config = config

    def __getattr__(self, name: str):
        return self._config.getoption(f"--msp-{name.replace('_', '-')}")
