# kvbridge: `make test` and `make demo` each do their own set-up in the current Python.
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: setup test lint bench demo

setup:
	$(PIP) install -q -e '.[test]'

test: setup
	$(PYTHON) -m pytest -q

lint:
	$(PYTHON) -m ruff check .

demo:
	$(PIP) install -q -e '.[serve,ucx]'
	$(PYTHON) examples/pd_pair.py

bench: setup
	$(PYTHON) benchmarks/bench_kvmanager.py
