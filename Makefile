# kvbridge: `make test` and `make demo` each do their own set-up in the current Python;
# `make test-vllm` builds (once) and uses a separate venv with vLLM in $(KVBRIDGE_CACHE).
PYTHON ?= python3
PIP := $(PYTHON) -m pip
KVBRIDGE_CACHE ?= $(HOME)/.cache/kvbridge-vllm
export KVBRIDGE_CACHE

.PHONY: setup test test-vllm lint bench demo

setup:
	$(PIP) install -q -e '.[test]'

test: setup
	$(PYTHON) -m pytest -q

# tests/vllm in the vLLM venv (tests/vllm/make_venv.sh: fresh about 5 min, then instant).
test-vllm:
	VENV_PY=$$(tests/vllm/make_venv.sh) && $$VENV_PY -m pytest -q -p no:cacheprovider tests/vllm

lint:
	$(PYTHON) -m ruff check .

demo:
	$(PIP) install -q -e '.[serve,ucx]'
	$(PYTHON) examples/pd_pair.py

bench: setup
	$(PYTHON) benchmarks/bench_kvmanager.py
