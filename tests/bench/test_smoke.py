"""A few-second run of `epp-bench compare` (4 servers, EPP vs round robin) and of the overhead suite, so the
harness cannot rot between `make bench` runs."""

import asyncio
import itertools
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from epp.scheduling.plugins.slo_headroom_filter import TPOT_HEADER, TTFT_HEADER
from harness.bench import cli, compare, floor_native, inference_perf, overhead


def test_compare_smoke(tmp_path):
    results = asyncio.run(
        compare.compare(
            "shared-prefix", ["epp", "round-robin"], [6.0], 3.0, 4, tmp_path, scale=0.2, progress=lambda m: None
        )
    )
    assert [r.target for r in results] == ["epp", "round-robin"]
    for r in results:
        assert r.requests > 5 and r.succeeded == r.requests, r.errors
        assert sum(r.per_server) == r.requests
        assert r.ttft_ms["p50"] > 0 and r.output_tokens_per_s > 0
        assert 0 < r.server_ttft_ms < r.ttft_ms["mean"]  # the servers' own TTFT leaves out the path to them
        assert set(r.cpu_seconds) >= {"modelserver", "load generator"}
    # the gateway's own timings, through the stack's Envoy (round robin runs its own Envoy, without them)
    epp, round_robin = results
    assert 0 < epp.gateway_ms["routing_mean"] <= epp.gateway_ms["routing_p90"] < epp.ttft_ms["mean"]
    assert 0 < epp.gateway_ms["upstream_mean"] < epp.ttft_ms["mean"] and not round_robin.gateway_ms
    table = (tmp_path / "shared-prefix.md").read_text()
    assert "| epp |" in table and "| round-robin |" in table
    assert "at the gateway, ms: before the request left for its server" in table
    assert len(json.loads((tmp_path / "shared-prefix.json").read_text())) == 2
    assert all(0 < r.host_busy <= 1 for r in results)
    # The seeded requests repeat some of the 16 groups' system prompts: the EPP sends repeats where they are cached.
    assert 0 < results[0].cache_hit_requests < results[0].succeeded and results[0].ttft_hit_ms["mean"] > 0
    charts = {"ttft_vs_rate.png", "load_epp_6.png", "load_round-robin_6.png", "ttft_cdf_6reqpers.png", "throughput.png"}
    assert charts <= {p.name for p in tmp_path.glob("*.png")}
    assert all(len(r.ttft_samples_ms) == r.succeeded for r in results)  # the CDF's points


def test_closed_loop_smoke(tmp_path):
    (result,) = asyncio.run(
        compare.compare(
            "heterogeneous",
            ["round-robin"],
            [],
            2.0,
            2,
            tmp_path,
            scale=0.05,
            progress=lambda m: None,
            concurrencies=[3],
        )
    )
    assert result.concurrency == 3 and result.requests == result.succeeded > 0
    assert "closed loop, 3 concurrent clients" in (tmp_path / "heterogeneous.md").read_text()
    assert (tmp_path / "ttft_vs_concurrency.png").is_file() and (tmp_path / "load_round-robin_c3.png").is_file()


def test_workloads_are_seeded_and_shaped():
    from harness.bench.workloads import load_workload, requests

    for name in ("shared-prefix", "multi-lora", "heterogeneous", "long-prompt", "slo-mixed", "mixed-gpus"):
        spec = load_workload(name)
        first, again = requests(spec, "m", rate=5, duration=4, seed=1), requests(spec, "m", rate=5, duration=4, seed=1)
        assert first == again and first
        assert all(r.body["stream"] and r.body["stream_options"]["include_usage"] for r in first)
        assert all(r.headers == {} for r in first) or name == "slo-mixed"
    lora = requests(load_workload("multi-lora"), "m", rate=50, duration=10)
    assert {r.body["model"] for r in lora} <= {f"lora-{i}-{j}" for i, n in enumerate((2, 4, 10)) for j in range(n)}


