"""The package boundaries hold (import-linter's contracts in pyproject.toml, run by `make lint` and `make test`):
the runtime packages import no part of the workshop, and every top-level package of ours is under a contract."""

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
        source for c in config["contracts"] if "harness" in c["forbidden_modules"] for source in c["source_modules"]
    }
    assert guarded == RUNTIME
