"""epp-bench says what it wrote and what it did not, and exits 1 when a goal it reports is missed (chaos) or requests
went unaccounted for (flood); the other subcommands only report."""

import asyncio

import pytest

from harness.bench import chaos, cli, compare, failover, flood


@pytest.fixture(autouse=True)
def no_signal_handlers(monkeypatch):
    monkeypatch.setattr(cli.signal, "signal", lambda *args: None)  # the CLI's handlers are for its own process


def report(**attack) -> chaos.ChaosReport:
    fields = {"attack": "slowloris", "sent": 10, "answered_correctly": 10, "lost": 0, "probes": 20}
    fields.update(peak_rss_mb=3.0, worst_ms=20.0)
    fields.update(attack)
    return chaos.ChaosReport(unloaded_p50_ms=10.0, idle_rss_mb=60.0, results=[chaos.AttackResult(**fields)])


def test_chaos_names_each_missed_goal_and_exits_1(monkeypatch, capsys):
    missed = report(lost=2, peak_rss_mb=80.0, answered_correctly=9, worst_ms=45.0)
    assert chaos.missed_goals(missed, missed.results[0]) == [
        "2 well-behaved request(s) lost",
        "RSS +80 MB > 64 MB",
        "1 of 10 attacks not answered as they should be",
        "worst latency 45 ms > 3x unloaded p50 (30.0 ms)",
    ]
    assert "| NO: 2 well-behaved request(s) lost; RSS +80 MB > 64 MB;" in chaos.markdown(missed)

    async def run(seconds):
        return missed

    monkeypatch.setattr(chaos, "run", run)
    with pytest.raises(SystemExit) as exit_info:  # it printed "goals met: NO" and exited 0
        cli.main(["chaos"])
    assert exit_info.value.code == "epp-bench chaos: goals missed by: slowloris (the table says which and why)"
    met = report()
    assert chaos.missed_goals(met, met.results[0]) == [] and "| yes |" in chaos.markdown(met)
    monkeypatch.setattr(chaos, "run", lambda seconds: asyncio.sleep(0, met))
    cli.main(["chaos"])  # every goal met: exit 0


def test_compare_says_which_files_it_wrote_and_that_it_drew_no_plots(monkeypatch, tmp_path, capsys):
    async def no_plots(workload, targets, rates, duration, servers, out, *args, **kwargs):
        out.mkdir(parents=True, exist_ok=True)
        for suffix in (".md", ".json"):
            (out / f"{workload}{suffix}").write_text("")
        return []  # as compare() without matplotlib: no *.png

    monkeypatch.setattr(compare, "compare", no_plots)
    monkeypatch.setattr(compare, "markdown", lambda results: "")
    cli.main(["compare", "--targets", "epp", "--rates", "8", "--out", str(tmp_path)])
    last = capsys.readouterr().out.strip().splitlines()[-1]  # it claimed "*.png" whatever it wrote
    assert last == (
        f"wrote {tmp_path}/shared-prefix.md, {tmp_path}/shared-prefix.json; "
        "no plots (matplotlib is not installed: pip install -e '.[bench]')"
    )


def test_flood_exits_1_when_requests_went_unaccounted_for(monkeypatch, capsys):
    async def flooded(targets, overloads, duration, servers, out):
        return [flood.FloodResult("epp", 2.0, offered_rate=20.0, capacity=10.0, duration=1.0, accounted=False)]

    monkeypatch.setattr(flood, "flood", flooded)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["flood", "--targets", "epp"])
    assert exit_info.value.code == "epp-bench flood: requests not all accounted for: epp at 2x"
    assert "wrote no files; --out DIR keeps the report" in capsys.readouterr().out