def test_slo_workload_states_each_requests_objectives_and_goodput_counts_who_met_them():
    from harness.bench.compare import Outcome, TargetResult, _from_outcomes, judged, markdown, missed_objectives
    from harness.bench.workloads import load_workload, requests

    stream = requests(load_workload("slo-mixed"), "m", rate=20, duration=10, seed=3)
    by_objective = {}
    for r in stream:
        by_objective.setdefault((r.headers[TTFT_HEADER], r.headers[TPOT_HEADER]), set()).add(r.body["max_tokens"])
    assert by_objective == {("300", "50"): {64}, ("2000", "100"): {256}}
    chat = {TTFT_HEADER: "300", TPOT_HEADER: "50"}
    assert judged(chat, Outcome(200, ttft=0.29, itl=0.049, output_tokens=64)).met_slo is True
    assert judged(chat, Outcome(200, ttft=0.31, itl=0.01, output_tokens=64)).met_slo is False
    assert judged(chat, Outcome(200, ttft=0.1, itl=0.051, output_tokens=64)).met_slo is False
    assert judged(chat, Outcome(429)).met_slo is False
    assert judged({}, Outcome(200, ttft=9.0)).met_slo is None
    assert missed_objectives(chat, Outcome(200, ttft=0.31, itl=0.051, output_tokens=64)) == "ttft+tpot"
    assert missed_objectives(chat, Outcome(200, ttft=0.1, itl=0.051, output_tokens=64)) == "tpot"
    assert missed_objectives(chat, Outcome(503)) == "error"
    assert judged(chat, Outcome(200, ttft=0.1, itl=0.051, output_tokens=64), "chat")[-2:] == ("chat", "tpot")
    by_class = TargetResult("by-class", 1.0)
    met = Outcome(200, 0.1, met_slo=True, kind="a")
    late = Outcome(200, 0.4, met_slo=False, kind="a", missed="ttft")
    stalled = Outcome(200, 0.1, met_slo=False, kind="a", missed="tpot")
    _from_outcomes(by_class, [met, late, stalled, stalled, Outcome(200, 0.1, kind="b")], 1.0)
    assert by_class.by_kind["a"] | {"ttft_ms": None} == {
        "requests": 4,
        "succeeded": 4,
        "ttft_ms": None,
        "slo_requests": 4,
        "slo_met": 1,
        "missed_ttft": 1,
        "missed_tpot": 2,
    }
    assert "| by-class | a | 4/4 | 175 | 400 | - | 1/4 | 1 / 2 |" in markdown([by_class])
    fast, slow = TargetResult("fast", 1.0), TargetResult("slow", 1.0)
    _from_outcomes(fast, [Outcome(200, 0.1, 0.01, 0.5, 64, met_slo=True)] * 6 + [Outcome(200, met_slo=None)], 2.0)
    _from_outcomes(slow, [Outcome(200, 0.1, 0.01, 0.5, 64, met_slo=True)] * 2 + [Outcome(599, met_slo=False)] * 4, 2.0)
    assert (fast.slo_requests, fast.slo_met, fast.goodput_per_s) == (6, 6, 3.0)
    assert (slow.slo_requests, slow.slo_met, slow.goodput_per_s) == (6, 2, 1.0)
    report = markdown([fast, slow])
    assert "| fast | 6/6 (100%) | 3.0 | 3.00 |" in report and "| slow | 2/6 (33%) | 1.0 | 0.33 |" in report


