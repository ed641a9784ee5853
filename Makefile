# The two commands of the README:  `make run`  and  `make test`.
# Each creates its own virtual environment; nothing but Python 3.11 is needed beforehand.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: run test lint system-deps clean

$(BIN)/python:
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is needed"'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.run-deps: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet -e .
	touch $@

$(VENV)/.test-deps: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@ $(VENV)/.run-deps

## run: the sidecar on its embedded default registry (./registry, with two example adapters)
run: $(VENV)/.run-deps
	$(BIN)/lora-sidecar examples ./registry
	exec $(BIN)/lora-sidecar serve

## test: the whole test suite, system packages (Prometheus, docker-compose) included
test: $(VENV)/.test-deps system-deps
	$(BIN)/python -m pytest -q

system-deps:
	VENV_BIN=$(abspath $(BIN)) ./scripts/install-system-deps.sh

lint: $(VENV)/.test-deps
	$(BIN)/ruff check sidecar tests triton_repo compose benchmarks
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache
