"""llm-d router v1's names beside the older ones: request headers (the new name wins), the dropped-reason header on
every drop, the llm_d_epp_* metric twins, the EndpointPickerConfig apiVersions (docs/llm-d-names.md)."""

import asyncio
import json

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from epp.config import ConfigError
from epp.config.loader import API_VERSIONS, load
from epp.datalayer.datastore import PoolCollector
from epp.datalayer.endpoint import EndpointSpec, PoolState
from epp.flowcontrol import FlowControlConfig, FlowController
from epp.metrics import LEGACY_PREFIXES, BoundedLabel, current_name
from protocol.extproc import HEADER_ALIASES, canonical_headers
from tests.epp.test_director_flow_control import dropped_reason, start
from tests.epp.test_server import BASE_HEADERS, body_message, headers_message, make_picker, new_stream

NEW_AND_OLD = [
    ("x-llm-d-inference-objective", "x-gateway-inference-objective"),
    ("x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id"),
    ("x-llm-d-model-name-rewrite", "x-gateway-model-name-rewrite"),
    ("x-llm-d-slo-ttft-ms", "x-slo-ttft-ms"),
    ("x-llm-d-slo-tpot-ms", "x-slo-tpot-ms"),
]


def test_the_five_headers_and_their_aliases_are_llm_d_s():
    assert sorted(HEADER_ALIASES.items()) == sorted(NEW_AND_OLD)


@pytest.mark.parametrize(("new", "old"), NEW_AND_OLD)
def test_an_alias_is_read_under_the_new_name_and_the_new_name_wins(new, old):
    assert canonical_headers({old: "1"})[new] == "1"
    assert canonical_headers({old: "1", new: "2"})[new] == "2"
    assert canonical_headers({old: "1", new: ""})[new] == ""  # present, even empty, it wins (llm-d's rule)
    assert new not in canonical_headers({"x-other": "1"})


def route(director, headers: dict, body: bytes = b'{"model": "m", "prompt": "x"}'):
    stream = new_stream(director)
    stream.handle(headers_message({**BASE_HEADERS, **headers}))
    return stream.handle(body_message(body))


@pytest.mark.parametrize(
    ("headers", "priority"),
    [
        ({"x-llm-d-inference-objective": "batch"}, -1),
        ({"x-gateway-inference-objective": "batch"}, -1),
        ({"x-llm-d-inference-objective": "chat", "x-gateway-inference-objective": "batch"}, 3),
    ],
)
def test_the_objective_header_by_either_name_sets_the_priority(headers, priority):
    state = PoolState(endpoints=(EndpointSpec("a", "10.0.0.1", 8000),), objectives={"batch": -1, "chat": 3})
    director = make_picker(state)
    seen = []
    schedule = director.scheduler.schedule
    director.scheduler.schedule = lambda request, *rest: seen.append(request) or schedule(request, *rest)
    route(director, {**headers, "x-gateway-inference-fairness-id": "old", "x-llm-d-inference-fairness-id": "new"})
    (request,) = seen
    assert request.priority == priority and request.fairness_id == "new"
    assert request.headers["x-llm-d-inference-objective"] in ("batch", "chat")


@pytest.mark.parametrize(
    ("headers", "model"),
    [
        ({"x-llm-d-model-name-rewrite": "m-new"}, "m-new"),
        ({"x-gateway-model-name-rewrite": "m-old"}, "m-old"),
        ({"x-llm-d-model-name-rewrite": "m-new", "x-gateway-model-name-rewrite": "m-old"}, "m-new"),
    ],
)
def test_the_model_rewrite_header_by_either_name(headers, model):
    responses = route(make_picker(), headers)
    body = b"".join(r.request_body.response.body_mutation.streamed_response.body for r in responses[1:])
    assert json.loads(body)["model"] == model


def test_every_drop_carries_llm_d_s_dropped_reason():
    (empty,) = route(make_picker(PoolState()), {})
    assert empty.immediate_response.status.code == 503 and dropped_reason(empty) == b"rejected-no-endpoints"
    state = PoolState(endpoints=(EndpointSpec("a", "10.0.0.1", 8000),), objectives={"batch": -1})
    picker = make_picker(state)
    picker.datastore.endpoints[0].metrics.waiting = 10  # saturated: a sheddable request is shed
    (shed,) = route(picker, {"x-llm-d-inference-objective": "batch"})
    assert shed.immediate_response.status.code == 429 and dropped_reason(shed) == b"rejected-saturated"
    (bad,) = route(make_picker(), {}, b"{not json")
    assert bad.immediate_response.status.code == 400 and dropped_reason(bad) is None  # not a drop: a bad request


async def test_a_full_band_is_a_saturated_drop():
    director = make_picker()
    config = FlowControlConfig.from_config({"defaultPriorityBand": {"maxRequests": 1}})
    director.flow_control = FlowController(config, lambda in_flight: False)  # no room: requests queue
    replies: list = []
    first, _ = start(director, replies, "a")
    await asyncio.sleep(0)  # it waits in its band, which holds one
    second, _ = start(director, replies, "a")
    await asyncio.sleep(0.01)
    ((full,),) = replies  # the band is full: the second is turned away
    assert full.immediate_response.status.code == 429 and dropped_reason(full) == b"rejected-saturated"
    first.finish()
    second.finish()