def test_report_breaks_ttft_down_by_request_class():
    from harness.bench.compare import Outcome, TargetResult, _from_outcomes, markdown
    from harness.bench.workloads import load_workload, requests

    kinds = {r.kind: r.body["max_tokens"] for r in requests(load_workload("heterogeneous"), "m", rate=20, duration=10)}
    assert kinds == {"200-token prompts": 128, "6000-token prompts": 256}
    tiers = {r.kind for r in requests(load_workload("multi-lora"), "m", rate=50, duration=10)}
    assert tiers == {
        "tier 0 (60% of traffic on 2 adapters)",
        "tier 1 (30% of traffic on 4 adapters)",
        "tier 2 (10% of traffic on 10 adapters)",
    }
    assert {r.kind for r in requests(load_workload("shared-prefix"), "m", rate=5, duration=4)} == {""}
    short, long = "200-token prompts", "6000-token prompts"
    rr, epp = TargetResult("round-robin", 1.0), TargetResult("epp", 1.0)
    _from_outcomes(rr, [Outcome(200, 0.2, kind=short)] * 4 + [Outcome(200, 0.6, kind=long)], 1.0)
    _from_outcomes(epp, [Outcome(200, 0.05, kind=short)] * 4 + [Outcome(599, kind=long)], 1.0)
    assert rr.by_kind[short]["ttft_ms"]["mean"] == 200 and rr.by_kind[long]["requests"] == 1
    assert (epp.by_kind[long]["succeeded"], epp.by_kind[long]["ttft_ms"]) == (0, {})
    report = markdown([rr, epp])
    assert "| epp | 200-token prompts | 4/4 | 50 | 50 | 0.25 / 0.25 | - | - |" in report
    assert "| epp | 6000-token prompts | 0/1 | nan | nan | nan / nan | - | - |" in report


def test_multi_turn_requests_carry_the_users_earlier_turns():
    from harness.bench.workloads import load_workload, requests

    stream = requests(load_workload("shared-prefix-multi-turn"), "m", rate=20, duration=10, seed=2)
    by_user: dict[str, list[str]] = {}
    for r in stream:
        prompt = r.body["prompt"]
        by_user.setdefault(prompt.rsplit("\nQuestion ", 1)[1].split(":")[0] + prompt[:200], []).append(prompt)
    turns = [prompts for prompts in by_user.values() if len(prompts) > 1]
    assert turns, "some user came back within 10 s"
    for prompts in turns:
        for earlier, later in itertools.pairwise(prompts):
            assert later.startswith(earlier + "\nAnswer: ")


# every target of the overhead bench (twelve gateways, six of them floors): a minute of both cores; make bench runs
# it before `epp-bench overhead` itself
@pytest.mark.slow
def test_overhead_smoke():
    result = asyncio.run(
        overhead.measure(
            servers=2,
            sequential=20,
            concurrency=4,
            concurrent_requests=40,
            with_peers=False,
            epp_configs={"scorers only": compare.scorers_only_config()},
        )
    )
    # the native floor is built when there is a C compiler, else left out with a note
    processors = (overhead.FLOOR, overhead.NATIVE_FLOOR) if floor_native.compiler() else (overhead.FLOOR,)
    floors = {overhead.floor_target(processor, mode) for processor in processors for mode, *_ in overhead.FLOOR_MODES}
    assert set(result.latency_ms) == {
        overhead.EPP,
        overhead.PLAIN,
        overhead.EPP_NO_FLOW_CONTROL,
        overhead.EPP_NO_ACCESS_LOG,
        overhead.EPP_PICKER_ONLY,
        "envoy+epp (scorers only)",
        *floors,
    }
    assert bool(result.notes) != bool(floor_native.compiler())
    assert result.throughput_ratio > 0 and result.latency_ms["envoy+epp"]["p50"] > 0
    assert set(result.flow_control_added_ms) == {"p50", "p99"} and "added latency of flow control" in result.markdown()
    assert result.cpu_ms_per_request[overhead.EPP_NO_FLOW_CONTROL]["epp"] > 0
    assert result.cpu_ms_per_request[overhead.EPP_NO_ACCESS_LOG]["envoy"] > 0
    # the gateway without its access log has Envoy send the EPP each response's headers: that trip's cost, reported
    assert set(result.response_headers_added_ms) == {"p50", "p99", "cpu"}
    assert "added by the response-header trip" in result.markdown()
    # how old the metrics were that the EPP's picks read while it was loaded: every pick of those phases counted
    age = result.picked_metrics_age
    assert age["picks"] >= 2 * result.concurrent_requests and 0 < age["p50"] <= age["p99"]
    assert "the picked endpoint's metrics at the pick" in result.markdown()
    # scheduling's share: the default profile against the same EPP with max-score-picker alone
    assert set(result.scheduling_added_ms) == {"p50", "p99", "cpu"}
    assert "added by the default profile's filters and scorers" in result.markdown()
    assert result.cpu_ms_per_request["envoy+epp (scorers only)"]["epp"] > 0
    # every target but plain Envoy has a processor of its own, whose CPU per request is measured
    assert result.cpu_ms_per_request[overhead.EPP]["epp"] > 0
    assert result.cpu_ms_per_request[overhead.floor_target(overhead.FLOOR, "body streamed")]["processor"] > 0
    # the same over each target's own throughput phases, which are part of the whole run (clock ticks: may be 0 here)
    loaded = result.cpu_ms_per_request_loaded[overhead.EPP]["epp"]
    assert (
        0
        <= loaded * 2 * result.concurrent_requests
        <= result.cpu_ms_per_request[overhead.EPP]["epp"]
        * (2 * result.concurrent_requests + result.sequential_requests)
    )
    assert "p50 / plain" in result.markdown() and f"at concurrency {result.concurrency} |" in result.markdown()
    # the whole machine's CPU over each target's throughput phases (10 ms ticks: a share may read 0 in runs this short)
    assert set(result.machine_cpu) == set(result.latency_ms)
    assert all(m["ms"] >= 0 and 0 <= m["busy"] <= 1 for m in result.machine_cpu.values()), result.machine_cpu
    assert "the whole machine while each target's throughput was measured" in result.markdown()
    assert ("a processor that cost nothing" in result.markdown()) == (result.zero_cost_ceiling() is not None)


