"""Profile-guided optimisation of the compiled request path: the modules built instrumented, the request path run
(the `handler-cpu` harness: the EPP's own handling of ext_proc streams and access-log records, in process, in the
shapes a live EPP meets them), then the modules built again with the branch counts that run left (setup.py's
EPP_PGO). `make` runs it after installing, and `make compile` after an edit.

    python -m epp.bench.pgo

What the counts change: GCC lays out the path the training took through each function as straight-line code, moves
the branches it never took aside, and inlines where calls were hot. A live EPP between Envoy's requests finds its
code evicted from the CPU's caches, and fetches fewer cache lines of it so. A function the training never ran
(scrapes, Kubernetes discovery, a wait in flow control) is compiled as it is without a profile
(-fprofile-partial-training). It needs a source checkout (setup.py beside the package) and a C compiler; without
either, or when a step fails, the modules stay (or are built again) as a plain install builds them, and it says so.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import epp
from epp import compiled

ROOT = Path(epp.__file__).resolve().parent.parent
PGO_DIR = ROOT / "build" / "pgo"  # setup.py's PGO_DIR
TRAINED = PGO_DIR / "trained.json"  # setup.py's TRAINED

# (requests, per read, streamed, endpoints publishing KV events): one request at a time as a quiet EPP meets them,
# batches as a loaded one does, streamed responses whose access-log records teach the latency predictor, and the
# precise prefix scorer tokenizing prompts
TRAINING_RUNS = ((1500, 1, False, False), (3000, 16, False, False), (1500, 4, True, False), (1500, 4, False, True))
TRAINING = (
    "from epp.bench import handler_cpu\n"
    "for requests, batch, streamed, kv_events in {runs!r}:\n"
    "    handler_cpu.measure(requests, batch, 1, streamed, handler_cpu.DEFAULT_CONFIG, 0, kv_events)\n"
)


def build(mode: str) -> None:
    """The package installed again in place (editable), its modules compiled as EPP_PGO=`mode` says ("": plain)."""
    environment = {key: value for key, value in os.environ.items() if key != "EPP_PGO"}
    if mode:
        environment["EPP_PGO"] = mode
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "-e", str(ROOT)]
    subprocess.run(command, cwd=ROOT, env=environment, check=True)


def train() -> int:
    """Runs the request path on the instrumented modules, in a process of its own (its counts are written at its
    exit); returns how many modules left counts."""
    # one thread each for numpy's BLAS and the tokenizers' pool (the counters are updated single-threaded)
    environment = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "RAYON_NUM_THREADS": "1"}
    environment.pop("EPP_PURE_PYTHON", None)
    script = TRAINING.format(runs=TRAINING_RUNS)
    subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=environment, check=True, capture_output=True)
    return len(list(PGO_DIR.rglob("*.gcda")))


def optimise() -> str:
    """The three steps; returns what was built. Raises CalledProcessError or RuntimeError when a step fails."""
    shutil.rmtree(PGO_DIR, ignore_errors=True)  # counts add up across runs: an earlier source's must not
    build("generate")
    instrumented = compiled.stamped()
    if not instrumented:
        return compiled.summary()  # nothing compiled (no C compiler or no Cython): nothing to optimise
    counted = train()
    if not counted:
        raise RuntimeError("the training run left no branch counts")
    TRAINED.write_text(json.dumps(instrumented, indent=0, sort_keys=True))
    build("use")
    guided = compiled.pgo_stamped().get("profile_guided", [])
    if not guided:
        raise RuntimeError("no module was built with the training's counts")
    return f"{len(guided)} of {len(instrumented)} compiled modules built with the counts of {counted} that ran"


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python -m epp.bench.pgo", description=__doc__.split("\n\n")[0]).parse_args(argv)
    if not (ROOT / "setup.py").is_file():
        print(f"epp.bench.pgo: {ROOT} is not a source checkout (no setup.py): nothing to build", file=sys.stderr)
        return 2
    started = time.monotonic()
    try:
        print(f"profile-guided build: {optimise()} ({time.monotonic() - started:.0f} s)")
        return 0
    except (subprocess.CalledProcessError, RuntimeError) as error:
        detail = getattr(error, "stderr", None) or b""
        print(f"profile-guided build failed ({error}) {detail.decode(errors='replace')[-2000:]}", file=sys.stderr)
        print("building the modules as a plain install does", file=sys.stderr)
        build("")
        return 0


if __name__ == "__main__":
    sys.exit(main())
