"""The director feeds the latency predictor: a streamed response's first body chunk gives its TTFT and the usage's
completion_tokens its time per output token; or, without its body, the proxy's access-log record gives its TTFT
and its server's scraped inter-token latency its time per output token; a response that is not streamed teaches
nothing."""

import json
import time

import pytest

from epp.datalayer.endpoint import TTFT_SMOOTHING
from epp.metrics import EPPMetrics
from epp.requestcontrol import director as director_module
from tests.epp.test_server import make_picker

CONFIG = """\
plugins:
- type: predicted-latency-scorer
- type: queue-scorer
- type: prefix-cache-scorer
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: predicted-latency-scorer
  - pluginRef: queue-scorer
  - pluginRef: prefix-cache-scorer
"""


QUEUE_ONLY = """\
plugins:
- type: queue-scorer
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
"""


def serve(director, stream: bool, first_token_after: float, tokens: int = 5) -> None:
    ctx = director.new_request({":path": "/v1/completions"}, None)
    payload = {"model": "m", "prompt": "hello " * 50, "max_tokens": tokens, "stream": stream}
    director.route(ctx, payload, json.dumps(payload).encode())
    director.after_routed(ctx)
    director.on_response_headers(ctx, "200", None)
    time.sleep(first_token_after)
    director.on_response_chunk(ctx, b'data: {"choices":[{"text":"a"}]}\n\n', rewrite=False)
    usage = f'data: {{"choices":[],"usage":{{"prompt_tokens":60,"completion_tokens":{tokens}}}}}\n\n'.encode()
    director.on_response_chunk(ctx, usage, rewrite=False)
    director.on_complete(ctx)


def test_streamed_responses_train_the_predictor_and_others_do_not():
    director = make_picker(config=CONFIG)
    predictions = director.scheduler.predictions
    predictor = predictions.predictor
    # the scheduler handed the predictor the profile's prefix index: its expected cached tokens count
    assert predictions.cached_tokens == director.scheduler.prefix_index.cached_tokens
    before = predictor.observations
    serve(director, stream=False, first_token_after=0.0)
    assert predictor.observations == before  # its first chunk came after its last token: not a TTFT
    for _ in range(3):
        serve(director, stream=True, first_token_after=0.02)
    assert predictor.observations == before + 3
    metrics = EPPMetrics("pool")
    metrics.register(director.scheduler)
    assert metrics.registry.get_sample_value("inference_extension_latency_predictor_observations_total") == before + 3
    per_token = predictor.backlog.seconds_per_token
    for _ in range(30):  # long prompts alone: e0 takes twice as long per token as e1
        predictor.backlog.learn("e0", 5000, 0.0, 5000 * 2 * per_token)
        predictor.backlog.learn("e1", 5000, 0.0, 5000 * per_token)
    slowness = {
        s.labels["model_server_pod"]: s.value
        for metric in metrics.registry.collect()
        if metric.name == "inference_extension_latency_predictor_endpoint_slowness"
        for s in metric.samples
    }
    assert slowness["e0"] / slowness["e1"] == pytest.approx(2.0, rel=0.05)
    assert all(e.in_flight_requests == 0 for e in director.datastore.endpoints)


def test_a_bursts_next_request_sees_the_prefill_routed_before_it():
    """Requests of one burst are all scheduled before the proxy gets any answer (after_routed comes later): each
    one's prompt joins its pick's prefill backlog before the next decision, so the next one's prediction counts it;
    the last one's joins once the proxy has its answer."""
    director = make_picker(config=CONFIG)
    backlog = director.scheduler.predictions.predictor.backlog

    def queued() -> float:  # prompt tokens (~6,000 each) in the pool's prefill backlogs, drained ~0.1 ms a token
        now = time.monotonic()
        return sum(backlog.tokens(e.spec.name, now) for e in director.datastore.endpoints)

    contexts = []
    for _ in range(3):
        ctx = director.new_request({":path": "/v1/completions"}, None)
        payload = {"model": "m", "prompt": "long prompt " * 2000, "max_tokens": 5}
        director.route(ctx, payload, json.dumps(payload).encode())
        contexts.append(ctx)
    assert 1.5 * 6000 < queued() <= 2 * 6000  # the third decision saw the first two; before any after_routed
    director.after_routed(contexts[-1])
    assert queued() > 2.5 * 6000  # all three
    for ctx in contexts:
        director.after_routed(ctx)
        director.on_complete(ctx)