def test_the_machine_s_cpu_time_counts_this_process_s_work_as_busy():
    busy, elapsed = overhead.machine_cpu_seconds()
    end = time.process_time() + 0.2
    while time.process_time() < end:
        pass
    busy_after, elapsed_after = overhead.machine_cpu_seconds()
    assert busy_after - busy >= 0.15  # the spin, less a clock tick or so either side
    assert elapsed_after - elapsed >= busy_after - busy - 1e-9  # all busy (a loaded host): equal, as floats


def test_the_zero_cost_ceiling_is_plain_envoy_s_machine_cpu_over_the_native_floor_s_less_its_processor():
    native = overhead.floor_target(overhead.NATIVE_FLOOR, "body streamed")
    result = overhead.OverheadResult("h2", 4, 10, 32, 100)
    assert result.zero_cost_ceiling() is None  # no /proc/stat figures
    result.machine_cpu = {overhead.PLAIN: {"ms": 0.5, "busy": 0.8}, native: {"ms": 0.8, "busy": 0.8}}
    result.cpu_ms_per_request_loaded = {native: {"envoy": 0.3, "processor": 0.05}}
    assert result.zero_cost_ceiling() == pytest.approx(0.5 / 0.75)
    del result.machine_cpu[native]  # the native floor left out (no C compiler)
    assert result.zero_cost_ceiling() is None


def test_each_epp_variant_is_compared_with_the_default_epp_pass_by_pass():
    result = overhead.OverheadResult("h2", 4, 10, 32, 100)
    result.epp_phase_cpu_ms = {overhead.EPP: [0.30, 0.40, 0.35]}
    assert "pass by pass" not in "\n".join(result._phase_lines())  # nothing to compare with
    result.epp_phase_cpu_ms["envoy+epp (--flag)"] = [0.33, 0.40, 0.42]
    lines = result._phase_lines()
    assert "envoy+epp 0.300 0.400 0.350; envoy+epp (--flag) 0.330 0.400 0.420" in lines[0]
    assert lines[1] == "envoy+epp (--flag) / envoy+epp, pass by pass: median 1.100, 1.000-1.200 over 3 passes"


def test_cpus_split_between_the_load_and_the_targets():
    assert overhead.split_cpus([1, 0]) == ({0}, {1})
    assert overhead.split_cpus(range(5)) == ({0, 1}, {2, 3, 4})
    with pytest.raises(ValueError, match="at least 2 CPUs"):
        overhead.split_cpus([3])


