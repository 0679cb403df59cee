# kvroute: `make run` starts the demo, `make test` runs the suite. Both do all set-up:
# a venv with the project, then llama-server and the demo model, built once and cached
# in $(KVROUTE_CACHE) (default ~/.cache/kvroute/<llama-cpp-python version>/).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvroute-installed
PYTEST_ARGS ?=

.PHONY: run test lint artifacts bench clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "==> installing kvroute into $(VENV) (first time: llama-cpp-python compiles, ~4 min)"
	$(PY) -m pip install --upgrade pip wheel >/dev/null
	$(PY) -m pip install -e '.[dev]'
	@touch $(STAMP)

artifacts: $(STAMP)
	$(PY) -m backends prepare

run: artifacts
	$(VENV)/bin/kvroute serve

lint: $(STAMP)
	$(VENV)/bin/ruff check proxy backends loadtest tests

test: artifacts lint
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: artifacts
	$(PY) -m loadtest bench

clean:
	rm -rf $(VENV) logs
