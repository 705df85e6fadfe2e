"""The EPP process's own setup (epp/cli.py)."""

import resource
import subprocess
import sys

import pytest

from epp.cli import build_parser


def test_the_open_files_soft_limit_is_raised_to_the_hard_one():
    """A distribution's default soft limit (1,024) would stop accepting connections below --max-ext-proc-connections."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    script = (
        "import resource; from protocol.limits import raise_open_files_limit; "
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


@pytest.mark.parametrize(
    "flags",
    [
        ["--status-decisions", "-1"],
        ["--status-decisions", "x"],
        ["--trace-sampling-ratio", "1.5"],
        ["--trace-sampling-ratio", "x"],
    ],
)
def test_observability_flags_refuse_bad_values(flags, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--pool-file", "pool.yaml", *flags])
    assert "not a" in capsys.readouterr().err


def test_observability_flags_default_to_a_ring_and_no_tracing():
    args = build_parser().parse_args(["--pool-file", "pool.yaml"])
    assert args.status_decisions == 1000 and not args.emit_endpoint_scores
    assert args.otlp_traces_endpoint is None and args.trace_sampling_ratio == 1.0


def test_replica_flags(tmp_path, capsys):
    args = build_parser().parse_args(["--pool-file", "p.yaml", "--replica-peers", "epp.ns.svc:9005,10.0.0.2:9006"])
    assert args.replica_port == 9005 and args.replica_peers == [("epp.ns.svc", 9005), ("10.0.0.2", 9006)]
    for flags, says in (
        (["--replica-peers", "epp.ns.svc"], "not host:port"),
        (["--replica-port", "9006"], "--replica-peers"),
        (["--replica-secret-file", "s"], "--replica-peers"),
    ):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--pool-file", "p.yaml", *flags])
        assert says in capsys.readouterr().err
