"""render_bootstrap: the response-header trip (skipped only when the access log brings the EPP every request's status),
and what an InferencePool decides (FailOpen/FailClose, the model servers' protocol, the ranks)."""

import subprocess

import pytest
import yaml

from harness.envoy import GatewayPool, envoy_binary, render_bootstrap, render_kubernetes_bootstrap


def ext_proc_mode(**overrides) -> str:
    text = render_bootstrap(epp_host="127.0.0.1", epp_port=9002, fallback_endpoints=["127.0.0.1:8000"], **overrides)
    listener = yaml.safe_load(text)["static_resources"]["listeners"][0]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    (ext_proc,) = [f for f in manager["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"]
    return ext_proc["typed_config"]["processing_mode"]["response_header_mode"]


@pytest.mark.parametrize(
    ("overrides", "mode"),
    [
        ({}, "SKIP"),  # every record comes to the one EPP: it carries the status and served endpoint
        ({"access_log_percent": 50}, "SEND"),  # half the requests would have no status
        ({"access_log_percent": 0}, "SEND"),
        ({"response_body_mode": "FULL_DUPLEX_STREAMED"}, "SEND"),  # a rewritten body needs the headers' answer
        ({"more_epp_endpoints": ["127.0.0.1:9003"]}, "SEND"),  # each replica gets a share of the records
        # sharing replicas forward each other the records that are not theirs (epp.replicas)
        ({"more_epp_endpoints": ["127.0.0.1:9003"], "records_forwarded": True}, "SKIP"),
        ({"response_header_mode": "SEND"}, "SEND"),
        ({"access_log_percent": 0, "response_header_mode": "SKIP"}, "SKIP"),
    ],
)
def test_the_response_header_trip_is_skipped_only_when_records_bring_every_status(overrides, mode):
    assert ext_proc_mode(**overrides) == mode


POOL = {
    "apiVersion": "inference.networking.k8s.io/v1",
    "kind": "InferencePool",
    "metadata": {"name": "p"},
    "spec": {
        "selector": {"matchLabels": {"app": "m"}},
        "targetPorts": [{"number": 3000}, {"number": 3002}, {"number": 3004}],
        "appProtocol": "kubernetes.io/h2c",
        "endpointPickerRef": {"name": "epp", "port": {"number": 9002}, "failureMode": "FailOpen"},
    },
}


def pool_bootstrap(pool: dict) -> dict:
    gateway = GatewayPool.from_inference_pool(pool)
    return yaml.safe_load(
        render_bootstrap(
            epp_host="127.0.0.1",
            epp_port=9002,
            fallback_endpoints=gateway.endpoints(["10.0.0.1", "10.0.0.2"]),
            fail_open=gateway.fail_open,
            app_protocol=gateway.app_protocol,
        )
    )


def clusters(bootstrap: dict) -> dict:
    return {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}


def routes(bootstrap: dict) -> dict:
    manager = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return {r["name"]: r for r in manager["route_config"]["virtual_hosts"][0]["routes"]}


def ext_proc(bootstrap: dict) -> dict:
    manager = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return next(f for f in manager["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")["typed_config"]


MODEL_SERVER_CLUSTERS = ("original_destination_cluster", "fallback_1", "fallback_2", "pool_fallback")


def test_a_fail_open_h2c_pool_with_three_ranks():
    bootstrap = pool_bootstrap(POOL)
    assert ext_proc(bootstrap)["failure_mode_allow"] is True
    assert ext_proc(bootstrap)["processing_mode"]["request_body_mode"] == "BUFFERED"  # Envoy fails open only so
    assert routes(bootstrap)["not-picked-by-epp"]["route"]["cluster"] == "pool_fallback"
    retry = routes(bootstrap)["not-picked-by-epp"]["route"]["retry_policy"]  # it failed open: a server may be down too
    assert retry["retry_on"] == "connect-failure,reset" and retry["num_retries"] == 2
    assert retry["retry_host_predicate"][0]["name"] == "envoy.retry_host_predicates.previous_hosts"
    for name in MODEL_SERVER_CLUSTERS:
        options = clusters(bootstrap)[name]["typed_extension_protocol_options"]
        assert options["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]["explicit_http_config"] == {
            "http2_protocol_options": {}
        }, name
    fallback = clusters(bootstrap)["pool_fallback"]["load_assignment"]["endpoints"][0]["lb_endpoints"]
    addresses = [
        (
            e["endpoint"]["address"]["socket_address"]["address"],
            e["endpoint"]["address"]["socket_address"]["port_value"],
        )
        for e in fallback
    ]
    assert addresses == [(h, p) for h in ("10.0.0.1", "10.0.0.2") for p in (3000, 3002, 3004)]
    # the EPP's own cluster is gRPC: HTTP/2 whatever the model servers speak
    assert (
        "http2_protocol_options"
        in clusters(bootstrap)["epp"]["typed_extension_protocol_options"][
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
        ]["explicit_http_config"]
    )


def test_a_fail_close_http_pool_never_bypasses_the_epp():
    spec = {**POOL["spec"], "appProtocol": "http", "endpointPickerRef": {"name": "epp", "port": {"number": 9002}}}
    bootstrap = pool_bootstrap({**POOL, "spec": spec})  # failureMode omitted: FailClose, the CRD's default
    assert ext_proc(bootstrap)["failure_mode_allow"] is False
    assert ext_proc(bootstrap)["processing_mode"]["request_body_mode"] == "FULL_DUPLEX_STREAMED"
    unpicked = routes(bootstrap)["not-picked-by-epp"]
    assert "route" not in unpicked and unpicked["direct_response"]["status"] == 503
    for name in MODEL_SERVER_CLUSTERS:
        options = clusters(bootstrap)[name]["typed_extension_protocol_options"]
        assert options["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]["explicit_http_config"] == {
            "http_protocol_options": {}
        }, name


def test_the_observed_responses_route_follows_the_failure_mode():
    for fail_open, key in ((True, "route"), (False, "direct_response")):
        text = render_bootstrap(
            epp_host="127.0.0.1",
            epp_port=9002,
            fallback_endpoints=["127.0.0.1:8000"],
            fail_open=fail_open,
            response_body_mode="FULL_DUPLEX_STREAMED",
            observed_responses_percent=10,
        )
        assert key in routes(yaml.safe_load(text))["not-picked-by-epp-observed"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"appProtocol": "grpc"}, "appProtocol must be one of"),
        ({"targetPorts": []}, "no targetPorts"),
        ({"endpointPickerRef": {"name": "e", "failureMode": "Maybe"}}, "failureMode must be"),
    ],
)
def test_a_pool_the_gateway_cannot_honour_is_refused(change, message):
    with pytest.raises(ValueError, match=message):
        GatewayPool.from_inference_pool({**POOL, "spec": {**POOL["spec"], **change}})
    with pytest.raises(ValueError, match=r"not an inference.networking.k8s.io/v1 InferencePool"):
        GatewayPool.from_inference_pool({**POOL, "apiVersion": "inference.networking.x-k8s.io/v1alpha2"})


