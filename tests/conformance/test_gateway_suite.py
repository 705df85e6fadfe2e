"""The gateway data-path suite passes against our Envoy bootstrap and EPP, and catches a gateway that trusts the
client's destination header."""

import subprocess
import sys

import yaml

from epp.envoy import TEMPLATE


def run_suite(tmp_path, *args):
    report = tmp_path / "report.yaml"
    result = subprocess.run([sys.executable, "-m", "protocol.conformance", "gateway", "--report", str(report), *args],
                            capture_output=True, text=True, timeout=240)  # fmt: skip
    assert report.exists(), result.stdout[-3000:] + result.stderr[-3000:]
    return result, yaml.safe_load(report.read_text())


def test_our_gateway_passes(tmp_path):
    result, report = run_suite(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    profile = report["profiles"][0]
    assert profile["name"] == "GatewayDataPath"
    assert profile["core"]["result"] == "success" and profile["core"]["statistics"]["Passed"] == 10
    assert profile["extended"]["skippedTests"] == ["fallback-endpoints"]


def test_a_gateway_that_keeps_the_client_header_fails(tmp_path):
    # Without the strip and with routing on the header alone, a client could steer requests.
    broken = TEMPLATE.read_text().replace("                - remove: x-gateway-destination-endpoint\n",
                                          "                - remove: x-not-the-destination\n")  # fmt: skip
    template = tmp_path / "broken.yaml.tmpl"
    template.write_text(broken)
    result, report = run_suite(tmp_path, "--envoy-template", str(template), "--only", "spoofed-header-epp-down")
    assert result.returncode == 1
    assert report["profiles"][0]["core"]["failedTests"] == ["spoofed-header-epp-down"]
