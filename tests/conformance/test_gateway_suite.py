"""The gateway suite passes against our Envoy bootstrap and EPP, writes the ConformanceReport GIE's v1.6 suite
writes (profile `Gateway` with upstream's 14 tests, those needing a cluster skipped; ours in `GatewayDataPath`), and
catches a gateway that trusts the client's destination header, does not fall back, or ignores the pool's
appProtocol or failureMode."""

import subprocess
import sys

import pytest
import yaml

from harness.conformance.gateway import NEEDS_A_GATEWAY_API_IMPLEMENTATION
from harness.envoy import TEMPLATE

UPSTREAM_RUN = [
    "GatewayFollowingEPPRouting",
    "GatewayFollowingEPPRoutingWithDataParallelism",
    "GatewayDestinationEndpointServed",
    "InferencePoolAppProtocol",
    "InferencePoolInvalidEPPService",
    "EppUnAvailableFailOpen",
]


def run_suite(tmp_path, *args):
    report = tmp_path / "report.yaml"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "harness.conformance.gateway_cli",
            "--report",
            str(report),
            "--workdir",
            str(tmp_path / "work"),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert report.exists(), result.stdout[-3000:] + result.stderr[-3000:]
    return result, yaml.safe_load(report.read_text())


def profile(report: dict, name: str) -> dict:
    (found,) = [p for p in report["profiles"] if p["name"] == name]
    return found


def edited_template(tmp_path, *replacements: tuple[str, str]):
    """Our template with each `old` replaced by `new` everywhere it occurs."""
    text = TEMPLATE.read_text()
    for old, new in replacements:
        assert old in text, f"the bootstrap template changed: {old!r} is gone"
        text = text.replace(old, new)
    template = tmp_path / "edited.yaml.tmpl"
    template.write_text(text)
    return str(template)


def test_our_gateway_passes_and_reports_like_upstream(tmp_path):
    result, report = run_suite(tmp_path, "--organization", "llm-routing-reference", "--version", "test")
    assert result.returncode == 0, result.stdout + result.stderr
    assert report["kind"] == "ConformanceReport" and report["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert report["GatewayAPIInferenceExtensionVersion"] == "v1.6.0" and report["gatewayAPIVersion"] == "v1.6.1"
    assert report["implementation"] == {
        "organization": "llm-routing-reference",
        "project": "unknown",
        "version": "test",
    }
    assert [p["name"] for p in report["profiles"]] == ["Gateway", "GatewayDataPath"]
    upstream = profile(report, "Gateway")
    assert upstream["core"] == {
        "result": "partial",
        "statistics": {"Failed": 0, "Passed": 6, "Skipped": 8},
        "skippedTests": sorted(NEEDS_A_GATEWAY_API_IMPLEMENTATION),
    }
    assert "extended" not in upstream  # upstream's Gateway profile has core tests only
    assert upstream["summary"] == "Core tests partially succeeded with 8 test skips."
    details = {d["name"]: d for d in upstream["details"]}
    assert {n for n, d in details.items() if d["result"] == "PASS"} == set(UPSTREAM_RUN)
    assert len(details) == 14
    assert all(
        "needs a Gateway API implementation" in details[n]["message"] for n in NEEDS_A_GATEWAY_API_IMPLEMENTATION
    )
    ours = profile(report, "GatewayDataPath")
    assert ours["core"] == {"result": "success", "statistics": {"Failed": 0, "Passed": 8, "Skipped": 0}}
    assert ours["extended"] == {"result": "success", "statistics": {"Failed": 0, "Passed": 1, "Skipped": 0}}
    assert ours["summary"] == "Core tests succeeded. Extended tests succeeded."


def test_a_gateway_without_retries_fails_the_fallback_check(tmp_path):
    # Routing straight to the pick's ORIGINAL_DST cluster: one address, nothing to fall back to.
    template = edited_template(
        tmp_path,
        (
            "route: {cluster: pick_with_fallbacks, timeout: 0s, idle_timeout: 600s,\n"
            '                        retry_policy: {retry_on: "connect-failure,reset", num_retries: 2}}',
            "route: {cluster: original_destination_cluster, timeout: 0s, idle_timeout: 600s}",
        ),
    )
    result, report = run_suite(
        tmp_path, "--envoy-template", template, "--only", "GatewayFollowingEPPRouting", "fallback-endpoints"
    )
    assert result.returncode == 0  # a SHOULD check: reported, not fatal
    assert profile(report, "Gateway")["core"]["result"] == "success"
    assert profile(report, "GatewayDataPath")["extended"]["failedTests"] == ["fallback-endpoints"]
    assert "FAIL SHOULD fallback-endpoints — with the primary resetting connections" in result.stdout


def test_a_gateway_that_keeps_the_client_header_fails(tmp_path):
    # Without the strip and with routing on the header alone, a client could steer requests.
    template = edited_template(
        tmp_path,
        (
            "                - remove: x-gateway-destination-endpoint\n",
            "                - remove: x-not-the-destination\n",
        ),
    )
    result, report = run_suite(tmp_path, "--envoy-template", template, "--only", "spoofed-header-epp-down")
    assert result.returncode == 1
    assert profile(report, "GatewayDataPath")["core"]["failedTests"] == ["spoofed-header-epp-down"]


@pytest.mark.parametrize("header", ["x-llm-d-model-name-rewrite", "x-gateway-model-name-rewrite"])
def test_a_gateway_that_passes_the_clients_rewrite_header_fails(tmp_path, header):
    template = edited_template(tmp_path, (f"                - remove: {header}\n", ""))
    result, report = run_suite(tmp_path, "--envoy-template", template, "--only", "private-headers-stripped")
    assert result.returncode == 1
    assert profile(report, "GatewayDataPath")["core"]["failedTests"] == ["private-headers-stripped"]
    assert "model-name rewrite changed the body" in result.stdout


def test_a_gateway_that_ignores_the_pools_app_protocol_or_failure_mode_fails(tmp_path):
    template = edited_template(
        tmp_path,
        ("explicit_http_config: ${UPSTREAM_HTTP_CONFIG}", "explicit_http_config: {http_protocol_options: {}}"),
        ("failure_mode_allow: ${FAILURE_MODE_ALLOW}", "failure_mode_allow: false"),
    )
    result, report = run_suite(
        tmp_path, "--envoy-template", template, "--only", "InferencePoolAppProtocol", "EppUnAvailableFailOpen"
    )
    assert result.returncode == 1
    core = profile(report, "Gateway")["core"]
    assert core["failedTests"] == ["InferencePoolAppProtocol", "EppUnAvailableFailOpen"]
    assert core["result"] == "failure" and profile(report, "Gateway")["summary"] == (
        "Core tests failed with 2 test failures."
    )
    assert "the model server got HTTP/1.1, not HTTP/2.0" in result.stdout
    assert "FailOpen with the EPP down answered 500" in result.stdout
