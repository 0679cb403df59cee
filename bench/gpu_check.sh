#!/usr/bin/env bash
# The GPU path for real, on a machine with NVIDIA GPUs (an H100-class one with 16 cores:
# about 10 minutes). Builds llama-server for this GPU's architecture only, then, one
# backend per GPU with every layer on it: the agentic workload (prefix vs round_robin)
# and the conversation trace's chat replay; prints the ratios and the prefill rate.
#
#   bash bench/gpu_check.sh            (after `make test` or `make run` set up .venv)
#
# GPU_CHECK_DRY=1 prints the commands instead of running them. Reports: bench-out/gpu-check/.
set -euo pipefail
cd "$(dirname "$0")/.."

fail() { echo "gpu_check: $*" >&2; exit 2; }
run() { if [ -n "${GPU_CHECK_DRY:-}" ]; then echo "+ $*"; else "$@"; fi; }

command -v nvidia-smi >/dev/null \
  || fail "nvidia-smi not found (fix: install the NVIDIA driver; this check needs an NVIDIA GPU)"
caps=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>&1) \
  || fail "nvidia-smi failed: $caps (fix: a driver that lists the GPUs: nvidia-smi -L)"
# No `| head` here: under pipefail, printf killed by head's early exit (SIGPIPE) would
# end the script with 141.
arch=${caps%%$'\n'*}
arch=${arch//[. ]/}
[[ "$arch" =~ ^[0-9]+$ ]] \
  || fail "no compute capability in nvidia-smi's answer ($caps) (fix: a driver of 2022 or later)"
n=$(printf '%s\n' "$caps" | grep -c .)
if ! command -v nvcc >/dev/null; then
  for d in "${CUDA_HOME:-}" /usr/local/cuda; do
    if [ -n "$d" ] && [ -x "$d/bin/nvcc" ]; then export PATH="$d/bin:$PATH"; break; fi
  done
fi
command -v nvcc >/dev/null \
  || fail "nvcc not found (fix: install the CUDA Toolkit, or export PATH=/usr/local/cuda/bin:\$PATH)"
[ -x .venv/bin/python ] || fail "no .venv here (fix: run \`make test\` or \`make run\` once)"

export CUDAARCHS="$arch" KVROUTE_GPU=cuda
py=.venv/bin/python
out=bench-out/gpu-check
devices=$(seq -s, 0 $((n - 1)))
echo "gpu_check: $n GPU(s), compute capability $arch: building for CUDAARCHS=$arch" >&2
run $py -m backends prepare --gpu cuda
run $py -m loadtest run --workload agentic --policies prefix,round_robin --backends "$n" \
  --devices "$devices" --slots 4 --threads 4 --sessions $((4 * n)) --turns 6 \
  --time-limit 150 --out "$out/agentic"
run $py -m loadtest run --workload chat-trace --trace conversation \
  --policies prefix,round_robin --backends "$n" --devices "$devices" --slots 4 \
  --threads 4 --requests 400 --rate $((3 * n)) --time-limit 150 --out "$out/chat"
run $py bench/gpu_report.py "$out"