def test_bucket_quantile_is_the_bound_of_the_bucket_that_holds_it():
    buckets = {0.01: 10.0, 0.05: 90.0, 0.1: 99.0, math.inf: 100.0}
    assert overhead.bucket_quantile(buckets, 0.05) == 0.01
    assert overhead.bucket_quantile(buckets, 0.5) == 0.05
    assert overhead.bucket_quantile(buckets, 0.99) == 0.1
    assert overhead.bucket_quantile(buckets, 1.0) == math.inf


def test_overhead_pin_refuses_a_single_cpu_before_starting_anything(capsys, monkeypatch):
    monkeypatch.setattr(cli.signal, "signal", lambda *args: None)
    monkeypatch.setattr(cli.os, "sched_getaffinity", lambda pid: {0})
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["overhead", "--pin"])
    assert exit_info.value.code == 2 and "--pin: pinning needs at least 2 CPUs" in capsys.readouterr().err


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs two CPUs")
def test_pinned_the_load_and_every_target_s_processes_run_on_their_own_cpus(monkeypatch):
    """`epp-bench overhead --pin`: each target's processes (every thread) on the targets' CPUs, the model servers
    and the client on the load's, as the kernel reports them while the run goes on; the client has every CPU back
    afterwards."""
    before = os.sched_getaffinity(0)
    load_cpus, target_cpus = overhead.split_cpus(before)
    seen: list[tuple[int, set[frozenset[int]]]] = []  # (pid, its threads' CPUs) after each pinning
    pin_process = overhead.pin_process

    def pin_and_read(pid, cpus):
        pin_process(pid, cpus)
        seen.append((pid, {frozenset(os.sched_getaffinity(int(task))) for task in os.listdir(f"/proc/{pid}/task")}))

    monkeypatch.setattr(overhead, "pin_process", pin_and_read)
    result = asyncio.run(
        overhead.measure(
            servers=2,
            sequential=10,
            concurrency=4,
            concurrent_requests=20,
            with_peers=False,
            with_floor=False,
            with_flow_control_off=False,
            without_access_log=False,
            with_picker_only=False,
            pin=True,
            rounds=2,
        )
    )
    assert len(result.epp_phase_cpu_ms[overhead.EPP]) == 4  # two passes forward and back: the EPP's CPU in each
    assert os.sched_getaffinity(0) == before
    *targets_and_servers, (client, during), (_, after) = seen
    assert client == os.getpid() and during == {load_cpus} and after == {frozenset(before)}  # every thread
    # plain Envoy, the EPP's Envoy and the EPP on the targets' CPUs, the model servers on the load's
    pinned = sorted((cpus for _, cpus in targets_and_servers), key=lambda cpus: cpus == {load_cpus})
    assert pinned == [{target_cpus}] * 3 + [{load_cpus}]
    assert f"the client and the model servers on CPUs {','.join(map(str, sorted(load_cpus)))}" in result.markdown()
    assert result.latency_ms[overhead.EPP]["p50"] > 0
    # how busy the load's CPU was while each target's throughput was measured (this process alone keeps it busy)
    assert set(result.load_cpu_busy) == set(result.latency_ms)
    assert all(0.05 < busy < 1.5 for busy in result.load_cpu_busy.values()), result.load_cpu_busy
    assert "the load's CPUs (the client and the model servers) busy while" in result.markdown()


def test_the_sequential_phase_sends_every_target_one_request_a_round_after_varying_predecessors():
    targets = [f"t{i}" for i in range(8)]
    sent = list(overhead.interleaved(targets, 200))
    rounds = [sent[i : i + 8] for i in range(0, len(sent), 8)]
    assert len(rounds) == 200 and all(sorted(r) == targets for r in rounds)
    after = {t: {sent[i - 1] for i in range(1, len(sent)) if sent[i] == t} for t in targets}
    assert all(len(after[t] - {t}) == 7 for t in targets)  # every other target, not one fixed
    assert list(overhead.interleaved(targets, 200)) == sent  # seeded: a rerun sends in the same order


