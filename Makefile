# The two commands a new user needs: `make up` (run the platform) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: up test lint format bench venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet '.[dev]'
	@touch $(STAMP)

## Set up and run the platform on 127.0.0.1:8000 (console, control plane, worker + beat).
up: venv
	@bash platform/local/up.sh

## Set up and run every check: ruff, then the whole pytest suite.
test: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest

## Benchmarks: the engine model in virtual time, the replica server and the gateway in
## real time, and the fleet simulator's speed.
## Results go to bench/results/*.json (not committed).
bench: venv
	$(PY) bench/engine_model.py --out bench/results/engine_model.json
	$(PY) bench/sim_server.py --out bench/results/sim_server.json
	$(PY) bench/gateway.py --out bench/results/gateway.json --levels 100,500,1000
	$(PY) bench/fleet.py --out bench/results/fleet.json

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: venv
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
