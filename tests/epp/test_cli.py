"""The EPP process's own setup (epp/cli.py)."""

import resource
import subprocess
import sys


def test_the_open_files_soft_limit_is_raised_to_the_hard_one():
    """A distribution's default soft limit (1,024) would stop accepting connections below --max-ext-proc-connections."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    script = (
        "import resource; from epp.cli import raise_open_files_limit; "
        "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], raise_open_files_limit())"
    )
    low = min(256, hard)
    out = subprocess.run(
        [sys.executable, "-c", script],
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard)),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert [int(v) for v in out] == [low, hard]