def test_a_process_cpu_time_is_read_to_well_under_a_clock_tick():
    """The benchmarks' CPU figures per process: a process that spins ~50 ms reads about that, and one that has
    used a millisecond or so reads more than 0 (/proc's 10 ms ticks read 0 for a processor that spent 80 µs on each
    of a hundred requests)."""
    spin = "import time\nend = time.process_time() + 0.05\nwhile time.process_time() < end: pass\nprint(flush=True)\ntime.sleep(30)"
    busy = subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE)
    idle = subprocess.Popen(["sleep", "30"])
    try:
        busy.stdout.readline()  # it has spun
        assert 0.05 <= overhead.cpu_seconds(busy.pid) < 1.0
        assert 0 < overhead.cpu_seconds(idle.pid) < 0.05
    finally:
        for process in (busy, idle):
            process.kill()
            process.wait()


def test_decision_time_smoke():
    from harness.bench import decision

    assert 0 < decision.measure(8, 1000, repeats=20) < 50_000
    assert 0 < decision.measure_predicted(8, 1000, repeats=20) < 50_000  # a trained predictor handed to the scheduler
    assert 0 < decision.measure_director(8, 1000, repeats=20) < 50_000


@pytest.mark.slow  # a benchmark through another load generator, in its own Python 3.12 venv: make bench makes it
@pytest.mark.skipif(
    inference_perf.command() is None,
    reason="inference-perf is not installed (needs Python 3.12: make bench-inference-perf)",
)
def test_inference_perf_as_the_load_generator(tmp_path):
    (result,) = asyncio.run(
        compare.compare(
            "shared-prefix",
            ["epp"],
            [4.0],
            3.0,
            2,
            tmp_path,
            scale=0.1,
            progress=lambda m: None,
            load_generator="inference-perf",
        )
    )
    assert result.load_generator == "inference-perf" and result.succeeded == result.requests > 0, result.errors
    assert 0 < result.ttft_ms["p50"] <= result.ttft_ms["p99"] and result.output_tokens_per_s > 0
    assert sum(result.per_server) == result.requests  # the servers' own counters agree with the client's
    assert "(load generator: inference-perf)" in (tmp_path / "shared-prefix.md").read_text()


@pytest.mark.timing
def test_cli_lists_workloads_and_targets_and_rejects_unknown_ones_before_starting_anything():
    import subprocess
    import sys

    help_text = subprocess.run(
        [sys.executable, "-m", "harness.bench.cli", "compare", "--help"], capture_output=True, text=True, timeout=60
    ).stdout
    flat = "".join(help_text.split())  # argparse wraps lines, at hyphens too
    for name in ("multi-lora", "heterogeneous", "round-robin", "sglang-cache-aware", "prefix-only"):
        assert name in flat
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "harness.bench.cli", "compare", "--targets", "bogus"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "bogus" in result.stderr and time.monotonic() - started < 20
    with pytest.raises(ValueError, match="unknown target"):
        asyncio.run(compare.compare("shared-prefix", ["epp", "bogus"], [1.0], 1.0, 2, Path("/tmp/never-made")))


def test_chaos_smoke():
    from harness.bench import chaos

    report = asyncio.run(
        chaos.run(
            servers=2,
            seconds=1.0,
            progress=lambda _: None,
            only=("HTTP/2: 1-byte", "body flood via gateway", "answers left unread"),
        )
    )
    assert [r.attack for r in report.results] == [
        "body flood via gateway (40 MB)",
        "answers left unread (10 x 2.5 MB echoed)",
        "HTTP/2: 1-byte WINDOW_UPDATE",
    ]
    for result in report.results:
        assert result.answered_correctly == result.sent > 0 and result.lost == 0 and result.probes > 0, result
    assert "| HTTP/2: 1-byte WINDOW_UPDATE | 1 | 1 | 0 /" in chaos.markdown(report)


