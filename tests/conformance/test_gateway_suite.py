"""The gateway data-path suite passes against our Envoy bootstrap and EPP (fallbacks included), and catches a
gateway that trusts the client's destination header or does not fall back."""

import subprocess
import sys

import pytest
import yaml

from harness.envoy import TEMPLATE


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


def edited_template(tmp_path, *replacements: tuple[str, str]):
    text = TEMPLATE.read_text()
    for old, new in replacements:
        assert old in text, f"the bootstrap template changed: {old!r} is gone"
        text = text.replace(old, new, 1)
    template = tmp_path / "edited.yaml.tmpl"
    template.write_text(text)
    return str(template)


def test_our_gateway_passes(tmp_path):
    result, report = run_suite(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    profile = report["profiles"][0]
    assert profile["name"] == "GatewayDataPath"
    assert profile["core"] == {"result": "success", "statistics": {"Failed": 0, "Passed": 11, "Skipped": 0}}
    assert profile["extended"].get("failedTests", []) == [], result.stdout


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
        tmp_path, "--envoy-template", template, "--only", "follows-pick-one", "fallback-endpoints"
    )
    assert result.returncode == 0  # a SHOULD check: reported, not fatal
    assert report["profiles"][0]["extended"]["failedTests"] == ["fallback-endpoints"]
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
    assert report["profiles"][0]["core"]["failedTests"] == ["spoofed-header-epp-down"]


@pytest.mark.parametrize("header", ["x-llm-d-model-name-rewrite", "x-gateway-model-name-rewrite"])
def test_a_gateway_that_passes_the_clients_rewrite_header_fails(tmp_path, header):
    template = edited_template(tmp_path, (f"                - remove: {header}\n", ""))
    result, report = run_suite(tmp_path, "--envoy-template", template, "--only", "private-headers-stripped")
    assert result.returncode == 1
    assert report["profiles"][0]["core"]["failedTests"] == ["private-headers-stripped"]
    assert "model-name rewrite changed the body" in result.stdout
