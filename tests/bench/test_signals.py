"""epp-bench ended by SIGTERM (a `timeout`, a CI job's end) stops every process it started, as Ctrl-C does."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_sigterm_stops_the_stack_it_started():
    bench = subprocess.Popen(
        [sys.executable, "-m", "harness.bench.cli", "overhead", "--servers", "1", "--sequential", "2000"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    started: list[int] = []
    try:
        deadline = time.monotonic() + 90
        while len(started) < 4 and time.monotonic() < deadline:  # the servers, the EPP and its Envoy, a plain Envoy
            assert bench.poll() is None, bench.stderr.read()[-2000:]
            started = children(bench.pid)
            time.sleep(0.2)
        assert len(started) >= 4
        time.sleep(1.0)
        started = children(bench.pid)
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 15
        while any(alive(pid) for pid in started) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in started if alive(pid)]
    finally:
        if bench.poll() is None:
            bench.kill()
        for pid in started:  # (when the test fails: what the bench left behind)
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