def test_requests_with_objectives_leave_the_interference_filter_however_they_end():
    """slo-interference-filter keeps each request with objectives in flight per endpoint; the director's completion
    (once per routed request) releases it whether it was served, failed with a status or was reset."""
    from tests.epp.predictor.conftest import train

    director = make_picker()
    predictor = director.scheduler.predictions.predictor
    predictor.min_observations = 50
    train(predictor)
    plugin = next(f for f in director.scheduler.profile.filters if f.typed_name.type == "slo-interference-filter")
    headers = {":path": "/v1/completions", "x-slo-ttft-ms": "300", "x-slo-tpot-ms": "50"}
    contexts = []
    for _ in range(3):
        ctx = director.new_request(dict(headers), None)
        payload = {"model": "m", "prompt": "hello " * 50, "max_tokens": 64, "stream": True}
        director.route(ctx, payload, json.dumps(payload).encode())
        director.after_routed(ctx)
        contexts.append(ctx)
    assert sum(len(ledger.tpot_budgets) for ledger in plugin.ledgers.values()) == 3
    served, failed, _reset = contexts  # the third gets no response headers: a reset
    director.on_response_headers(served, "200", None)
    director.on_response_headers(failed, "503", None)
    for ctx in contexts:
        director.on_complete(ctx)
    assert plugin.ledgers == {}


def routed(director, request_id: str, stream: bool = True):
    ctx = director.new_request({":path": "/v1/completions", "x-request-id": request_id}, None)
    payload = {"model": "m", "prompt": "hello " * 50, "max_tokens": 5, "stream": stream}
    director.route(ctx, payload, json.dumps(payload).encode())
    director.after_routed(ctx)
    return ctx


def ended(director, ctx, status: str = "200") -> None:
    director.on_response_headers(ctx, status, None)
    director.on_complete(ctx)


def test_access_log_records_train_the_predictor_once_the_proxy_sends_them():
    director = make_picker(config=CONFIG)
    predictor = director.scheduler.predictions.predictor
    ended(director, routed(director, "before"))
    director.on_access_log("before", 0.05, "200", None)
    assert predictor.observations == 0  # the proxy's first record: until then nothing waited for one
    assert director.access_log_seen
    for i in range(3):
        ended(director, routed(director, f"r{i}"))
        director.on_access_log(f"r{i}", 0.04, "200", None)
        director.on_access_log(f"r{i}", 0.04, "200", None)  # a second record of the id: nothing left to learn
    assert predictor.observations == 3
    early = routed(director, "early")
    director.on_access_log(
        "early", 0.04, "200", None
    )  # before the EPP saw its end (under load the proxy's flush can win)
    assert predictor.observations == 3 and "early" in director.early_records
    ended(director, early)  # the record was waiting for it
    assert predictor.observations == 4 and "early" not in director.early_records
    director.awaiting_records.clear()
    ended(director, routed(director, "unstreamed", stream=False))
    ended(director, routed(director, "failed"), status="503")
    director.on_access_log("unstreamed", 0.3, "200", None)  # its first body byte came with its last token: not a TTFT
    director.on_access_log("failed", 0.01, "200", None)
    director.on_access_log("unknown", 0.01, "200", None)
    assert predictor.observations == 4
    assert director.awaiting_records == {}


def test_an_access_logged_request_learns_its_time_per_output_token_from_its_servers_scrapes(monkeypatch):
    """The record gives TTFT; the time per output token is the endpoint's scraped mean gap between tokens from the
    first token to the request's end. Without such scrapes it learns TTFT alone."""
    director = make_picker(config=CONFIG)
    predictor = director.scheduler.predictions.predictor
    observed = []
    monkeypatch.setattr(predictor, "observe", lambda features, ttft, tpot: observed.append((ttft, tpot)))
    director.on_access_log("-", 0.05, "200", None)  # the proxy sends records
    ctx = routed(director, "r")
    endpoint = ctx.endpoint
    endpoint.record_inter_token_totals(ctx.routed_at + 0.01, 1.0, 100)
    endpoint.record_inter_token_totals(ctx.routed_at + 0.3, 1.5, 120)
    time.sleep(0.35)
    ended(director, ctx)
    director.on_access_log("r", 0.005, "200", None)
    assert observed == [(0.005, pytest.approx(0.5 / 20))]
    ended(director, routed(director, "unscraped"))  # its decode has no samples of its own
    director.on_access_log("unscraped", 0.005, "200", None)
    assert observed[1] == (0.005, None)


def test_the_first_source_of_timings_wins_and_ambiguous_ids_teach_nothing():
    director = make_picker(config=CONFIG)
    predictor = director.scheduler.predictions.predictor
    director.on_access_log("-", 0.05, "200", None)  # the proxy sends records
    serve(director, stream=True, first_token_after=0.01)  # its body came through: learnt at its end
    assert predictor.observations == 1 and director.awaiting_records == {}
    first, second = routed(director, "same"), routed(director, "same")  # one id, two requests
    for ctx in (first, second):
        ended(director, ctx)
    assert "same" not in director.awaiting_records
    director.on_access_log("same", 0.05, "200", None)
    assert predictor.observations == 1


