"""The README does what it says: its blocks run in order, as a newcomer following it would run them.

Each fenced block of the README is run in a copy of the checkout (its `.venv` linked in), in the README's order:
`sh` blocks with bash (exit status 0 expected), `python` blocks with this interpreter, `yaml` blocks parsed. A comment
line just before a block says how, where the default is not right:

* `<!-- readme-test: background until "TEXT" -->`: the command keeps running (a server); the walk goes on once its
  output shows TEXT, and the command is stopped (SIGINT, as Ctrl-C) when its section (a `##` or `###` heading) ends;
* `<!-- readme-test: file NAME -->`: the block is a file the next commands read, written as NAME;
* `<!-- readme-test: skip: WHY -->`: not runnable on one machine (a cluster, docker, minutes of benchmark); WHY is
  required, and the test says it.

The commands use the README's own ports (8000, 8081, 9002, ...), so two runs of this test on one machine at once
would collide; within `make test` it is one test in one worker.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

CHECKOUT = Path(__file__).resolve().parents[1]
README = CHECKOUT / "README.md"
MAX_LINES = 300
COMMAND_TIMEOUT = 120  # seconds a foreground block may take (msp-conformance: ~20 s)
READY_TIMEOUT = 180  # seconds a background block may take to print its text (make demo on a loaded 2-core machine)
STOP_TIMEOUT = 20

MARKER = re.compile(r"<!-- readme-test: (.*?) -->")
FENCE = re.compile(r"^```(\w*)\s*$")
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")


@dataclass
class Block:
    line: int  # 1-based line of the opening fence
    section: str
    language: str
    text: str
    marker: str  # "" when none


def readme_blocks(text: str) -> list[Block]:
    blocks: list[Block] = []
    section, marker, language, start, body = "", "", None, 0, []
    for number, line in enumerate(text.splitlines(), 1):
        if language is not None:
            if line.startswith("```"):
                blocks.append(Block(start, section, language, "\n".join(body) + "\n", marker))
                language, marker, body = None, "", []
            else:
                body.append(line)
            continue
        if line.startswith("## ") or line.startswith("### "):
            section = line.lstrip("#").strip()
        elif found := MARKER.fullmatch(line.strip()):
            marker = found.group(1)
        elif fence := FENCE.match(line):
            language, start = fence.group(1), number
        elif line.strip():
            marker = ""  # a marker belongs to the block right after it
    assert language is None, f"README: the block opened at line {start} is never closed"
    return blocks


class Background:
    """A command that keeps running; its output collected so that the walk can wait for a line."""

    def __init__(self, command: str, cwd: Path, env: dict[str, str]):
        self.command = command
        self.output: list[str] = []
        self.process = subprocess.Popen(
            ["bash", "-c", command],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.output.append(line)

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(text in line for line in self.output):
                return
            if self.process.poll() is not None:
                break
            time.sleep(0.2)
        tail = "".join(self.output[-30:])
        pytest.fail(f"`{self.command.strip()}` did not print {text!r} (exit {self.process.poll()}):\n{tail}")

    def stop(self) -> None:
        """Ctrl-C as a user would, then kill what is left of its process group."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(STOP_TIMEOUT)


def run_to_end(command: list[str], cwd: Path, env: dict[str, str]) -> tuple[int | None, str]:
    """Run a foreground block; past COMMAND_TIMEOUT its whole process group is killed (servers it started too)."""
    process = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=COMMAND_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        return None, f"still running after {COMMAND_TIMEOUT} s\n{output}"
    return process.returncode, output


def copy_checkout(dest: Path) -> None:
    """The checkout's files as git sees them (tracked, and new ones not ignored), modification times kept so that
    make finds the linked venv up to date, and the venv itself linked."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=CHECKOUT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = CHECKOUT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    (dest / ".venv").symlink_to(CHECKOUT / ".venv")


def test_readme_is_a_short_guide_without_history():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; at most {MAX_LINES} (details go in docs/)"
    assert not [line for line in lines if COMMIT.search(line)], "commit hashes belong in docs/, with their dates"


def test_links_to_files_of_the_checkout_exist():
    for markdown in [README, *sorted((CHECKOUT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)[^)]*\)", markdown.read_text()):
            if "://" not in target:
                assert (markdown.parent / target).exists(), f"{markdown.name}: link to {target}, which does not exist"


def test_every_block_runs_or_says_why_not():
    for block in readme_blocks(README.read_text()):
        if block.marker.startswith("skip"):
            assert block.marker.removeprefix("skip").strip(": "), f"README line {block.line}: skip without a reason"
        elif block.marker:
            assert re.fullmatch(r'background until ".+"|file [\w.-]+', block.marker), (block.line, block.marker)
        else:
            assert block.language in ("sh", "python", "yaml", ""), f"README line {block.line}: ```{block.language}"


def test_readme_walkthrough(tmp_path):
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed (the README's requests use it)")
    if not (CHECKOUT / ".venv" / "bin" / "epp-local").exists():
        pytest.skip("no .venv with the workshop in this checkout (make test or make demo creates it)")
    copy_checkout(tmp_path)
    if subprocess.run(["make", "-q", ".venv/.installed-demo"], cwd=tmp_path).returncode != 0:
        pytest.skip("the checkout's .venv is older than pyproject.toml or setup.py: `make demo` would reinstall it")
    # As a newcomer runs it, without pytest's variables, but for the worker's share of free ports
    # (harness/bench/ports.py): from the whole range, the demo's servers took ports another worker had handed out.
    share = ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT")
    env = {k: v for k, v in os.environ.items() if k in share or not k.startswith(("PYTEST_", "COV_"))}
    env["PYTHONUNBUFFERED"] = "1"
    running: list[Background] = []
    section = None
    try:
        for block in readme_blocks(README.read_text()):
            if block.section != section:
                for process in reversed(running):
                    process.stop()
                running.clear()
                section = block.section
            where = f"README line {block.line} ({block.section})"
            if block.marker.startswith("skip"):
                continue
            if block.marker.startswith("file "):
                (tmp_path / block.marker.removeprefix("file ")).write_text(block.text)
                continue
            if block.language == "yaml":
                yaml.safe_load(block.text)
                continue
            if block.language == "":
                continue  # a picture
            if found := re.fullmatch(r'background until "(.+)"', block.marker):
                assert block.language == "sh", where
                running.append(Background(block.text, tmp_path, env))
                running[-1].wait_for(found.group(1), READY_TIMEOUT)
                continue
            command = ["bash", "-e", "-c", block.text] if block.language == "sh" else [sys.executable, "-c", block.text]
            returncode, output = run_to_end(command, tmp_path, env)
            assert returncode == 0, f"{where}: exit {returncode}\n{output[-3000:]}"
    finally:
        for process in reversed(running):
            process.stop()
