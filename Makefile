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
# pytest-xdist workers for `make test`, a test file each at a time (its module fixtures
# stay on one worker); 0 runs the suite in this process
PYTEST_WORKERS ?= 2
LLAMA_CPP_PIN := $(shell sed -n 's/^ *"\(llama-cpp-python==[^"]*\)".*/\1/p' pyproject.toml)
ifeq ($(LLAMA_CPP_PIN),)
$(error no "llama-cpp-python==X" line in pyproject.toml's dependencies: the Makefile reads the pin there)
endif
# GPU=cuda or GPU=vulkan: build llama-server with that GPU backend (nvcc, or the Vulkan
# SDK's glslc, needed), cached beside the CPU build, which it leaves alone; `kvroute
# serve` then runs it. Exported as KVROUTE_GPU, which may also be set instead. Empty: CPU.
GPU ?=
ifneq ($(GPU),)
export KVROUTE_GPU := $(GPU)
endif
# NATIVE=1: llama-server for this CPU only (-march=native), cached beside the default
# portable build (every ggml CPU variant, the best loaded at start), which it leaves alone.
NATIVE ?=
ifneq ($(NATIVE),)
export KVROUTE_NATIVE := 1
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

.PHONY: run test lint artifacts claude-code system-packages vulkan-packages test-setup python-setup bench clean

# llama-cpp-python is installed without its libllama: llama-server's build (make
# artifacts) is the same llama.cpp and serves the tokenizer too (backends/libllama.py,
# libllama_dir). Not from pip's cache, which would hand that wheel to installs that want
# the library.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "==> installing kvroute into $(VENV)"
	$(PY) -m pip install --upgrade pip wheel >/dev/null
	CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" \
		$(PY) -m pip install --no-cache-dir --no-deps '$(LLAMA_CPP_PIN)'
	$(PY) -m pip install -e .
	@touch $(STAMP)

# the test, lint and SDK packages of the `dev` extra: `make run` never needs them
$(DEV_STAMP): $(STAMP)
	$(PY) -m pip install -e '.[dev]'
	@touch $(DEV_STAMP)

artifacts: $(STAMP) $(if $(filter vulkan,$(GPU)),vulkan-packages)
	$(PY) -m backends prepare $(CONFIG_ARG)

# GPU=vulkan: glslc, the Vulkan loader and Mesa's drivers (lavapipe runs Vulkan on the
# CPU where no GPU is), installed with apt when missing and this is root. Headers newer
# than the system's come from the Debian archive at the build (backends/vulkan_sdk.py).
vulkan-packages:
	@{ command -v glslc >/dev/null && ls /usr/share/vulkan/icd.d/lvp_icd* /usr/share/cmake/SPIRV-Headers >/dev/null 2>&1; } \
	|| { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] \
	  && echo "==> installing glslc, the Vulkan loader and Mesa's Vulkan drivers" \
	  && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	     glslc libvulkan-dev spirv-headers mesa-vulkan-drivers >/dev/null; } \
	|| echo "WARNING: could not install glslc, libvulkan-dev, spirv-headers and mesa-vulkan-drivers: \
	the Vulkan build names what it lacks"

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

# Headless Chromium for the status page's browser test and nats-server for the replicas'
# tests (each skipped without it): installed with apt when missing and this is root, in
# one apt run, tried once (a stamp); never fatal.
SYSTEM_TRIED := $(HOME)/.cache/kvroute/system-packages-tried
system-packages:
	@missing=""; \
	chromium --version >/dev/null 2>&1 || chromium-browser --version >/dev/null 2>&1 \
		|| missing=" chromium"; \
	command -v nats-server >/dev/null || missing="$$missing nats-server"; \
	test -z "$$missing" || test -e $(SYSTEM_TRIED) || \
	{ mkdir -p $(dir $(SYSTEM_TRIED)) && touch $(SYSTEM_TRIED); command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] \
	  && echo "==> installing$$missing" && apt-get update -qq \
	  && { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null \
	       || for p in $$missing; do \
	            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$p >/dev/null; done; }; } || \
	echo "WARNING: could not install$$missing: the status page's browser test and the \
	replicas' broker tests need chromium and nats-server, and are skipped without them"

# The Python chain (venv, llama.cpp's build, the dev tools) runs in order; the system
# packages and Claude Code download and install beside it, on the cores it leaves.
test-setup:
	@$(MAKE) --no-print-directory -j3 python-setup claude-code system-packages

python-setup: artifacts
	@$(MAKE) --no-print-directory lint

test: test-setup
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The benchmarks behind BENCHMARKS.md that need no backends: routing core, proxy
# overhead (against a fake backend), the backend client. Load tests: `python -m loadtest`.
bench: artifacts
	$(PY) bench/bench_core.py
	$(PY) bench/bench_proxy.py
	$(PY) bench/bench_upstream.py

clean:
	rm -rf $(VENV) logs $(SYSTEM_TRIED)
