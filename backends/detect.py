"""What `kvroute init` finds: this machine's GPUs, RAM and cores, and a model's needs.

GPUs: NVIDIA ones from `nvidia-smi` (named by CUDA index, the convention of its tools);
else the devices a llama-server build lists (a Vulkan build on any GPU, or on Mesa's CPU
driver); else none. The model: its file's size (the weights), its KV bytes per token
and trained context from its GGUF metadata.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from backends.demo_model import read_gguf_metadata
from backends.devices import listing
from backends.init_plan import GPU, Machine, ModelFacts
from backends.memory import gguf_memory

SMI_TIMEOUT_S = 30.0


class NotAModel(ValueError):
    """The file is not a GGUF kvroute can size (the message says why and what to do)."""


def parse_nvidia_smi(text: str) -> tuple[GPU, ...]:
    """``nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader,nounits``."""
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[0].isdigit() and parts[2].isdigit():
            out.append(GPU(int(parts[0]), parts[1], int(parts[2])))
    return tuple(out)


def nvidia_gpus() -> tuple[GPU, ...]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return ()
    try:
        r = subprocess.run([smi, "--query-gpu=index,name,memory.total",
                            "--format=csv,noheader,nounits"], capture_output=True,
                           text=True, timeout=SMI_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ()
    return parse_nvidia_smi(r.stdout) if r.returncode == 0 else ()


def host() -> tuple[int, int]:
    """(MiB of RAM, cores)."""
    mem = 0
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) // 1024
                break
    return mem, os.cpu_count() or 1


def machine(binary: Path | None) -> Machine:
    """The GPUs nvidia-smi finds, else those ``binary`` lists, and the host."""
    ram, cpus = host()
    gpus = nvidia_gpus()
    if gpus:
        return Machine(gpus, ram, cpus, "nvidia-smi")
    if binary is None:
        return Machine((), ram, cpus, "no GPU found")
    listed = listing(binary)
    if listed.devices:
        shown = "".join(f"{k}={v} " for k, v in listed.env)  # what made them listed
        return Machine(tuple(GPU(d.name, d.description, d.total_mib) for d in listed.devices),
                       ram, cpus, f"{shown}{binary} --list-devices")
    return Machine((), ram, cpus, "no GPU found")


def model_facts(path: Path) -> ModelFacts:
    try:
        meta = read_gguf_metadata(path)
        kv = gguf_memory(path).kv_bytes_per_token
    except (OSError, ValueError) as e:
        raise NotAModel(f"{path}: {e} (fix: the path of a .gguf model file)") from e
    if kv is None:
        raise NotAModel(f"{path}: its metadata does not give the KV cache's size (fix: a "
                        "model of an architecture llama.cpp names its attention heads for)")
    ctx = meta.get(f"{meta.get('general.architecture')}.context_length")
    return ModelFacts(path.resolve(), path.stat().st_size, kv,
                      ctx if isinstance(ctx, int) and ctx > 0 else None)
