"""The package boundaries hold (import-linter's contracts in pyproject.toml, run by `make lint` and `make test`):
the runtime packages import no part of the workshop, every top-level package of ours is under a contract, and every
part of the EPP has its place in the EPP's layers."""

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = {"protocol", "modelserver", "epp"}


def test_the_contracts_are_kept():
    lint = Path(sys.executable).parent / "lint-imports"
    result = subprocess.run([str(lint)], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "0 broken" in result.stdout


def test_every_runtime_package_is_forbidden_the_workshop():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file() and p.name != "tests"}
    assert set(config["root_packages"]) == packages == RUNTIME | {"harness"}
    guarded = {
        source
        for c in config["contracts"]
        if "harness" in c.get("forbidden_modules", ())
        for source in c["source_modules"]
    }
    assert guarded == RUNTIME


def test_every_part_of_the_epp_is_in_a_layer():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layers,) = [c["layers"] for c in config["contracts"] if c["type"] == "layers"]
    placed = {name.strip().removeprefix("epp.") for layer in layers for name in layer.split("|")}
    parts = {p.stem for p in (ROOT / "epp").iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()}
    assert parts - {"__init__", "__main__"} == placed
