"""Packaging: each image installs only its part and that part runs without the others; a wheel built from the
checkout carries every file the console scripts read and works from a fresh venv outside the checkout."""

import os
import re
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
IMAGES = {"epp": "epp", "modelserver-sim": "modelserver", "modelserver-torch": "torch"}  # target -> extra
# the modules each part must be able to run without (imported at start-up = a missing dependency in its image)
OUTSIDE = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of the checkout on the path
FORBIDDEN = {
    "epp": ["torch", "tokenizers", "jinja2", "safetensors", "openai", "rich", "transformers", "modelserver"],
    "modelserver": ["torch", "grpc", "grpc_health", "kubernetes", "hpack", "envoy", "openai", "rich", "epp"],
}


def dockerfile_stages() -> dict[str, str]:
    stages, name = {}, None
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if match := re.match(r"FROM \S+ AS (\S+)", line):
            name = match.group(1)
            stages[name] = ""
        elif name:
            stages[name] += line + "\n"
    return stages


def test_each_image_installs_only_its_part_and_the_manifests_name_the_right_image():
    stages = dockerfile_stages()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for target, extra in IMAGES.items():
        installs = re.findall(r'pip install "\$\(ls /wheels/\*\.whl\)\[([a-z,]+)\]"', stages[target])
        assert installs == [extra], (target, installs)
        assert extra in extras
    assert not any("torch" in dep for dep in extras["epp"] + extras["modelserver"])
    images = {}
    for path in ("base/epp.yaml", "base/model-server.yaml", "overlays/gpu/model-server-gpu.yaml"):
        text = (ROOT / "manifests" / path).read_text()
        images[path] = re.search(r"image: \S+/([a-z-]+):", text).group(1)
    assert images == {
        "base/epp.yaml": "epp",
        "base/model-server.yaml": "modelserver-sim",
        "overlays/gpu/model-server-gpu.yaml": "modelserver-torch",
    }


@pytest.mark.parametrize(("part", "module"), [("epp", "epp.cli"), ("modelserver", "modelserver.cli")])
def test_each_part_starts_without_the_others_dependencies(part, module):
    blocked = FORBIDDEN[part]
    code = f"import sys\nfor m in {blocked!r}: sys.modules[m] = None\nimport {module}\n{module}.build_parser()"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.fixture(scope="module")
def installed_wheel(tmp_path_factory) -> Path:
    """A wheel of the checkout installed with [harness] into a new venv outside the checkout; its bin directory."""
    work = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(work / "dist"), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = (work / "dist").glob("*.whl")
    venv.create(work / "venv", with_pip=True)
    pip = work / "venv" / "bin" / "pip"
    result = subprocess.run(
        [str(pip), "install", "-q", f"{wheel}[harness]"], capture_output=True, text=True, timeout=600, env=OUTSIDE
    )
    if result.returncode != 0:
        pytest.fail("installing the wheel failed: " + result.stderr[-2000:])
    return work / "venv" / "bin"


def test_the_wheel_ships_templates_and_workloads(installed_wheel):
    python = installed_wheel / "python"
    code = (
        "import harness.envoy, harness.bench.workloads as w; print(harness.envoy.TEMPLATE.is_file(), "
        "harness.envoy.BASELINE_TEMPLATE.is_file(), sorted(p.stem for p in w.WORKLOADS.glob('*.yaml')))"
    )
    out = subprocess.run(
        [str(python), "-c", code], capture_output=True, text=True, timeout=60, cwd="/", env=OUTSIDE
    ).stdout
    assert out.startswith("True True [") and "shared-prefix" in out, out


def test_the_wheel_runs_the_demo_and_the_gateway_suite_from_elsewhere(installed_wheel, tmp_path):
    from tests.conftest import epp_local_ports

    args, _ = epp_local_ports()
    demo = subprocess.run(
        [str(installed_wheel / "epp-local"), *args, "--demo", "--once", "--requests", "8"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
        env=OUTSIDE,
    )
    assert demo.returncode == 0 and "8/8 requests done, 0 failed" in demo.stdout, demo.stdout[-2000:] + demo.stderr
    report = tmp_path / "report.yaml"
    suite = subprocess.run(
        [str(installed_wheel / "gateway-conformance"), "--report", str(report)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
        env=OUTSIDE,
    )
    assert suite.returncode == 0, suite.stdout[-2000:] + suite.stderr[-2000:]
    assert yaml.safe_load(report.read_text())["profiles"][0]["core"]["result"] == "success"
