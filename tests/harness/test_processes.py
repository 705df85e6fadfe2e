"""The processes the harness starts run the code it imports, wherever they are started from."""

import subprocess
import sys

from harness.local import python_module


def test_a_started_module_is_not_taken_from_the_working_directory(tmp_path):
    # another checkout's package in the directory the command runs from (a scratch run with PYTHONPATH set elsewhere)
    (tmp_path / "epp").mkdir()
    (tmp_path / "epp" / "__init__.py").write_text("")
    (tmp_path / "epp" / "__main__.py").write_text("print('the working directory')\n")
    plain = subprocess.run([sys.executable, "-m", "epp", "--version"], cwd=tmp_path, capture_output=True, text=True)
    assert plain.stdout.strip() == "the working directory"  # what `python -m` alone does
    ours = subprocess.run([*python_module("epp"), "--version"], cwd=tmp_path, capture_output=True, text=True)
    assert ours.returncode == 0 and ours.stdout.startswith("epp "), ours.stdout + ours.stderr
