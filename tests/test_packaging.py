"""Packaging: each image installs only its part and that part runs without the others; a wheel built from the
checkout carries every file the console scripts read and works from a fresh venv outside the checkout; the release
wheel (setup.py, EPP_RELEASE=1) holds the runtime only, and its compiled request path passes the transport's, the
handler's and the director's tests and a gateway integration test."""

import ast
import configparser
import importlib.machinery
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
# the wheels' builds (the release one compiled and trained) and installs: minutes on a loaded machine
pytestmark = pytest.mark.timeout(900)
IMAGES = {"epp": "epp", "modelserver-sim": "modelserver", "modelserver-torch": "torch"}  # target -> extra
# the modules each part must be able to run without (imported at start-up = a missing dependency in its image)
OUTSIDE = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of the checkout on the path
FORBIDDEN = {
    "epp": ["torch", "tokenizers", "jinja2", "safetensors", "openai", "rich", "transformers", "modelserver"],
    "modelserver": ["torch", "grpc", "grpc_health", "kubernetes", "hpack", "envoy", "openai", "rich", "epp"],
}

RUNTIME_PACKAGES = {"protocol", "modelserver", "epp"}
RUNTIME_SCRIPTS = {"epp", "modelserver"}


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


def build_wheel(work: Path, packages: list[str], env: dict[str, str]) -> Path:
    """A wheel built from a copy of `packages` and the build's files, as the Dockerfile's wheel stage copies them:
    the checkout gets no build directory, and no earlier build's files (build/lib) slip into the wheel."""
    source = work / "source"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, source)
    for package in packages:
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(work / "dist"), str(source)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **env},
    )
    if result.returncode != 0:
        pytest.fail("building the wheel failed: " + result.stderr[-2000:])
    (wheel,) = (work / "dist").glob("*.whl")
    return wheel


