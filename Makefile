# kvroute: `make run` starts the demo, `make test` runs the suite. Both do all set-up:
# a venv with the project, then llama-server and the demo model, built once and cached
# in $(KVROUTE_CACHE) (default ~/.cache/kvroute/<llama-cpp-python version>/).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# kvroute and its run-time dependencies (`make run`); the dev tools (`make test`) on top
STAMP := $(VENV)/.kvroute-installed
DEV_STAMP := $(VENV)/.kvroute-dev-installed
PYTEST_ARGS ?=
# GPU=cuda or GPU=vulkan: build llama-server with that GPU backend (nvcc, or the Vulkan
# SDK's glslc, needed), cached beside the CPU build, which it leaves alone; `kvroute
# serve` then runs it. Exported as KVROUTE_GPU, which may also be set instead. Empty: CPU.
GPU ?=
ifneq ($(GPU),)
export KVROUTE_GPU := $(GPU)
endif
# PORTABLE=1: llama-server for any x86-64 CPU (every ggml CPU variant, the best loaded at
# start; the container image's), cached beside the native build. Empty: for this CPU.
PORTABLE ?=
ifneq ($(PORTABLE),)
export KVROUTE_PORTABLE := 1
endif
# CONFIG=path/to/config.yaml: what `make run` serves (default: ./config.yaml)
CONFIG ?=
CONFIG_ARG := $(if $(CONFIG),--config $(CONFIG))

# The real Claude Code CLI, for the end-to-end test (tests/test_claude_code.py, skipped
# without it; it checks that it runs this version). A native binary in an npm package:
# ~6 s, ~235 MB. Bumping it is a deliberate change: the test then runs the new release.
CLAUDE_CODE_VERSION ?= 2.1.331
CLAUDE_CODE_DIR := $(HOME)/.cache/kvroute/npm
CLAUDE_CODE_PKG := $(CLAUDE_CODE_DIR)/node_modules/@anthropic-ai/claude-code/package.json

.PHONY: run test lint artifacts claude-code chromium nats-server bench clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "==> installing kvroute into $(VENV) (first time: llama-cpp-python compiles, ~4 min)"
	$(PY) -m pip install --upgrade pip wheel >/dev/null
	$(PY) -m pip install -e .
	@touch $(STAMP)

# the test, lint and SDK packages of the `dev` extra: `make run` never needs them
$(DEV_STAMP): $(STAMP)
	$(PY) -m pip install -e '.[dev]'
	@touch $(DEV_STAMP)

artifacts: $(STAMP)
	$(PY) -m backends prepare $(CONFIG_ARG)

run: artifacts
	$(VENV)/bin/kvroute serve $(CONFIG_ARG)

lint: $(DEV_STAMP)
	$(VENV)/bin/ruff check proxy backends loadtest tests

claude-code:
	@if grep -qsF '"version": "$(CLAUDE_CODE_VERSION)"' $(CLAUDE_CODE_PKG); then :; \
	elif command -v npm >/dev/null; then \
		echo "==> installing Claude Code $(CLAUDE_CODE_VERSION) into $(CLAUDE_CODE_DIR)"; \
		npm install --silent --no-audit --no-fund --prefix $(CLAUDE_CODE_DIR) \
			@anthropic-ai/claude-code@$(CLAUDE_CODE_VERSION) \
		|| echo "WARNING: Claude Code install failed: its end-to-end test will be skipped"; \
	else echo "WARNING: no npm: the Claude Code end-to-end test will be skipped"; fi

# Headless Chromium for the status page's browser test (skipped without it): installed
# with apt when missing and this is root, tried once (a stamp); never fatal.
CHROMIUM_TRIED := $(VENV)/.chromium-tried
chromium:
	@chromium --version >/dev/null 2>&1 || chromium-browser --version >/dev/null 2>&1 || \
	test -e $(CHROMIUM_TRIED) || \
	{ touch $(CHROMIUM_TRIED); command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] \
	  && echo "==> installing chromium" && apt-get update -qq \
	  && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
	echo "WARNING: no chromium: the status page's browser test will be skipped"

# nats-server for the replicas' tests (skipped without it): as chromium above.
NATS_TRIED := $(VENV)/.nats-tried
nats-server:
	@command -v nats-server >/dev/null || test -e $(NATS_TRIED) || \
	{ touch $(NATS_TRIED); command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] \
	  && echo "==> installing nats-server" && apt-get update -qq \
	  && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nats-server >/dev/null; } || \
	echo "WARNING: no nats-server: the replicas' broker tests will be skipped"

test: artifacts lint claude-code chromium nats-server
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The benchmarks behind BENCHMARKS.md that need no backends: routing core, proxy
# overhead (against a fake backend), the backend client. Load tests: `python -m loadtest`.
bench: artifacts
	$(PY) bench/bench_core.py
	$(PY) bench/bench_proxy.py
	$(PY) bench/bench_upstream.py

clean:
	rm -rf $(VENV) logs
