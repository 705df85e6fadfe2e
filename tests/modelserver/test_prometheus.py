"""Our /metrics page passes `promtool check metrics`, a real Prometheus scrapes it, and --replicas serves N
independent servers from one process."""

import asyncio
import shutil
import subprocess
import sys
import time

import aiohttp
import pytest
import yaml

from tests.conftest import free_port_block, free_ports
from tests.modelserver.conftest import MODEL

pytestmark = pytest.mark.skipif(
    shutil.which("promtool") is None or shutil.which("prometheus") is None,
    reason="Debian's prometheus package (promtool, prometheus) is not installed; `make test` installs it",
)


# promtool's naming lint flags every `vllm:` name (colons are meant for recording rules) and vLLM's own histogram
# `vllm:iteration_tokens_total`; both names are fixed by vLLM's metrics design, which the EPP and dashboards read.
INHERENT_TO_VLLM_NAMES = ("metric names should not contain ':'", 'non-counter metrics should not have "_total" suffix')


async def test_promtool_finds_nothing_beyond_vllm_naming(model_server):
    async with aiohttp.ClientSession() as session:
        await session.post(f"{model_server.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        async with session.get(f"{model_server.url}/metrics") as r:
            page = await r.read()
    result = subprocess.run(["promtool", "check", "metrics"], input=page, capture_output=True, timeout=30)
    findings = [line for line in (result.stdout + result.stderr).decode().splitlines() if line.strip()]
    assert findings, "promtool ran"
    other = [f for f in findings if not f.endswith(INHERENT_TO_VLLM_NAMES)]
    assert other == []
    total_suffix = [f for f in findings if f.endswith(INHERENT_TO_VLLM_NAMES[1])]
    assert total_suffix == ['vllm:iteration_tokens_total non-counter metrics should not have "_total" suffix']


async def test_real_prometheus_scrapes_replicas(tmp_path):
    base = free_port_block(2)
    server = subprocess.Popen(
        [sys.executable, "-m", "modelserver", "--port", str(base), "--replicas", "2", "--disable-log-stats"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    (prom_port,) = free_ports(1)
    config = {
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [
            {"job_name": "modelserver", "static_configs": [{"targets": [f"127.0.0.1:{base}", f"127.0.0.1:{base + 1}"]}]}
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    prometheus = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        lines = [server.stdout.readline().decode() for _ in range(2)]
        assert lines == [f"ready on http://127.0.0.1:{base}\n", f"ready on http://127.0.0.1:{base + 1}\n"]
        async with aiohttp.ClientSession() as session:
            async with session.post(
                f"http://127.0.0.1:{base + 1}/v1/completions",
                json={"model": "sim-llama-8b", "prompt": "x", "max_tokens": 3},
            ) as r:
                assert r.status == 200
            deadline = time.monotonic() + 60
            query = f"http://127.0.0.1:{prom_port}/api/v1/query"
            while True:
                try:
                    async with session.get(
                        query, params={"query": "sum(vllm:generation_tokens_total) by (instance)"}
                    ) as r:
                        result = (await r.json())["data"]["result"] if r.status == 200 else []
                except aiohttp.ClientError:
                    result = []
                by_instance = {s["metric"]["instance"]: float(s["value"][1]) for s in result}
                # each replica has its own engine and registry: only the second one generated tokens (a scrape can
                # land before the engine's stats of the last step are out: the next one has them)
                if by_instance == {f"127.0.0.1:{base}": 0.0, f"127.0.0.1:{base + 1}": 3.0}:
                    break
                assert time.monotonic() < deadline, f"Prometheus did not scrape both replicas' counts: {by_instance}"
                await asyncio.sleep(0.5)
    finally:
        for process in (prometheus, server):
            process.terminate()
            process.wait(10)
