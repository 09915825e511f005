# kvbridge: `make test` and `make demo` each do their own set-up in the current Python.
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: setup test lint bench demo demo-vllm

setup:
	$(PIP) install -q -e '.[test]'

test: setup
	$(PYTHON) -m pytest -q

lint:
	$(PYTHON) -m ruff check .

demo:
	$(PIP) install -q -e '.[serve,ucx]'
	$(PYTHON) examples/pd_pair.py

# The main job on vLLM: P and D as two `vllm serve` with the kvbridge connector, the proxy in front,
# checked token for token against a single vLLM (examples/vllm_pd_demo.py). It runs in the vLLM
# venv, made once under ${KVBRIDGE_CACHE:-~/.cache/kvbridge-vllm} by the vLLM suite's script
# (the one `make test-vllm` uses); KVBRIDGE_VLLM_PYTHON=/path/to/python uses that python instead.
VLLM_VENV_SCRIPT := $(firstword $(wildcard tests/vllm/make_venv.sh tests/vllm_probe/make_venv.sh))

demo-vllm:
	@py="$(KVBRIDGE_VLLM_PYTHON)"; if [ -z "$$py" ]; then py=$$($(VLLM_VENV_SCRIPT)) || exit 1; fi; \
	"$$py" examples/vllm_pd_demo.py $(DEMO_ARGS)

bench: setup
	$(PYTHON) benchmarks/bench_kvmanager.py