def test_requests_awaiting_a_record_are_bounded_in_number_and_age(monkeypatch):
    monkeypatch.setattr(director_module, "AWAITING_RECORDS_LIMIT", 4)
    director = make_picker(config=CONFIG)
    director.on_access_log("-", 0.05, "200", None)
    for i in range(10):
        ended(director, routed(director, f"r{i}"))  # no record ever comes
    assert list(director.awaiting_records) == ["r6", "r7", "r8", "r9"]
    director.on_access_log("r9", 0.04, "200", None)
    monkeypatch.setattr(director_module, "AWAITING_RECORDS_SECONDS", 0.0)
    time.sleep(0.001)
    ended(director, routed(director, "late"))  # within the limit, but the oldest has waited too long
    assert list(director.awaiting_records) == ["r7", "r8", "late"]
    assert all(e.in_flight_requests == 0 for e in director.datastore.endpoints)
    for i in range(10):  # records of requests it does not wait for (yet): the same bounds
        director.on_access_log(f"other{i}", 0.04, "200", None)
    assert list(director.early_records) == ["other6", "other7", "other8", "other9"]
    monkeypatch.setattr(director_module, "EARLY_RECORDS_SECONDS", 0.0)
    time.sleep(0.001)
    director.on_access_log("other5", 0.04, "200", None)
    director.on_access_log("other6", 0.04, "200", None)  # the oldest goes for each new one, whether by size or by age
    assert list(director.early_records) == ["other8", "other9", "other5", "other6"]


def test_without_a_plugin_that_reads_timings_nothing_waits_for_them():
    director = make_picker(config=QUEUE_ONLY)
    director.on_access_log("-", 0.05, "200", None)
    ended(director, routed(director, "r"))
    assert director.awaiting_records == {}


def test_says_once_that_no_timings_reach_it(caplog, monkeypatch):
    """Once UNTIMED_RESPONSES_WARNING successful responses have ended over at least UNTIMED_WARNING_SECONDS: a burst
    at start-up that ends before the proxy's first access-log flush is not reason enough. (Time passes by moving the
    first untimed response back, not by sleeping: a loaded machine can take longer than a short window.)"""
    monkeypatch.setattr(director_module, "UNTIMED_WARNING_SECONDS", 60.0)
    director = make_picker(config=CONFIG)
    said = lambda: [r for r in caplog.records if "access log" in r.getMessage()]  # noqa: E731
    with caplog.at_level("WARNING"):
        for i in range(director_module.UNTIMED_RESPONSES_WARNING - 1):
            ended(director, routed(director, f"ok{i}"))
            ended(director, routed(director, f"failed{i}"), status="503")  # failures do not count
        ended(director, routed(director, "100th"))
        assert not said()  # 100, but within UNTIMED_WARNING_SECONDS
        director.untimed_since -= 60.0
        for i in range(3 * director_module.UNTIMED_RESPONSES_WARNING):
            ended(director, routed(director, f"more{i}"))
    assert len(said()) == 1


def test_no_warning_once_timings_came(caplog):
    director = make_picker(config=CONFIG)
    serve(director, stream=True, first_token_after=0.0)  # the body came through: timings
    with caplog.at_level("WARNING"):
        for i in range(2 * director_module.UNTIMED_RESPONSES_WARNING):
            ended(director, routed(director, f"r{i}", stream=False))
    assert not [r for r in caplog.records if "access log" in r.getMessage()]


def test_without_response_headers_the_access_log_record_brings_status_and_served_endpoint():
    """Our bootstrap skips the response-headers round trip when the access log brings every request's record: an
    ended request's status metrics and timings wait for its record, or take one that came first."""
    director = make_picker(config=CONFIG)
    predictor = director.scheduler.predictions.predictor
    metrics = director.metrics
    first = routed(director, "first")
    director.on_complete(first)  # before the proxy's first record: it waits for one all the same
    assert list(director.awaiting_records) == ["first"]
    director.on_access_log("first", 0.05, "200", first.result.primary.hostport)  # the proxy sends records
    assert director.access_log_seen and director.awaiting_records == {}
    assert {key: child.value for key, child in metrics.served.children.items()} == {("pick",): 1.0}
    metrics.served.children.clear()
    ok = routed(director, "ok")
    pick = ok.endpoint.hostport
    director.on_complete(ok)  # no response headers came
    assert "ok" in director.awaiting_records and predictor.observations == 1
    director.on_access_log("ok", 0.04, "200", pick)
    assert predictor.observations == 2 and director.awaiting_records == {}
    failed = routed(director, "failed")
    director.on_access_log("failed", None, "503", "10.9.9.9:8000")  # its record came before its end
    director.on_complete(failed)
    assert predictor.observations == 2 and "failed" not in director.early_records
    assert {key[-1]: child.value for key, child in metrics.errors.children.items()} == {"503": 1.0}
    assert {key: child.value for key, child in metrics.served.children.items()} == {("pick",): 1.0, ("other",): 1.0}
    assert sum(sum(child.counts) for child in metrics.duration.children.values()) == 2  # "first" and "ok"


