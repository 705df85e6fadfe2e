"""What an idle EPP costs as the pool grows: CPU of the EPP process while it only scrapes N endpoints.

Every endpoint serves the same page, captured once from a real sim model server, from one static HTTP/1.1 server
process (it answers from memory, so the pool's side stays cheap even at 256 endpoints and the 2-core machine is not
the limit). The EPP is started with a pool file over those endpoints and its default scrape interval; after a
warm-up its CPU seconds are read from /proc over a window, beside the scrapes the pages' server actually answered
(so a slower EPP that falls behind its interval shows up as fewer scrapes per endpoint, not as a saving).

With `busy`, the page says one request is running on every endpoint and the EPP's quiet interval is off: the cost
of scraping a pool while this EPP has traffic, when every endpoint is scraped at the fast interval
(epp/datalayer/scraper.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

from harness.bench.overhead import cpu_seconds
from harness.bench.ports import free_port_block, free_ports
from harness.local import epp_command, python_module, wait_until_serving
from protocol.metrics import DEFAULT_ENGINE, ENGINES, sample_filter_query


@dataclass
class IdleResult:
    endpoints: int
    seconds: float
    epp_cpu_seconds: float
    scrapes: int
    interval_ms: float

    @property
    def core_percent(self) -> float:
        return 100 * self.epp_cpu_seconds / self.seconds

    @property
    def scrapes_per_endpoint_per_second(self) -> float:
        return self.scrapes / self.endpoints / self.seconds

    @property
    def cpu_us_per_scrape(self) -> float:
        return 1e6 * self.epp_cpu_seconds / max(1, self.scrapes)


class _PageProtocol(asyncio.Protocol):
    """Answers each GET on a keep-alive connection with the page captured for its target (the whole page for any
    target when only that was captured: a server that ignores the sample filter); counts them."""

    def __init__(self, responses: dict[bytes, bytes], counter: list[int]):
        self.responses = responses
        self.counter = counter
        self.buffer = b""

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            target = self.buffer.split(b" ", 2)[1]
            self.buffer = self.buffer[end + 4 :]
            self.counter[0] += 1
            self.transport.write(self.responses.get(target) or self.responses.get(b"*") or NOT_FOUND)


NOT_FOUND = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"


def _response(page: bytes) -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: %d\r\n\r\n" % len(page) + page
    )


async def _serve(pages: dict[str, str], host: str, base_port: int, count: int) -> None:
    responses = {target.encode(): _response(page.encode()) for target, page in pages.items()}
    counter = [0]
    loop = asyncio.get_running_loop()
    servers = [
        await loop.create_server(lambda: _PageProtocol(responses, counter), host, base_port + i) for i in range(count)
    ]
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGUSR1, lambda: print(counter[0], flush=True))
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    print("ready", flush=True)
    await stop.wait()
    for server in servers:
        server.close()


FILTERED_TARGET = f"/metrics?{sample_filter_query(ENGINES[DEFAULT_ENGINE].sample_names())}"  # what the EPP asks for


def capture_sim_pages(workdir: Path) -> dict[str, str]:
    """The /metrics page of a freshly started sim model server (one request served, so every family has samples),
    whole and as the EPP's scraper asks for it (`FILTERED_TARGET`), by target."""
    (port,) = free_ports(1)
    log = (workdir / "modelserver.log").open("wb")
    process = subprocess.Popen(
        [*python_module("modelserver"), "--port", str(port), "--disable-log-stats"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1).read()
                break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError(f"sim model server did not start; see {workdir / 'modelserver.log'}") from None
                time.sleep(0.2)
        body = b'{"model": "sim-llama-8b", "prompt": "hello", "max_tokens": 2}'
        request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=30).read()
        return {
            target: urllib.request.urlopen(f"{url}{target}", timeout=5).read().decode()
            for target in ("/metrics", FILTERED_TARGET)
        }
    finally:
        process.terminate()
        process.wait(10)
        log.close()