@pytest.mark.parametrize(
    ("text", "message"),
    [("plugins: [\n", "not valid YAML"), ("plugins:\n- type: no-such-plugin\n", "no-such-plugin"), (None, "Errno 2")],
)
def test_overhead_refuses_a_bad_epp_config_before_starting_anything(tmp_path, capsys, monkeypatch, text, message):
    monkeypatch.setattr(cli.signal, "signal", lambda *args: None)  # the CLI's handlers are for its own process
    path = tmp_path / "profile.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["overhead", "--epp-config", str(path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"--epp-config {path}" in err and message in err


def test_two_builds_are_compared_in_the_same_runs_with_their_slots_swapped(tmp_path):
    """`epp-bench overhead --against DIR`: each pair of runs puts this build and the other in the stack's EPP and the
    second EPP target, then the other way round, so that what the two slots differ by cancels out of the builds'
    difference. The other build here is this checkout, run from its directory (PYTHONPATH)."""
    here = Path(__file__).resolve().parents[2]
    comparison = asyncio.run(
        overhead.compare_builds(here, pairs=1, servers=2, sequential=20, concurrency=4, concurrent_requests=40)
    )
    first, swapped = comparison.runs
    assert set(first.latency_ms) == {overhead.PLAIN, overhead.EPP, f"{overhead.EPP} ({overhead.OTHER_BUILD})"}
    assert set(swapped.latency_ms) == {overhead.PLAIN, overhead.EPP, f"{overhead.EPP} ({overhead.THIS_BUILD})"}
    for quantile in ("p50", "p99"):
        builds, slots = comparison.differences(quantile)
        assert len(builds) == len(slots) == 1
        # the pair's figures are its runs': this build's ratio less the other's, averaged over both slots
        (a_this, a_other, a_slot), (b_this, b_other, b_slot) = (
            comparison._ratios(first, quantile),
            comparison._ratios(swapped, quantile),
        )
        plain = first.latency_ms[overhead.PLAIN][quantile]
        assert a_this == first.latency_ms[overhead.EPP][quantile] / plain
        assert builds[0] == pytest.approx((a_this - a_other + b_this - b_other) / 2)
        assert slots[0] == pytest.approx((a_slot + b_slot) / 2)
    report = comparison.markdown()
    assert f"this build less the other ({here}), p50" in report and "| 2 | the second slot |" in report


def test_overhead_against_refuses_what_is_not_a_checkout_before_starting_anything(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli.signal, "signal", lambda *args: None)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["overhead", "--against", str(tmp_path)])
    assert exit_info.value.code == 2 and "not a checkout of this repository" in capsys.readouterr().err


def test_another_checkout_s_epp_is_what_its_environment_runs_even_from_this_checkout(tmp_path, monkeypatch):
    """`python -m epp` puts the working directory first on the path: run from this checkout's root with only the
    other's PYTHONPATH, it would import this checkout's package. The other build's environment makes it the
    other's, and one that does not lead there is refused."""
    here = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(here)
    other = tmp_path / "other"
    (other / "epp").mkdir(parents=True)
    (other / "epp" / "__init__.py").write_text("")
    which = [sys.executable, "-c", "import epp; print(epp.__file__)"]
    naive = subprocess.run(which, env={**os.environ, "PYTHONPATH": str(other)}, capture_output=True, text=True)
    assert Path(naive.stdout.strip()) == here / "epp" / "__init__.py"
    env = overhead.build_environment(other)
    chosen = subprocess.run(which, env={**os.environ, **env}, capture_output=True, text=True, check=True)
    assert Path(chosen.stdout.strip()) == other / "epp" / "__init__.py"
    with pytest.raises(ValueError, match="not to that checkout's package"):
        overhead.build_environment(tmp_path / "not-a-checkout")