def test_without_a_plugin_that_reads_timings_a_request_still_waits_for_its_status():
    director = make_picker(config=QUEUE_ONLY)
    director.on_access_log("-", 0.05, "200", None)
    ctx = routed(director, "r")
    pick = ctx.endpoint.hostport
    director.on_complete(ctx)
    assert list(director.awaiting_records) == ["r"]
    director.on_access_log("r", None, "200", pick)
    assert director.awaiting_records == {}
    assert {key: child.value for key, child in director.metrics.served.children.items()} == {("pick",): 1.0}


def test_before_the_proxys_first_record_few_requests_wait_for_one(monkeypatch):
    """A proxy that sends neither response headers nor access-log records costs a small table, not the full one."""
    monkeypatch.setattr(director_module, "UNCONFIRMED_AWAITING_LIMIT", 2)
    director = make_picker(config=QUEUE_ONLY)
    for i in range(5):
        director.on_complete(routed(director, f"r{i}"))
    assert list(director.awaiting_records) == ["r3", "r4"]
    assert all(e.in_flight_requests == 0 for e in director.datastore.endpoints)


def test_an_ended_request_keeps_its_scheduling_result_only_while_its_timings_may_come():
    """What a request's scheduling cycle left (candidates, scores, cycle state) is read after its end only to learn
    a streamed response's timings: a request that is not streamed lets it go as it ends, though it may wait for its
    access-log record (its status) for up to the proxy's flush interval."""
    director = make_picker(config=CONFIG)
    predictor = director.scheduler.predictions.predictor
    director.on_access_log("-", 0.05, "200", None)  # the proxy sends records
    for request_id, stream in (("plain", False), ("streamed", True)):
        ctx = routed(director, request_id, stream=stream)
        director.on_complete(ctx)  # no response headers came: its status comes with its record
        assert director.awaiting_records[request_id][1] is ctx
        assert (ctx.result is not None) is stream
    director.on_access_log("plain", None, "200", None)
    director.on_access_log("streamed", 0.01, "200", None)
    assert director.awaiting_records == {} and predictor.observations == 1


def test_without_response_headers_a_prompt_stops_counting_as_pending_once_its_picks_recent_ttft_passed():
    """The proxy skips the response headers: the EPP never sees the pick answer, so a prompt counts in its pick's
    in_flight_tokens (pending prefill) until the pick's recent TTFT, learnt from access-log records, has passed."""
    director = make_picker(config=QUEUE_ONLY)
    first = routed(director, "first")
    pick = first.endpoint
    tokens = first.request.prompt_tokens_estimate
    assert pick.in_flight_tokens == tokens > 0 and not director.prefilling  # no TTFT known there: until its end
    director.on_complete(first)
    assert pick.in_flight_tokens == 0
    director.on_access_log("first", 0.02, "200", pick.hostport)
    director.on_access_log("-", 0.5, "200", pick.hostport)  # another replica's request: not this EPP's to learn
    assert pick.recent_ttft == 0.02

    def to_pick(request_id: str):
        ctx = director.new_request({":path": "/v1/completions", "x-request-id": request_id}, frozenset([pick.hostport]))
        payload = {"model": "m", "prompt": "hello " * 50, "max_tokens": 5, "stream": True}
        director.route(ctx, payload, json.dumps(payload).encode())
        assert ctx.endpoint is pick
        return ctx

    second = to_pick("second")
    assert pick.in_flight_tokens == tokens and len(director.prefilling) == 1
    time.sleep(0.03)
    third = to_pick("third")  # the next scheduling cycle sees the second's prefill over
    assert pick.in_flight_tokens == tokens and pick.in_flight_requests == 2
    director.on_complete(second)  # its tokens were released already: not twice
    assert pick.in_flight_tokens == tokens and pick.in_flight_requests == 1
    director.on_access_log("second", 0.04, "200", pick.hostport)
    assert pick.recent_ttft == pytest.approx(0.02 + TTFT_SMOOTHING * 0.02)
    director.on_response_headers(third, "200", pick.hostport)  # the proxy sends them after all: it says when
    assert pick.in_flight_tokens == 0
    fourth = to_pick("fourth")
    assert len(director.prefilling) == 1  # the third's entry, due later; none for the fourth
    time.sleep(0.03)
    director.on_complete(third)
    director.on_complete(fourth)
    to_pick("fifth")
    assert director.prefilling == [] and pick.in_flight_tokens == tokens
