"""slo-interference-filter over a trained predictor (synthetic pool: conftest.true_ttft / true_tpot)."""

import pytest

from epp.scheduling.scheduler import Scheduler
from epp.scheduling.types import CycleState, ResponseInfo, SchedulingRequest, SchedulingResult
from tests.epp.helpers import endpoint
from tests.epp.predictor.conftest import reading, trained

CHAT = {"x-llm-d-slo-ttft-ms": "300", "x-llm-d-slo-tpot-ms": "30"}


def req(prompt_tokens, headers=None, max_tokens=None):
    return SchedulingRequest("r", "m", "", prompt_tokens, headers=headers or {}, max_tokens=max_tokens)


def routed(plugin, request, to):
    """The request was picked for endpoint `to`: the plugin's at-pick hook, as the scheduler runs it."""
    result = SchedulingResult([to], candidates=[to], cycle_state=CycleState())
    plugin.pre_request(request, result)
    return result


def slacks(plugin, name):
    """The TPOT slacks of the requests in flight on endpoint `name`."""
    ledger = plugin.ledgers.get(name)
    return [b - ledger.stalled for b in ledger.tpot_budgets] if ledger else []


def test_a_long_prefill_avoids_the_endpoint_whose_tight_tpot_decode_it_would_break(predictions):
    trained(predictions)
    plugin = reading("slo-interference-filter", predictions)
    e0, e1 = endpoint(0), endpoint(1)
    chat = req(200, CHAT, max_tokens=30)
    routed(plugin, chat, e0)
    tpot = predictions.get(CycleState(), chat, [e0], tpot=True)[0][1]
    # the decode time it may lose and still average 30 ms per token: less than a 6,000-token prefill takes
    assert slacks(plugin, "e0") == pytest.approx([(0.030 - tpot) * 29])
    rate = predictions.predictor.backlog.seconds_per_token
    assert 200 * rate < slacks(plugin, "e0")[0] < 6000 * rate
    assert plugin.filter(CycleState(), req(6000), [e0, e1]) == [e1]
    assert plugin.filter(CycleState(), req(200), [e0, e1]) == [e0, e1]  # a short prefill breaks nothing


def test_every_later_prefill_on_the_endpoint_takes_its_time_off_the_slack(predictions):
    trained(predictions)
    plugin = reading("slo-interference-filter", predictions)
    e0 = endpoint(0)
    routed(plugin, req(200, {"x-llm-d-slo-tpot-ms": "100"}, max_tokens=256), e0)
    before = slacks(plugin, "e0")[0]
    routed(plugin, req(3000), e0)  # no objective of its own: it still stalls the decode there
    rate = predictions.predictor.backlog.seconds_per_token
    assert slacks(plugin, "e0") == pytest.approx([before - 3000 * rate])
    predictions.cached_tokens = lambda cycle_state, request, endpoints: [2000] * len(endpoints)
    routed(plugin, req(3000), e0)  # only the uncached part is prefilled
    assert slacks(plugin, "e0") == pytest.approx([before - 4000 * rate])


def test_when_every_candidate_breaks_some_the_fewest_broken_are_kept(predictions):
    trained(predictions)
    plugin = reading("slo-interference-filter", predictions)
    e0, e1, e2 = endpoint(0), endpoint(1), endpoint(2)
    for e in (e0, e0, e1, e2):
        routed(plugin, req(200, CHAT, max_tokens=30), e)
    routed(plugin, req(6000), e2)  # e2's chat lost its first token's slack: no placement saves it, it goes
    assert "e2" not in plugin.ledgers
    assert plugin.filter(CycleState(), req(6000), [e0, e1, e2]) == [e2]
    assert plugin.filter(CycleState(), req(6000), [e0, e1]) == [e1]


