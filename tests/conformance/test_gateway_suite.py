"""The gateway data-path suite passes against our Envoy bootstrap and EPP, catches a gateway that trusts the
client's destination header, and its fallback check passes for an Envoy that does fall back."""

import subprocess
import sys

import yaml

from epp.envoy import TEMPLATE

# A bootstrap that honours the EPP's fallbacks: a Lua filter after ext_proc copies the 2nd and 3rd endpoint of the
# EPP's envoy.lb list into headers, a composite cluster sends retry n to the ORIGINAL_DST cluster reading header n,
# and the route retries on connect failure or reset.
FALLBACK_LUA = """
          - name: fallback-headers
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua
              default_source_code:
                inline_string: |
                  function envoy_on_request(handle)
                    local lb = handle:streamInfo():dynamicMetadata():get("envoy.lb")
                    local picks = lb and lb["x-gateway-destination-endpoint"]
                    if picks == nil then return end
                    local list = {}
                    for address in string.gmatch(picks, "[^,%s]+") do list[#list + 1] = address end
                    for i = 1, 2 do
                      handle:headers():replace("x-fallback-" .. i, list[math.min(i + 1, #list)])
                    end
                  end
          - name: envoy.filters.http.router"""
FALLBACK_CLUSTERS = """  clusters:
  - name: pick_with_fallbacks
    connect_timeout: 2s
    lb_policy: CLUSTER_PROVIDED
    cluster_type:
      name: envoy.clusters.composite
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.clusters.composite.v3.ClusterConfig
        clusters: [{name: original_destination_cluster}, {name: fallback_1}, {name: fallback_2}]
""" + "".join(
    f"""  - name: fallback_{i}
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    connect_timeout: 2s
    original_dst_lb_config: {{use_http_header: true, http_header_name: x-fallback-{i}}}
"""
    for i in (1, 2)
)


def run_suite(tmp_path, *args):
    report = tmp_path / "report.yaml"
    result = subprocess.run([sys.executable, "-m", "protocol.conformance", "gateway", "--report", str(report),
                             "--workdir", str(tmp_path / "work"), *args],
                            capture_output=True, text=True, timeout=240)  # fmt: skip
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
    assert profile["core"] == {"result": "success", "statistics": {"Failed": 0, "Passed": 10, "Skipped": 0}}
    # Our bootstrap's ORIGINAL_DST cluster connects to the one address in the header: no fallback.
    expected_failures = ["fallback-endpoints"]
    if "response_header_mode: SKIP" in TEMPLATE.read_text():  # then the served endpoint cannot reach the EPP
        expected_failures.insert(0, "served-endpoint-reported")
    assert profile["extended"]["failedTests"] == expected_failures, result.stdout
    assert "FAIL SHOULD fallback-endpoints — with the primary resetting connections" in result.stdout


def test_a_gateway_that_falls_back_passes_the_fallback_check(tmp_path):
    template = edited_template(
        tmp_path,
        ("route: {cluster: original_destination_cluster, timeout: 0s, idle_timeout: 600s}",
         "route: {cluster: pick_with_fallbacks, timeout: 0s, idle_timeout: 600s, "
         'retry_policy: {retry_on: "connect-failure,reset", num_retries: 2}}'),
        ("\n          - name: envoy.filters.http.router", FALLBACK_LUA),
        ("  clusters:\n", FALLBACK_CLUSTERS),
    )  # fmt: skip
    result, report = run_suite(tmp_path, "--envoy-template", template, "--only", "follows-pick-one",
                               "fallback-endpoints")  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert report["profiles"][0]["extended"] == {"result": "success",
                                                 "statistics": {"Failed": 0, "Passed": 1, "Skipped": 0}}  # fmt: skip


def test_a_gateway_that_keeps_the_client_header_fails(tmp_path):
    # Without the strip and with routing on the header alone, a client could steer requests.
    template = edited_template(tmp_path, ("                - remove: x-gateway-destination-endpoint\n",
                                          "                - remove: x-not-the-destination\n"))  # fmt: skip
    result, report = run_suite(tmp_path, "--envoy-template", template, "--only", "spoofed-header-epp-down")
    assert result.returncode == 1
    assert report["profiles"][0]["core"]["failedTests"] == ["spoofed-header-epp-down"]
