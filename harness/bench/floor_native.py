"""The native floor: harness/bench/floor.py's processor in C (floor_native.c: HTTP/2 and gRPC by hand, one thread,
epoll), sending byte for byte the same answers, so that beside plain Envoy it shows what Envoy's ext_proc mechanism
costs with a processor that costs next to nothing.

It is compiled on demand into the run's work directory, with the C compiler on PATH.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from harness.bench import floor

SOURCE = Path(__file__).with_name("floor_native.c")


def compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc")


def build(workdir: Path) -> Path | None:
    """The processor compiled into `workdir`; None without a C compiler."""
    cc = compiler()
    if cc is None:
        return None
    binary = workdir / "floor-native"
    built = subprocess.run(
        [cc, "-O2", "-std=gnu99", "-Wall", "-o", str(binary), str(SOURCE)], capture_output=True, text=True
    )
    if built.returncode != 0:
        raise RuntimeError(f"{cc} could not build {SOURCE}:\n{built.stderr}")
    return binary


def command(binary: Path, port: int, endpoints: list[str]) -> list[str]:
    """The command line that runs the built processor on `port`, routing to `endpoints` ("host:port") in turn with
    the Python floor's answers, serialized once here."""
    argv = [str(binary), "--port", str(port)]
    for option, answer in (
        ("--response-headers", floor.CONTINUE_RESPONSE_HEADERS),
        ("--request-trailers", floor.REQUEST_TRAILERS),
        ("--response-trailers", floor.RESPONSE_TRAILERS),
    ):
        argv += [option, answer.hex()]
    for endpoint in endpoints:
        argv += ["--route", floor.routing_response(endpoint).SerializeToString().hex()]
    return argv