@pytest.mark.parametrize(
    "pool",
    [None, POOL],  # the shipped pool (FailClose, http, one port); FailOpen, h2c, three ranks
    ids=["shipped", "fail-open-h2c-ranks"],
)
def test_envoy_accepts_the_kubernetes_bootstrap_of_a_pool(tmp_path, pool):
    path = tmp_path / "envoy.yaml"
    path.write_text(render_kubernetes_bootstrap(pool))
    checked = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0 and "OK" in checked.stdout, checked.stdout[-2000:] + checked.stderr[-2000:]
    fallback = clusters(yaml.safe_load(path.read_text()))["pool_fallback"]["load_assignment"]["endpoints"][0]
    ports = [e["endpoint"]["address"]["socket_address"]["port_value"] for e in fallback["lb_endpoints"]]
    assert ports == ([8000] if pool is None else [3000, 3002, 3004])  # the headless Service, on every rank's port


def test_epp_replicas_are_health_checked_and_a_stream_that_cannot_start_is_retried_elsewhere():
    """Each EPP replica's ext_proc gRPC health is checked on its own health port (a draining replica says NOT_SERVING);
    an ext_proc stream refused by one replica (connection refused, REFUSED_STREAM, a reset before its first answer)
    starts on another."""
    text = render_bootstrap(
        epp_host="127.0.0.1",
        epp_port=9002,
        more_epp_endpoints=["127.0.0.1:9012"],
        epp_health_ports=[9003, 9013],
        fallback_endpoints=["127.0.0.1:8000"],
    )
    bootstrap = yaml.safe_load(text)
    (cluster,) = [c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "epp"]
    ports = [
        e["endpoint"]["health_check_config"]["port_value"]
        for e in cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    ]
    assert ports == [9003, 9013]
    (check,) = cluster["health_checks"]
    assert check["grpc_health_check"] == {"service_name": "envoy.service.ext_proc.v3.ExternalProcessor"}
    manager = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    (ext_proc,) = [f for f in manager["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"]
    retry = ext_proc["typed_config"]["grpc_service"]["retry_policy"]
    assert set(retry["retry_on"].split(",")) == {"connect-failure", "refused-stream", "reset"}
    assert retry["retry_host_predicate"][0]["name"] == "envoy.retry_host_predicates.previous_hosts"
    plain = yaml.safe_load(render_bootstrap(epp_host="h", epp_port=1, fallback_endpoints=["h:2"]))
    (cluster,) = [c for c in plain["static_resources"]["clusters"] if c["name"] == "epp"]
    assert "health_checks" not in cluster  # no health ports: no active checks (a processor without gRPC health)
    with pytest.raises(ValueError, match="one port per EPP endpoint"):
        render_bootstrap(epp_host="h", epp_port=1, fallback_endpoints=["h:2"], epp_health_ports=[3, 4])