def test_a_long_prefill_avoids_an_endpoint_where_a_request_waits_for_its_first_token_within_a_tight_objective(
    predictions,
):
    trained(predictions)
    plugin = reading("slo-interference-filter", predictions)
    e0, e1 = endpoint(0), endpoint(1)
    chat = req(
        200, {"x-llm-d-slo-ttft-ms": "300", "x-llm-d-slo-tpot-ms": "100"}, max_tokens=256
    )  # a loose TPOT objective
    routed(plugin, chat, e0)
    ledger = plugin.ledgers["e0"]
    (entry,) = ledger.pending
    ttft, tpot = predictions.get(CycleState(), chat, [e0], tpot=True)[0]
    assert entry.ttft_budget - ledger.stalled == pytest.approx(0.3 - ttft)
    rate = predictions.predictor.backlog.seconds_per_token
    assert entry.ttft_budget - ledger.stalled < 3000 * rate < entry.tpot_budget - ledger.stalled
    assert plugin.filter(CycleState(), req(3000), [e0, e1]) == [e1]
    entry.first_token_at = 0.0  # its first token is out: only its decode can still be stalled
    assert plugin.filter(CycleState(), req(3000), [e0, e1]) == [e0, e1]
    routed(plugin, req(3000), e0)
    assert ledger.pending == []  # charged to its decode only
    assert slacks(plugin, "e0") == pytest.approx([(0.1 - tpot) * 255 - 3000 * rate])


@pytest.mark.parametrize("status", ["200", "503", ""])  # served, an error status, a reset or cancelled client
def test_an_entry_is_released_when_its_request_ends_however_it_ended(predictions, status):
    trained(predictions)
    scheduler = Scheduler.from_config(None, predictions)
    plugin = next(f for f in scheduler.profile.filters if f.typed_name.type == "slo-interference-filter")
    endpoints = [endpoint(0), endpoint(1)]
    requests = [req(200, CHAT, max_tokens=30) for _ in range(3)] + [req(200, max_tokens=30), req(200, CHAT)]
    results = []
    for request in requests:
        result = scheduler.schedule(request, endpoints)
        scheduler.on_picked(request, result)
        results.append(result)
    scheduler.record_picks()  # (the director's after_routed: the proxy has its answers)
    # the requests with objectives are tracked (the last one only for its TTFT: no max_tokens, no decode budget)
    ledgers = plugin.ledgers.values()
    assert sum(len(ledger.pending) for ledger in ledgers) == 4
    assert sum(len(ledger.tpot_budgets) for ledger in ledgers) == 3
    for request, result in zip(requests, results, strict=True):
        scheduler.on_finished(request, result, result.primary, ResponseInfo(status))
        scheduler.on_finished(request, result, result.primary, ResponseInfo(status))  # a second call: no effect
    assert plugin.ledgers == {}


def test_passes_every_candidate_while_cold(predictions):
    plugin = reading("slo-interference-filter", predictions)
    e0, e1 = endpoint(0), endpoint(1)
    routed(plugin, req(200, CHAT, max_tokens=30), e0)
    assert plugin.ledgers == {}  # nothing predicted: no slack to keep
    assert plugin.filter(CycleState(), req(6000), [e0, e1]) == [e0, e1]


def test_the_ledger_counts_what_charging_every_request_one_by_one_would():
    """Budgets on the endpoint's stall clock against slacks charged request by request, over random placements."""
    import math
    import random

    from epp.scheduling.plugins.slo_interference_filter import InFlight, Ledger

    rng = random.Random(7)
    ledger, slacks, now = Ledger(), [], 100.0  # slacks: [ttft slack, first token at, tpot slack] per live request
    for _ in range(400):
        now += rng.random() * 0.05
        if rng.random() < 0.4:  # a request with objectives arrives
            ttft, tpot = rng.choice((rng.random() * 0.3, math.inf)), rng.choice((rng.random() * 2, math.inf))
            if ttft == tpot == math.inf:
                continue
            f = InFlight("e", ttft + ledger.stalled, now + rng.random() * 0.2, tpot + ledger.stalled)
            ledger.add(f)
            slacks.append([ttft, f.first_token_at, tpot, f])
        stall = rng.random() * 0.6
        naive = sum(s[2] >= 0 and s[0] >= 0 and (s[2] < stall or (now < s[1] and s[0] < stall)) for s in slacks)
        assert ledger.broken(stall, now) == naive
        if rng.random() < 0.5:  # placed here: charge it
            ledger.stall(stall, now)
            for s in slacks:
                s[2] -= stall
                if now < s[1]:
                    s[0] -= stall
        if slacks and rng.random() < 0.2:  # one completes
            ledger.remove(slacks.pop(rng.randrange(len(slacks)))[3])
    while slacks:
        ledger.remove(slacks.pop()[3])
    assert not ledger
