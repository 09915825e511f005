# kvbridge: `make test` and `make demo` each do their own set-up in the current Python;
# `make test-vllm` builds (once) and uses a separate venv with vLLM in $(KVBRIDGE_CACHE).
PYTHON ?= python3
PIP := $(PYTHON) -m pip
KVBRIDGE_CACHE ?= $(HOME)/.cache/kvbridge-vllm
export KVBRIDGE_CACHE
# Installed first when the Python has no torch: pyproject's range alone would let pip pick the
# newest torch, a multi-GB CUDA build; 2.13.0 is the CPU build these machines have on disk.
TORCH_SPEC ?= torch==2.13.0

.PHONY: torch setup test test-vllm lint bench demo demo-vllm

torch:
	@$(PYTHON) -c 'import torch' 2>/dev/null || $(PIP) install -q '$(TORCH_SPEC)'

setup: torch
	$(PIP) install -q -e '.[test]'

test: setup
	$(PYTHON) -m pytest -q

# tests/vllm in the vLLM venv (tests/vllm/make_venv.sh: fresh about 5 min, then instant).
test-vllm:
	VENV_PY=$$(tests/vllm/make_venv.sh) && $$VENV_PY -m pytest -q -p no:cacheprovider tests/vllm

lint:
	$(PYTHON) -m ruff check .

demo: torch
	$(PIP) install -q -e '.[serve,ucx]'
	$(PYTHON) -m kvbridge.connector.serve.commands demo $(DEMO_ARGS)

# The main job on vLLM: P and D as two `vllm serve` with the kvbridge connector, the proxy in front,
# checked token for token against a single vLLM (kvbridge-demo-vllm). It runs in the vLLM
# venv, made once under ${KVBRIDGE_CACHE:-~/.cache/kvbridge-vllm} by the vLLM suite's script
# (the one `make test-vllm` uses); KVBRIDGE_VLLM_PYTHON=/path/to/python uses that python instead.
VLLM_VENV_SCRIPT := $(firstword $(wildcard tests/vllm/make_venv.sh tests/vllm_probe/make_venv.sh))

demo-vllm:
	@py="$(KVBRIDGE_VLLM_PYTHON)"; if [ -z "$$py" ]; then py=$$($(VLLM_VENV_SCRIPT)) || exit 1; fi; \
	"$$py" -m kvbridge.connector.serve.commands demo-vllm $(DEMO_ARGS)

bench: setup
	$(PYTHON) benchmarks/bench_kvmanager.py
