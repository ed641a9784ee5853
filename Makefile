# The two commands of the README:  `make run`  and  `make test`.
# Each creates its own virtual environment; nothing but Python 3.11 is needed beforehand.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: run test test-fast engine-env lint system-deps docker-deps clean

$(BIN)/python:
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is needed"'
	$(PYTHON) -m venv $(VENV)

# The venv's own pip is used as it comes (any pip since 21.3 installs this project editable):
# upgrading it first cost `make run` about 3 s of its first answer.
PIP_INSTALL := $(BIN)/python -m pip install --quiet --disable-pip-version-check

$(VENV)/.run-deps: $(BIN)/python pyproject.toml
	$(PIP_INSTALL) -e .
	touch $@

$(VENV)/.test-deps: $(BIN)/python pyproject.toml
	$(PIP_INSTALL) -e '.[test]'
	touch $@ $(VENV)/.run-deps

## run: the sidecar on its embedded default registry (./registry, with two example adapters)
run: $(VENV)/.run-deps
	$(BIN)/lora-sidecar examples ./registry --skip-if-not-empty
	exec $(BIN)/lora-sidecar serve

## test: the whole test suite, system packages (Prometheus, docker-compose, HAProxy, a Docker
## engine) and the real engine's environment (vLLM on CPU, scripts/engine-env.sh) included
test: $(VENV)/.test-deps system-deps docker-deps engine-env
	$(BIN)/python -m pytest -q

## test-fast: everything but the tests of the real engine and of a real Docker engine, which
## is neither installed nor needed for it
test-fast: $(VENV)/.test-deps system-deps
	$(BIN)/python -m pytest -q -m "not engine and not docker"

## engine-env: .engine-venv/ (or $$LORA_ENGINE_VENV); instant when already built
engine-env:
	PYTHON=$(PYTHON) ./scripts/engine-env.sh

## system-deps: what every test but the `docker` ones needs; docker-deps: what those add
system-deps:
	VENV_BIN=$(abspath $(BIN)) ./scripts/install-system-deps.sh

docker-deps:
	./scripts/install-system-deps.sh --docker

## lint: ruff, mypy --strict, and the layering check (the import-linter contracts of pyproject.toml)
lint: $(VENV)/.test-deps
	$(BIN)/ruff check sidecar tests triton_repo compose benchmarks
	$(BIN)/mypy
	$(BIN)/lint-imports --no-logo

clean:
	rm -rf $(VENV) .engine-venv .engine-venv.lock .pytest_cache .mypy_cache