@pytest.fixture(scope="module")
def installed_wheel(tmp_path_factory) -> Path:
    """A wheel of the checkout installed into a new venv outside the checkout; its bin directory. The wheel's own
    files only: its dependencies are this environment's, read through a .pth line (a directory added that way has
    its own .pth files, the checkout's editable install among them, left unread). Installing the [harness] extra's
    600 MB anew took a minute of CPU; that the extra declares what the workshop imports is checked below
    (test_the_harness_extra_declares_every_package_the_workshop_imports)."""
    work = tmp_path_factory.mktemp("wheel")
    wheel = build_wheel(work, sorted(RUNTIME_PACKAGES | {"harness"}), {})
    venv.create(work / "venv", with_pip=True)
    site = subprocess.run(
        [str(work / "venv" / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(site) / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = work / "venv" / "bin" / "pip"
    result = subprocess.run(
        [str(pip), "install", "-q", "--no-deps", str(wheel)], capture_output=True, text=True, timeout=600, env=OUTSIDE
    )
    if result.returncode != 0:
        pytest.fail("installing the wheel failed: " + result.stderr[-2000:])
    return work / "venv" / "bin"


def third_party_imports(package: Path) -> set[str]:
    """The top-level names of what `package`'s modules import when they are imported (module level), less the
    standard library and this project's packages. Not its pytest entries (test_*.py): pytest runs them."""
    names = set()
    for path in package.rglob("*.py"):
        if path.name.startswith("test_"):
            continue
        for statement in ast.parse(path.read_text()).body:
            if isinstance(statement, ast.Import):
                names |= {alias.name.split(".")[0] for alias in statement.names}
            elif isinstance(statement, ast.ImportFrom) and statement.level == 0:
                names.add(statement.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - RUNTIME_PACKAGES - {"harness", "__future__"}


def installed_by(distribution: str, extras: frozenset[str], seen: set | None = None) -> set[str]:
    """The distributions that installing `distribution` with `extras` brings, itself included (normalised names)."""
    seen = set() if seen is None else seen
    if (canonicalize_name(distribution), extras) not in seen:
        seen.add((canonicalize_name(distribution), extras))
        for line in importlib.metadata.requires(distribution) or []:
            requirement = Requirement(line)
            if requirement.marker is None or any(requirement.marker.evaluate({"extra": e}) for e in extras | {""}):
                installed_by(requirement.name, frozenset(requirement.extras), seen)
    return {name for name, _ in seen}


def test_the_harness_extra_declares_every_package_the_workshop_imports():
    provided = importlib.metadata.packages_distributions()
    installed = installed_by("llm-routing-reference", frozenset({"harness"}))
    missing = {
        module: provided.get(module)
        for module in third_party_imports(ROOT / "harness")
        if not {canonicalize_name(d) for d in provided.get(module, [])} & installed
    }
    assert not missing, f"imported by the workshop, not installed by [harness]: {missing}"


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
    profiles = {p["name"]: p for p in yaml.safe_load(report.read_text())["profiles"]}
    assert profiles["Gateway"]["core"]["statistics"]["Failed"] == 0  # partial: the tests that need a cluster skip
    assert profiles["GatewayDataPath"]["core"]["result"] == "success"


REQUEST_PATH = {
    "epp/transport/h2",
    "epp/handlers/extproc",
    "epp/handlers/wire",
    "epp/requestcontrol/director",
    "epp/scheduling/scheduler",
    "epp/scheduling/types",
    "epp/scheduling/plugins/prefix_cache_scorer",
    "epp/predictor/predictor",
    "epp/datalayer/endpoint",
    "epp/flowcontrol",
    "protocol/openai",
    "protocol/extproc",
    "epp/metrics",
}
# The request path's tests the release build runs against its compiled modules: the transport, the ext_proc handler
# with the director (its RequestContext an extension type), the director with flow control and with the latency
# predictor, the scheduler and its plugins (the per-request dataclasses extension types), the wire reader (C-typed
# loops) against the message classes, the metric children (C doubles), and one gateway integration test (real Envoy,
# the EPP started from the wheel's modules)
COMPILED_PATH_TESTS = [
    "tests/epp/test_grpc_h2.py",
    "tests/epp/test_server.py",
    "tests/epp/test_director_flow_control.py",
    "tests/epp/test_director_predictor.py",
    "tests/epp/scheduling",
    "tests/epp/test_wire.py",
    "tests/epp/test_metrics_series.py",
    "tests/integration/test_gateway.py::test_load_prefix_and_lora_aware_routing",
]


@pytest.fixture(scope="module")
def release_wheel(tmp_path_factory) -> Path:
    """The release wheel, built as the Dockerfile's wheel stage builds it: from a copy of what that stage copies, so
    the checkout gets no build directory. Its C compiled without optimisation (-O0 after Python's own flags): the same
    Cython translation of the same source, which is what the request path's tests below check, in a fifth of the CPU
    time (53 s against 250 s of one core)."""
    release = {"EPP_RELEASE": "1", "CFLAGS": f"{os.environ.get('CFLAGS', '')} -O0".strip()}
    return build_wheel(tmp_path_factory.mktemp("release"), sorted(RUNTIME_PACKAGES), release)


def test_the_release_wheel_holds_the_runtime_packages_and_scripts_compiled(release_wheel):
    with zipfile.ZipFile(release_wheel) as wheel:
        names = wheel.namelist()
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        declared = configparser.ConfigParser()
        declared.read_string(wheel.read(entry_points).decode())
    assert {name.split("/")[0] for name in names if ".dist-info/" not in name} == RUNTIME_PACKAGES
    assert declared.sections() == ["console_scripts"] and set(declared["console_scripts"]) == RUNTIME_SCRIPTS
    extensions = {n.split(".")[0] for n in names if n.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))}
    assert extensions >= REQUEST_PATH
    assert not [n for n in names if n.endswith((".c", ".pxd"))]
    assert "epp/status.html" in names  # the status page (epp/status.py reads it as package data)


def test_the_developer_wheel_ships_the_workshop_and_its_scripts(installed_wheel):
    for script in ("epp-local", "epp-bench", "msp-conformance", "gateway-conformance", "epp", "modelserver"):
        assert (installed_wheel / script).is_file(), script


def test_the_compiled_request_path_passes_the_request_paths_tests(release_wheel, tmp_path):
    """The wheel's packages first on the path, before the checkout's (pytest appends the checkout for `tests`, and
    PYTHONSAFEPATH keeps `python -m epp`, as the local stack starts the EPP, from putting its directory first)."""
    site = tmp_path / "site"
    with zipfile.ZipFile(release_wheel) as wheel:
        wheel.extractall(site)
    env = {**OUTSIDE, "PYTHONPATH": str(site), "PYTHONSAFEPATH": "1"}
    where = subprocess.run(
        [sys.executable, "-c", "import epp.transport.h2, epp.requestcontrol.director as d; print(d.__file__)"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=env,
    )
    assert where.stdout.startswith(str(site / "epp")) and where.stdout.strip().endswith(".so"), where
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--import-mode=append", *COMPILED_PATH_TESTS],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=env,
    )
    assert tests.returncode == 0, tests.stdout[-3000:] + tests.stderr[-2000:]