def test_compare_runs_each_epp_target_per_replica_count_and_sharing_choice():
    from harness.bench import agentic
    from harness.bench.workloads import load_workload

    assert compare.replica_variants("epp", [1, 3], [True, False]) == [
        (1, True, False),
        (3, True, False),
        (3, False, False),
    ]
    assert compare.replica_variants("round-robin", [1, 3], [True, False]) == [(1, True, False)]
    # the floor of 3 against 1: one routing replica and two shadows, beside 3 routing ones
    floor = compare.replica_variants("epp", [1, 3], [True], [False, True])
    assert floor == [(1, True, False), (3, True, False), (3, True, True)]
    labels = [(1, True, False), (3, True, False), (3, False, False), (3, True, True), (3, False, True)]
    assert [compare.target_label("epp", *variant) for variant in labels] == [
        "epp",
        "epp x3",
        "epp x3 unshared",
        "epp 1+2 shadows",
        "epp 1+2 shadows unshared",
    ]
    spec = load_workload("agentic")
    bursts = agentic.sessions({**spec, "arrival": {"burst": 4}}, 2.0, 20.0, 0, 0.1)
    starts = [s.at for s in bursts]
    assert len(starts) % 4 == 0 and all(starts[i] == starts[i + 3] for i in range(0, len(starts), 4))
    assert agentic.sessions(spec, 2.0, 20.0, 0, 0.1) == agentic.sessions(
        {**spec, "arrival": {"burst": 1}}, 2.0, 20.0, 0, 0.1
    )


def test_failover_exits_1_naming_the_faults_that_failed_requests(monkeypatch, capsys):
    def phases(killed_failed: int, drained_failed: int) -> list[failover.Phase]:
        return [
            failover.Phase("EPP replica killed (SIGKILL, 1 of 3)", {"ok": 90, "failed": killed_failed}),
            failover.Phase("EPP replica drained (SIGTERM, 1 of 3)", {"ok": 90, "failed": drained_failed}),
            failover.Phase("model server killed (SIGKILL, 1 of 8)", {"ok": 90, "cut": 3}),  # cut in flight: expected
        ]

    fail_close = failover.FailoverReport(8, 3, 32, False, 10.0, phases(killed_failed=2, drained_failed=0))
    assert failover.missed_goals(fail_close) == []  # FailClose: the killed replica's streams in flight fail by design
    fail_open = failover.FailoverReport(8, 3, 32, True, 10.0, phases(killed_failed=2, drained_failed=1))
    assert failover.missed_goals(fail_open) == [fail_open.phases[0].name, fail_open.phases[1].name]
    assert "| EPP replica killed (SIGKILL, 1 of 3) | 90 | 2 | 0 |" in failover.markdown(fail_open)

    async def run(**settings):
        assert settings["fail_open"] is True and settings["servers"] == 8
        return fail_open

    monkeypatch.setattr(failover, "run", run)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["failover"])
    assert str(exit_info.value.code).startswith("epp-bench failover: requests failed in: EPP replica killed")