def families(director) -> dict:
    metrics = director.metrics
    metrics.register(PoolCollector("pool", director.datastore))
    route(director, {})
    return {f.name: f for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())}


def summed(samples, labels: set[str], renames: dict[str, str] | None = None) -> dict:
    """(suffix, labels) -> value: `samples` summed over every label but `labels` (renamed as `renames` says)."""
    renames = renames or {}
    total: dict = {}
    for suffix, sample_labels, value in samples:
        kept = tuple(sorted((renames.get(k, k), v) for k, v in sample_labels.items() if k in labels or k == "le"))
        total[suffix, kept] = total.get((suffix, kept), 0) + value
    return total


def test_every_older_family_has_its_llm_d_epp_twin_with_the_same_samples():
    director = make_picker()
    director.datastore.endpoints[0].metrics.waiting = 3
    found = families(director)
    legacy = [f for name, f in found.items() if name.startswith(LEGACY_PREFIXES)]
    assert {f.name.split("_")[1] for f in legacy} == {"objective", "pool", "extension"}
    for family in legacy:
        name, renames = current_name(family.name)
        twin = found[name]
        older_labels = {k for s in family.samples for k in s.labels} - {"le"}
        # the twin's samples, summed over the labels only it carries (fairness_id, priority), are the older family's
        ours = summed([(s.name[len(family.name) :], s.labels, s.value) for s in family.samples], older_labels, renames)
        renamed_labels = {renames.get(k, k) for k in older_labels}
        theirs = summed([(s.name[len(name) :], s.labels, s.value) for s in twin.samples], renamed_labels)
        assert theirs == ours, family.name
    # the names llm-d chose where the twin is not a plain prefix swap
    assert found["llm_d_epp_ready_endpoints"].samples[0].value == 2
    queues = {s.labels["model_server_endpoint"]: s.value for s in found["llm_d_epp_per_endpoint_queue_size"].samples}
    assert queues["a"] == 3
    assert "llm_d_epp_request_input_tokens" in found and "llm_d_epp_request_running" in found
    assert not [n for n in found if n.startswith("llm_d_epp_inference_")]


def test_llm_d_epp_request_series_carry_the_fairness_id_and_priority_and_their_older_twins_do_not():
    state = PoolState(endpoints=(EndpointSpec("a", "10.0.0.1", 8000),), objectives={"batch": -1, "chat": 3})
    director = make_picker(state)
    metrics = director.metrics
    metrics.fairness_label = BoundedLabel(3)  # llm-d's cap (MAX_LABEL_VALUES, 1,000) with fewer tenants
    for tenant, objective in [("", ""), ("t1", "chat"), ("t1", "chat"), ("t2", "batch"), ("t3", "chat")]:
        headers = {"x-llm-d-inference-fairness-id": tenant} if tenant else {}
        stream = new_stream(director)
        stream.handle(headers_message({**BASE_HEADERS, **headers, "x-llm-d-inference-objective": objective}))
        stream.handle(body_message(b'{"model": "m", "prompt": "x"}'))
        stream.after_reply()  # (the decision's histograms: the prompt's tokens)
    route(director, {"x-llm-d-inference-fairness-id": "t1"}, b'{"prompt": "no model"}')  # 400 before scheduling
    page = {f.name: f for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())}

    def values(name: str, suffix: str = "") -> dict:
        return {tuple(sorted(s.labels.items())): s.value for s in page[name].samples if s.name == name + suffix}

    def key(**labels) -> tuple:
        return tuple(sorted({"model_name": "m", "target_model_name": "m", **labels}.items()))

    # a request without a fairness id is llm-d's "default-flow", a value like the others: t3 is past the cap, "other"
    assert values("llm_d_epp_request", "_total") == {
        key(fairness_id="default-flow", priority="0"): 1,
        key(fairness_id="t1", priority="3"): 2,
        key(fairness_id="t2", priority="-1"): 1,
        key(fairness_id="other", priority="3"): 1,
    }
    # llm-d's older request_total keeps the priority, not the fairness id
    assert values("inference_objective_request", "_total") == {
        key(priority="0"): 1,
        key(priority="3"): 3,
        key(priority="-1"): 1,
    }
    assert values("llm_d_epp_request_running")[key(fairness_id="t1", priority="3")] == 2
    assert values("inference_objective_running_requests") == {(("model_name", "m"),): 5}
    assert set(values("llm_d_epp_request_input_tokens", "_count")) == set(values("llm_d_epp_request", "_total"))
    # an error before the request's flow is known: llm-d's defaults
    unnamed = {"model_name": "", "target_model_name": ""}
    assert values("llm_d_epp_request_error", "_total") == {
        key(**unnamed, fairness_id="default-flow", priority="0", error_code="400"): 1
    }
    assert values("inference_objective_request_error", "_total") == {key(**unnamed, error_code="400"): 1}


@pytest.mark.parametrize("api_version", API_VERSIONS)
def test_llm_d_v1_and_the_older_api_versions_are_read_alike(api_version):
    text = f"apiVersion: {api_version}\nkind: EndpointPickerConfig\nplugins: []\n"
    assert load(text).plugins == []
    assert API_VERSIONS[0] == "llm-d.ai/v1"
    with pytest.raises(ConfigError, match="apiVersion"):
        load("apiVersion: llm-d.ai/v2\nkind: EndpointPickerConfig\n")
