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
from epp.metrics import LEGACY_PREFIXES, current_name
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


def test_every_older_family_has_its_llm_d_epp_twin_with_the_same_samples():
    director = make_picker()
    director.datastore.endpoints[0].metrics.waiting = 3
    found = families(director)
    legacy = [f for name, f in found.items() if name.startswith(LEGACY_PREFIXES)]
    assert {f.name.split("_")[1] for f in legacy} == {"objective", "pool", "extension"}
    for family in legacy:
        name, labels = current_name(family.name)
        twin = found[name]
        renamed = [
            (s.name[len(family.name) :], {labels.get(k, k): v for k, v in s.labels.items()}, s.value)
            for s in family.samples
        ]
        assert [(s.name[len(name) :], s.labels, s.value) for s in twin.samples] == renamed
    # the names llm-d chose where the twin is not a plain prefix swap
    assert found["llm_d_epp_ready_endpoints"].samples[0].value == 2
    queues = {s.labels["model_server_endpoint"]: s.value for s in found["llm_d_epp_per_endpoint_queue_size"].samples}
    assert queues["a"] == 3
    assert "llm_d_epp_request_input_tokens" in found and "llm_d_epp_request_running" in found
    assert not [n for n in found if n.startswith("llm_d_epp_inference_")]


@pytest.mark.parametrize("api_version", API_VERSIONS)
def test_llm_d_v1_and_the_older_api_versions_are_read_alike(api_version):
    text = f"apiVersion: {api_version}\nkind: EndpointPickerConfig\nplugins: []\n"
    assert load(text).plugins == []
    assert API_VERSIONS[0] == "llm-d.ai/v1"
    with pytest.raises(ConfigError, match="apiVersion"):
        load("apiVersion: llm-d.ai/v2\nkind: EndpointPickerConfig\n")