def test_compare_repeats_in_rounds_and_splits_replicas_against_one_into_floor_and_routing(monkeypatch, tmp_path):
    """--repeats runs every variant once a round; the report's replica table gives, per round and over the rounds,
    the floor (1 routing + shadows against 1 EPP), the routing (N routing against the floor) and both, and the
    spread of each configuration."""
    ttft = {  # (replicas, shadows, round) -> TTFT mean, p90 (ms)
        (1, False, 1): (50.0, 60.0),
        (3, True, 1): (52.0, 63.0),
        (3, False, 1): (57.2, 69.3),
        (1, False, 2): (40.0, 50.0),
        (3, True, 2): (40.0, 50.0),
        (3, False, 2): (44.0, 60.0),
    }
    order = []

    async def fake_run(target, spec, rate, duration, servers, workdir, scale, **kw):
        order.append((kw["replicas"], kw["shadows"], kw["repeat"], workdir.name))
        mean, p90 = ttft[kw["replicas"], kw["shadows"], kw["repeat"]]
        label = compare.target_label(target, kw["replicas"], kw["sharing"], kw["shadows"], kw["repeat"])
        return compare.TargetResult(
            label,
            rate,
            ttft_ms={"mean": mean, "p90": p90},
            prefix_hit_rate=0.9,
            server_ttft_ms=mean - 10,
            server_queue_ms=mean / 10,
            **{k: kw[k] for k in ("replicas", "sharing", "shadows", "repeat")},
        )

    monkeypatch.setattr(compare, "run_target", fake_run)
    monkeypatch.setattr(compare, "plots", lambda results, out: [])
    results = asyncio.run(
        compare.compare(
            "multi-turn-kv-pressure",
            ["epp"],
            [12.0],
            1.0,
            8,
            tmp_path,
            progress=lambda m: None,
            replicas=[1, 3],
            shadows=[False, True],
            repeats=2,
        )
    )
    assert order == [  # round by round, every variant in each
        (1, False, 1, "epp-r1-12"),
        (3, False, 1, "epp-x3-r1-12"),
        (3, True, 1, "epp-1+2-shadows-r1-12"),
        (1, False, 2, "epp-r2-12"),
        (3, False, 2, "epp-x3-r2-12"),
        (3, True, 2, "epp-1+2-shadows-r2-12"),
    ]
    assert [r.target for r in results][:3] == ["epp #1", "epp x3 #1", "epp 1+2 shadows #1"]
    report = compare.markdown(results)
    assert (
        "| epp x3 #1 | 1.04 / 1.05 | 1.10 / 1.10 | 1.14 / 1.16 | 40 (5.0) / 42 (5.2) / 47 (5.7) | 90% / 90% / 90% |"
        in report
    )
    assert "| epp x3 #2 | 1.00 / 1.00 | 1.10 / 1.20 | 1.10 / 1.20 |" in report
    assert (
        "| **epp x3, 2 rounds: mean (range)** | 1.02 (1.00-1.04) / 1.02 (1.00-1.05) | "
        "1.10 (1.10-1.10) / 1.15 (1.10-1.20) | 1.12 (1.10-1.14) / 1.18 (1.16-1.20) | | |"
    ) in report
    assert "| epp | 2 | 50 / 40 | 25.0% | 60 / 50 | 20.0% | 40 / 30 |" in report
    without_shadows = compare.markdown([r for r in results if not r.shadows and r.repeat == 1])
    assert "| epp x3 #1 | - | - | 1.14 / 1.16 | 40 (5.0) / - / 47 (5.7) | 90% / - / 90% |" in without_shadows
    assert "rounds: mean (range)" not in without_shadows and "| configuration |" not in without_shadows
    with pytest.raises(SystemExit):  # the CLI's own check
        cli.main(["compare", "--targets", "epp", "--repeats", "0", "--out", str(tmp_path)])


def test_compare_reports_what_the_replicas_said_of_their_channel_and_turns():
    """The lines under the table, from the EPPs' own metrics: datagrams, pages, turns to pick, the channel's CPU."""
    result = compare.TargetResult(
        "epp x3",
        24.0,
        ttft_ms={"mean": 80.0, "p90": 110.0},
        succeeded=100,
        cpu_seconds={"epp": 0.5, "epp-1": 0.25, "epp-2": 0.25},
        epp_index={
            "rss_mb": 345.0,
            "replica_datagrams_sent_total": 1100.0,
            "replica_bytes_sent_total": 270_000.0,
            "turns_granted": 140.0,
            "turns_timed_out": 5.0,
            "turns_free": 235.0,
            "turns_queued": 0.0,
            "turn_wait_sum": 0.21,
            "turn_wait_count": 140.0,
        },
        channel_cpu={"send": 0.04, "receive": 0.08},
        replicas=3,
    )
    report = compare.markdown([result])
    assert "epp x3: EPP CPU 10.00 ms per request" in report
    assert "per request (all replicas, each peer counted): 11.00, 2700 bytes" in report
    # outcomes that never happened are left out
    assert (
        "epp x3: the replicas' turns to pick since they started (all replicas): granted 140, timed_out 5, free 235; "
        "140 picks waited for a turn, 1.50 ms on average\n" in report
    )
    assert "send 0.400, receive 0.800; 1.200 in all" in report