def test_agentic_smoke(tmp_path):
    """Agent sessions: chat turns, subagents and Responses follow-ups, all answered through the EPP."""
    from harness.bench import agentic
    from harness.bench.workloads import load_workload

    plan = agentic.sessions(load_workload("agentic"), 4.0, 3.0, 0, 0.1)
    assert plan == agentic.sessions(load_workload("agentic"), 4.0, 3.0, 0, 0.1)  # seeded: every target the same
    assert {s.api for s in plan} == {"chat", "responses"} and any(st.fork for s in plan for st in s.steps)
    (epp,) = asyncio.run(
        compare.compare("agentic", ["epp"], [4.0], 3.0, 2, tmp_path, scale=0.1, progress=lambda m: None)
    )
    assert epp.succeeded == epp.requests > len(plan) and epp.follow_ups_ok == epp.follow_ups > 0
    assert set(epp.by_kind) == {"chat turns", "subagent turns", "responses turns"}
    report = (tmp_path / "agentic.md").read_text()
    assert f"answered with their stored conversation: epp {epp.follow_ups}/{epp.follow_ups}" in report
    assert "the plan's floor" in report


def test_the_floor_is_what_perfect_affinity_leaves_to_prefill():
    from harness.bench import agentic
    from harness.bench.workloads import load_workload

    spec = load_workload("agentic")
    plan = agentic.sessions(spec, 4.0, 3.0, 0, 0.1)
    floor = agentic.floor(spec, plan, 0.1)
    assert floor.requests == sum(
        1 + len(s.steps) + sum(1 + len(st.fork.steps) for st in s.steps if st.fork) for s in plan
    )
    assert 4 <= floor.held["mean"] < floor.shared_only["mean"]  # a prefill step's overhead at least; less to prefill
    assert floor.held["p90"] <= floor.shared_only["p90"]


def test_the_oracle_routes_agent_sessions_itself_straight_to_the_servers(tmp_path):
    """The perfect-information reference: no proxy; every turn, subagent and Responses follow-up answered."""
    (oracle,) = asyncio.run(
        compare.compare("agentic", ["oracle"], [4.0], 3.0, 2, tmp_path, scale=0.1, progress=lambda m: None)
    )
    assert oracle.succeeded == oracle.requests and oracle.follow_ups_ok == oracle.follow_ups > 0
    assert all(oracle.per_server) and sum(oracle.per_server) == oracle.requests
    with pytest.raises(ValueError, match="only the agentic workloads"):
        asyncio.run(compare.compare("multi-lora", ["oracle"], [4.0], 1.0, 2, tmp_path, progress=lambda m: None))


def test_the_oracle_keeps_a_context_on_its_server_until_the_load_gap_reaches_the_handoff():
    from harness.bench.agentic import Oracle

    oracle = Oracle(["a", "b", "c"], handoff=2)
    first = oracle.pick("s1")  # a new session: the least loaded (ties: the fewest live contexts)
    assert first == "a" and oracle.pick("s2") == "b"
    oracle.done("a")
    oracle.done("b")
    assert oracle.pick("s1/0", parent="s1") == "a"  # a subagent starts where its parent's context is
    assert oracle.pick("s1") == "a"  # a gap of 2 over "c": the next turn would leave ...
    assert oracle.pick("s1") == "c"  # ... and does, taking its context along
    assert oracle.pick("s2", pinned=True) == "b"  # a Responses follow-up never leaves its stored response
    oracle.forget("s1")
    assert oracle.contexts == {"a": 1, "b": 1, "c": 0}


def test_repeat_picks_counts_an_endpoint_picked_again_within_the_window_and_by_whom():
    from harness.bench.compare import REPEAT_SECONDS, repeat_picks

    picks = [
        (9.999, "a", "epp"),  # before the measured run: counts only as the earlier pick
        (10.000, "a", "epp-1"),  # a repeat, another replica's pick before it
        (10.001, "b", "epp"),
        (10.002, "b", "epp"),  # a repeat of its own
        (10.003 + REPEAT_SECONDS, "b", "epp-1"),  # too late to be one
    ]
    assert repeat_picks(picks, since=10.0) == (2 / 4, 1 / 2)
    assert repeat_picks([], since=0.0) == (0.0, 0.0)
