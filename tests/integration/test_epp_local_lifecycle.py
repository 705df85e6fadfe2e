"""epp-local stops on every way a user ends it and leaves no child behind; a taken port or a child that dies stops
it with a clear message."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import epp_local_ports


def start(args: list[str]) -> tuple[subprocess.Popen, Path]:
    process = subprocess.Popen(
        [sys.executable, "-m", "harness.local", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    workdir = None
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            raise AssertionError("epp-local ended early: " + process.stderr.read()[-2000:])
        if "logs in " in line:
            workdir = Path(line.split("logs in ", 1)[1].split(")")[0])
        if line.startswith("gateway ready"):
            return process, workdir
    raise AssertionError("epp-local not ready in time")


def children_of(workdir: Path) -> list[int]:
    """Processes whose command line names the stack's work directory (the EPP's pool file, Envoy's bootstrap)
    or are the stack's model servers."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(workdir) in cmdline:
                found.append(int(entry.name))
    return found


def epps_of(workdir: Path) -> list[int]:
    """The stack's EPP processes (each is given the pool file in the work directory)."""
    return [pid for pid in children_of(workdir) if b"--pool-file" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def assert_all_gone(workdir: Path, ports: list[int]) -> None:
    deadline = time.monotonic() + 15
    while children_of(workdir) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert children_of(workdir) == []
    for port in ports:
        with socket.socket() as probe:
            # free again: no process listens there (a connection the killed side closed first may leave the port in
            # TIME_WAIT, which keeps no server out: they bind with SO_REUSEADDR, as this probe does)
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(("127.0.0.1", port))
            probe.listen()


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM", "SIGHUP", "closed-pipe"])
def test_every_way_to_end_it_stops_every_child(how):
    args, ports = epp_local_ports()
    replicas = 2 if how == "SIGTERM" else 1  # --epp-replicas: active-active EPPs, stopped like the rest
    process, workdir = start([*args, "--epp-replicas", str(replicas)])
    assert children_of(workdir)
    assert len(epps_of(workdir)) == replicas
    if how == "closed-pipe":  # `epp-local | head`, then Ctrl-C: stdout is a closed pipe when it says "stopping"
        process.stdout.close()
        process.send_signal(signal.SIGINT)
    else:
        process.send_signal(getattr(signal, how))
    assert process.wait(30) == 0, process.stderr.read()[-2000:]
    assert "BrokenPipeError" not in process.stderr.read()
    assert_all_gone(workdir, ports)


def test_a_taken_port_fails_fast_naming_it():
    args, ports = epp_local_ports()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", ports[1]))
        holder.listen()
        started = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", "harness.local", *args], capture_output=True, text=True, timeout=60
        )
    # before starting anything: the servers' own start-up wait is 60 s (a few seconds idle, ~20 s of imports at load 6)
    assert result.returncode == 2 and time.monotonic() - started < 45
    assert f"port {ports[1]} (model server 1)" in result.stderr
    assert "gateway ready" not in result.stdout


def test_a_child_that_dies_stops_the_stack_with_its_last_log_lines():
    args, ports = epp_local_ports()
    process, workdir = start(args)
    epp = next(pid for pid in children_of(workdir) if b"-m\0epp\0" in Path(f"/proc/{pid}/cmdline").read_bytes())
    os.kill(epp, signal.SIGKILL)
    assert process.wait(30) == 1
    stderr = process.stderr.read()
    assert "epp exited with code -9" in stderr and "epp.log" in stderr
    assert_all_gone(workdir, ports)


def test_a_port_in_time_wait_is_not_taken():
    """A server that closed a connection first leaves its port in TIME_WAIT, which keeps no server out (they bind
    with SO_REUSEADDR): epp-local starts there."""
    args, ports = epp_local_ports()
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", ports[0]))
        listener.listen()
        with socket.create_connection(("127.0.0.1", ports[0])) as client:
            accepted, _ = listener.accept()
            accepted.close()  # the server's side closes first: its port goes to TIME_WAIT
            client.recv(1)
    with socket.socket() as strict, pytest.raises(OSError):
        strict.bind(("127.0.0.1", ports[0]))  # (what the old probe did)
    process, workdir = start(args)
    process.send_signal(signal.SIGINT)
    assert process.wait(30) == 0, process.stderr.read()[-2000:]
    assert_all_gone(workdir, ports[1:])