def _read_line(process: subprocess.Popen, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    line = process.stdout.readline()
    if not line and time.monotonic() > deadline:
        raise RuntimeError("no answer from the page server")
    return line.strip()


def measure(
    counts: list[int],
    seconds: float = 10.0,
    warmup: float = 3.0,
    epp_args: list[str] | None = None,
    progress=print,
    busy: bool = False,
    whole_pages: bool = False,
) -> list[IdleResult]:
    """`whole_pages`: the page server ignores the scraper's sample filter and sends every scrape the whole page,
    as a server without prometheus_client's `name[]` support would (and as every scrape was before the filter)."""
    results = []
    with tempfile.TemporaryDirectory(prefix="epp-idle-") as tmp:
        workdir = Path(tmp)
        pages = capture_sim_pages(workdir)
        if busy:
            pages = {
                target: re.sub(r"^(vllm:num_requests_running\S*) 0\.0$", r"\1 1.0", page, flags=re.M)
                for target, page in pages.items()
            }
        if whole_pages:
            pages = {"*": pages["/metrics"]}
        (workdir / "pages.json").write_text(json.dumps(pages))
        progress(
            "sim /metrics page: "
            + ", ".join(
                f"{len(page)} bytes {'whole' if '?' not in target else 'filtered'}" for target, page in pages.items()
            )
        )
        for count in counts:
            base = free_port_block(count)
            grpc, health, metrics = free_ports(3)
            server = subprocess.Popen(
                [
                    *python_module("harness.bench.idle"),
                    "serve",
                    str(workdir / "pages.json"),
                    str(base),
                    str(count),
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            epp = None
            try:
                if _read_line(server, 30) != "ready":
                    raise RuntimeError("page server failed")
                pool = workdir / f"pool-{count}.yaml"
                endpoints = [{"name": f"ep-{i}", "address": "127.0.0.1", "port": base + i} for i in range(count)]
                pool.write_text(yaml.safe_dump({"endpoints": endpoints}))
                log = (workdir / f"epp-{count}.log").open("wb")
                extra = list(epp_args or ())
                if busy:  # an idle interval at or below the refresh interval turns the quiet interval off
                    extra.append("--refresh-metrics-idle-interval=1ms")
                argv = epp_command(str(pool), "127.0.0.1", grpc, health, metrics, 0, extra)
                epp = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
                log.close()
                wait_until_serving(epp, f"http://127.0.0.1:{metrics}/metrics", workdir / f"epp-{count}.log")
                time.sleep(warmup)  # counted from the EPP serving (its start-up, slow on a loaded host, is not idle)
                if epp.poll() is not None:
                    raise RuntimeError(f"epp exited; see {workdir / f'epp-{count}.log'}")
                server.send_signal(signal.SIGUSR1)
                scrapes_before = int(_read_line(server, 5))
                cpu_before, started = cpu_seconds(epp.pid), time.monotonic()
                time.sleep(seconds)
                server.send_signal(signal.SIGUSR1)
                scrapes = int(_read_line(server, 5)) - scrapes_before
                elapsed = time.monotonic() - started
                cpu = cpu_seconds(epp.pid) - cpu_before
                result = IdleResult(count, elapsed, cpu, scrapes, 0.0)
                result.interval_ms = 1e3 / max(1e-9, result.scrapes_per_endpoint_per_second)
                results.append(result)
                progress(
                    f"{count} endpoints: EPP {result.core_percent:.1f} % of a core, "
                    f"{result.cpu_us_per_scrape:.0f} µs CPU per scrape, one scrape per endpoint every "
                    f"{result.interval_ms:.0f} ms"
                )
            finally:
                for process in (epp, server):
                    if process is not None and process.poll() is None:
                        process.terminate()
                        with contextlib.suppress(subprocess.TimeoutExpired):
                            process.wait(10)
                        if process.poll() is None:
                            process.kill()
    return results


def markdown(results: list[IdleResult]) -> str:
    lines = [
        f"host load (1/5/15 min): {' '.join(f'{v:.2f}' for v in os.getloadavg())}",
        "",
        "| endpoints | EPP % of a core | CPU µs per scrape | scrape interval achieved ms |",
        "| --- | --- | --- | --- |",
    ]
    for r in results:
        lines.append(f"| {r.endpoints} | {r.core_percent:.1f} | {r.cpu_us_per_scrape:.0f} | {r.interval_ms:.0f} |")
    return "\n".join(lines)


def _main() -> None:
    parser = argparse.ArgumentParser(prog="python -m harness.bench.idle")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="(internal) serve the pages (JSON: target -> page) on COUNT consecutive ports")
    serve.add_argument("pages", type=Path)
    serve.add_argument("base_port", type=int)
    serve.add_argument("count", type=int)
    args = parser.parse_args()
    asyncio.run(_serve(json.loads(args.pages.read_text()), "127.0.0.1", args.base_port, args.count))


if __name__ == "__main__":
    _main()
