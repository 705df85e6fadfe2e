"""The package boundaries hold (import-linter's contracts in pyproject.toml, run by `make lint` and `make test`),
and every module of `epp` is on one side of them: runtime (imports only the contract) or tooling."""

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOLING = {"epp.bench", "epp.conformance", "epp.demo", "epp.local"}


def test_the_contracts_are_kept():
    lint = Path(sys.executable).parent / "lint-imports"
    result = subprocess.run([str(lint)], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "0 broken" in result.stdout


def test_every_epp_module_is_runtime_or_tooling():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (runtime,) = [c for c in config if "epp.cli" in c.get("source_modules", [])]
    assert set(runtime["forbidden_modules"]) >= TOOLING
    modules = {f"epp.{p.stem}" for p in (ROOT / "epp").glob("*.py") if p.stem != "__init__"}
    modules |= {f"epp.{p.name}" for p in (ROOT / "epp").iterdir() if (p / "__init__.py").is_file()}
    unclassified = modules - set(runtime["source_modules"]) - TOOLING
    assert not unclassified, f"add {sorted(unclassified)} to the runtime contract or to the tooling list"
