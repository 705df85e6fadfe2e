# The two commands a newcomer needs: `make demo` and `make test`. Each sets up everything on a fresh machine.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench lint format system-deps clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,torch]'
	touch $(STAMP)

# Debian packages some tests use (promtool and a real Prometheus). Idempotent; tests skip with a reason if missing.
system-deps:
	@command -v promtool >/dev/null 2>&1 || { \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null) \
	  || echo "warning: could not install prometheus; tests that need it will be skipped"; }

demo: $(STAMP)
	$(BIN)/epp-local --model-servers 4 --demo

test: $(STAMP) system-deps
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -p no:cacheprovider

bench: $(STAMP)
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/epp-bench overhead --out bench-results
	$(BIN)/epp-bench decision
	$(BIN)/epp-bench compare --workload shared-prefix --out bench-results
	$(BIN)/epp-bench compare --workload multi-lora --targets epp lora-only queue-only round-robin --out bench-results

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache bench-results
