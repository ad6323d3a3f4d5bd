# Two commands set everything up on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
TEST_WORKERS ?= 2
PYTHON ?= python3
BIN := $(VENV)/bin

.PHONY: demo test lint bench bench-dynamo bench-dynamo-venv dashboard clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	$(BIN)/fleetctl demo --minutes 1 --db sqlite:///demo.db

# The suite on both cores, then the tests that run real engines against the wall clock alone: a neighbour
# on their cores would move the latencies they judge.
test: $(VENV)/.installed-test
	scripts/ensure-postgres.sh
	scripts/ensure-chromium.sh
	scripts/ensure-prometheus.sh
	scripts/ensure-nixl.sh $(VENV)
	scripts/setup-vllm-lab.sh
	scripts/setup-dynamo-bench.sh
	$(MAKE) lint
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist worksteal -m "not exclusive"
	$(BIN)/python -m pytest -m exclusive

lint: $(VENV)/.installed-test
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/mypy

bench: $(VENV)/.installed
	$(BIN)/fleetctl bench ingest

# NVIDIA Dynamo's planner in its own environment, for the autoscaling shoot-out.
bench-dynamo-venv:
	scripts/setup-dynamo-bench.sh

# Every autoscaling strategy and Dynamo's planner in each configuration, on the four traces (about 20 min on 2 cores).
bench-dynamo: $(VENV)/.installed bench-dynamo-venv
	$(BIN)/fleetctl autoscale eval --peers dynamo --jobs 2 --plot autoscale-shootout.png

dashboard: $(VENV)/.installed
	$(BIN)/fleetctl dashboard --db sqlite:///demo.db

clean:
	rm -rf $(VENV) build *.egg-info demo.db demo.db-wal demo.db-shm .pytest_cache .hypothesis
