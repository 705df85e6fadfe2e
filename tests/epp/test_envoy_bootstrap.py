"""render_bootstrap's response-header trip: skipped only when the access log brings the EPP every request's status."""

import pytest
import yaml

from harness.envoy import render_bootstrap


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
        ({"response_header_mode": "SEND"}, "SEND"),
        ({"access_log_percent": 0, "response_header_mode": "SKIP"}, "SKIP"),
    ],
)
def test_the_response_header_trip_is_skipped_only_when_records_bring_every_status(overrides, mode):
    assert ext_proc_mode(**overrides) == mode
