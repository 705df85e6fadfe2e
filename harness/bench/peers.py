"""The peer routers from PyPI (the `[bench]` extra): sglang-router and vllm-router, started on loopback."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from pathlib import Path

import aiohttp

from harness.bench.ports import free_ports


def peer_command(kind: str) -> list[str] | None:
    """The router's command line start, from this environment or PATH; None when not installed."""
    if kind == "sglang":
        try:
            import sglang_router  # noqa: F401

            return [sys.executable, "-m", "sglang_router.launch_router"]
        except ImportError:
            path = shutil.which("sglang-router")
            return [path] if path else None
    path = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
    return [path] if Path(path).exists() else None


async def start_router(
    kind: str,
    policy: str,
    worker_urls: list[str],
    workdir: Path,
    model: str,
    timeout: float = 60.0,
    extra_args: list[str] = (),
) -> tuple[subprocess.Popen, str]:
    """Start a router bound to 127.0.0.1 (its HTTP and Prometheus ports) and wait until it serves a completion."""
    port, prometheus_port = free_ports(2)
    log = (workdir / f"{kind}-{policy}.log").open("ab")
    process = subprocess.Popen(
        [
            *peer_command(kind),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--policy",
            policy,
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(prometheus_port),
            *extra_args,
            "--worker-urls",
            *worker_urls,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    log.close()
    url = f"http://127.0.0.1:{port}"
    deadline = asyncio.get_running_loop().time() + timeout
    async with aiohttp.ClientSession() as session:
        while asyncio.get_running_loop().time() < deadline and process.poll() is None:
            try:
                body = {"model": model, "prompt": "warm up", "max_tokens": 1}
                async with session.post(f"{url}/v1/completions", json=body) as r:
                    if r.status == 200:
                        return process, url
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    process.kill()
    process.wait()
    raise RuntimeError(f"{kind}-router did not come up; see {workdir}")
