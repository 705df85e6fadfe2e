"""A newcomer's mistakes, each answered by the real command in one line that names the fix (they were tracebacks of
27 to 64 lines, or passed silently)."""

import importlib.util
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import free_ports


def run(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=timeout)


def one_line(result: subprocess.CompletedProcess) -> str:
    """The command's error: it failed, with no traceback, and its last line of stderr says why."""
    assert result.returncode != 0, result.stdout[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return result.stderr.strip().splitlines()[-1]


def test_epp_local_names_a_mistyped_plugin_before_starting_anything(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(
        "plugins:\n- type: queue-scorr\nschedulingProfiles:\n- name: d\n  plugins: [{pluginRef: queue-scorr}]\n"
    )
    result = run("harness.local", "--config-file", str(config))
    assert result.stderr.strip().count("\n") == 0  # one line: it printed 27 and hid the cause in the EPP's log
    assert f"--config-file {config}: unsupported plugin type(s) queue-scorr (known: " in one_line(result)
    assert "starting" not in result.stdout


def test_epp_local_refuses_a_pool_file_with_an_unknown_field(tmp_path):
    pool = tmp_path / "pool.yaml"
    pool.write_text("endpoint:\n- {address: 127.0.0.1, port: 8000}\n")
    line = one_line(run("harness.local", "--pool-file", str(pool)))
    assert (
        line == f"epp-local: --pool-file: {pool}: the pool file: unknown field `endpoint` (did you mean `endpoints`?)"
    )


def test_epp_refuses_a_pool_file_with_an_unknown_field(tmp_path):
    pool = tmp_path / "pool.yaml"
    pool.write_text("endpoint:\n- {address: 127.0.0.1, port: 8000}\n")
    assert "unknown field `endpoint` (did you mean `endpoints`?)" in one_line(run("epp", "--pool-file", str(pool)))


def test_epp_local_says_when_nothing_answers_at_a_model_server_url():
    port = free_ports(1)[0]
    line = one_line(run("harness.local", "--model-server-url", f"http://127.0.0.1:{port}"))
    assert f"nothing answers at http://127.0.0.1:{port}" in line and "start the model server" in line


@pytest.fixture
def web_server(tmp_path):
    """Not a model server: Python's file server (an HTML 404 for /v1/models and /metrics)."""
    port = free_ports(1)[0]
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 15
        while True:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert server.poll() is None and time.monotonic() < deadline, "http.server did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait()


def test_msp_conformance_says_in_one_line_what_is_wrong_with_the_url(web_server):
    closed = free_ports(1)[0]
    line = one_line(run("harness.conformance", "--url", f"http://127.0.0.1:{closed}"))
    assert line.startswith(f"msp-conformance: nothing answers at http://127.0.0.1:{closed}")  # it printed 64 lines
    line = one_line(run("harness.conformance", "--url", web_server))
    assert f"{web_server}: GET /v1/models answered HTTP 404 (text/html): not an OpenAI-compatible model" in line
    line = one_line(run("harness.conformance", "--url", "127.0.0.1:8000"))
    assert (
        line
        == "msp-conformance: '127.0.0.1:8000' is not an http:// URL of a model server (write it as http://127.0.0.1:8000)"
    )


def test_modelserver_says_its_port_is_taken():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        line = one_line(run("modelserver", "--port", str(port)))
    assert line.startswith("modelserver: ") and "address already in use" in line and "choose --port" in line


def test_gateway_conformance_names_a_missing_template(tmp_path):
    line = one_line(run("harness.conformance.gateway_cli", "--envoy-template", str(tmp_path / "nope.tmpl")))
    assert line.startswith("gateway-conformance: --envoy-template") and "no such file" in line


def test_torch_backend_without_torch_names_the_install(monkeypatch, capsys):
    from harness import local
    from modelserver import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    args = cli.build_parser().parse_args(["--backend", "torch", "--model", "m"])
    assert (
        cli.check_arguments(args) == "--backend torch needs PyTorch, which is not installed: pip install -e '.[torch]'"
    )
    with pytest.raises(SystemExit):
        local.main(["--backend", "torch"])
    assert "--backend torch needs PyTorch, which is not installed: pip install -e '.[torch]'" in capsys.readouterr().err


def test_modelserver_names_a_torch_model_directory_without_a_model(tmp_path):
    if importlib.util.find_spec("torch") is None:
        pytest.skip("needs the torch extra")
    from modelserver import cli

    args = cli.build_parser().parse_args(["--backend", "torch", "--model", str(tmp_path)])
    assert f"--model {tmp_path}: no config.json there" in cli.check_arguments(args)
    assert cli.check_arguments(cli.build_parser().parse_args([])) is None


def test_epp_names_a_missing_cluster_and_a_missing_config_file(tmp_path):
    line = one_line(run("epp", "--pool-name", "pool", "--kubeconfig", str(tmp_path / "kubeconfig")))
    assert line.startswith("epp: --pool-name needs a Kubernetes cluster: --kubeconfig") and "--pool-file" in line
    pool = tmp_path / "pool.yaml"
    pool.write_text("endpoints: []\n")
    line = one_line(run("epp", "--pool-file", str(pool), "--config-file", str(tmp_path / "nope.yaml")))
    assert line == f"epp: cannot read --config-file {tmp_path / 'nope.yaml'}: No such file or directory"
