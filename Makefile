# The two commands of the README:  `make run`  and  `make test`.
# Each creates its own virtual environment; nothing but Python 3.11 is needed beforehand.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: run test test-fast test-installs test-system-deps engine-env lint system-deps docker-deps clean

# INSTALLER=uv (default) or pip: what installs the project into the venv. uv (pinned, the one
# scripts/engine-env.sh uses, put into the venv by its own pip) downloads and installs in
# parallel: `make run` answered in about half the time. uv reads no pip.conf: behind a mirror,
# set UV_INDEX_URL, or use INSTALLER=pip.
INSTALLER  ?= uv
UV_VERSION := $(shell sed -n 's/^uv_version=//p' scripts/engine-env.sh)
ifeq ($(INSTALLER),uv)
INSTALL_TOOL := $(BIN)/uv
INSTALL      := $(BIN)/uv pip install --quiet --native-tls --python $(BIN)/python
else ifeq ($(INSTALLER),pip)
# The venv's own pip, as it comes (any pip since 21.3 installs this project editable).
INSTALL_TOOL := $(BIN)/python
INSTALL      := $(BIN)/python -m pip install --quiet --disable-pip-version-check
else
$(error INSTALLER must be uv or pip)
endif

$(BIN)/python:
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is needed"'
	$(PYTHON) -m venv $(VENV)

$(BIN)/uv: $(BIN)/python
	$(BIN)/python -m pip install --quiet --disable-pip-version-check uv==$(UV_VERSION)

$(VENV)/.run-deps: $(INSTALL_TOOL) pyproject.toml
	$(INSTALL) -e .
	touch $@

$(VENV)/.test-deps: $(INSTALL_TOOL) pyproject.toml
	$(INSTALL) -e '.[test]'
	touch $@ $(VENV)/.run-deps

## run: the sidecar on its embedded default registry (./registry, with two example adapters)
run: $(VENV)/.run-deps
	$(BIN)/lora-sidecar examples ./registry --skip-if-not-empty
	exec $(BIN)/lora-sidecar serve

## test: the whole test suite, system packages (Prometheus, docker-compose, HAProxy, a Docker
## engine) and the real engine's environment (vLLM on CPU, scripts/engine-env.sh) included
test: test-installs
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS)

# pytest-xdist workers: tests/support/scheduling.py keeps a module on one worker and the engine
# and Docker tiers on one, one test at a time; the other worker runs the rest meanwhile.
TEST_WORKERS ?= 2

# The engine's environment (about 3 minutes of downloads from cold) is built while the test venv
# and the Debian packages install; the output of each comes whole when it is done.
test-installs:
	$(MAKE) --no-print-directory -j2 --output-sync=target engine-env test-system-deps

# apt-get takes one lock: the two lists one after the other. kubectl goes into the venv.
test-system-deps: $(VENV)/.test-deps
	$(MAKE) --no-print-directory system-deps
	$(MAKE) --no-print-directory docker-deps

## test-fast: everything but the tests of the real engine and of a real Docker engine, which
## is neither installed nor needed for it
test-fast: $(VENV)/.test-deps system-deps
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m "not engine and not docker"

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
