"""`kvroute init`'s sizing (pure, table-driven) and the command on this machine, with a
fake nvidia-smi for an 8-GPU one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from backends.detect import parse_nvidia_smi
from backends.init_plan import (
    GPU,
    MIN_CTX,
    DoesNotFit,
    Machine,
    ModelFacts,
    _usable,
    plan,
)
from proxy.config.load import load_config

GiB = 1 << 30
H100 = GPU(0, "NVIDIA H100 80GB HBM3", 81559)
SMI_8 = "".join(f"{i}, NVIDIA H100 80GB HBM3, 81559\n" for i in range(8))


def gpus(n: int, mib: int = 81559) -> tuple[GPU, ...]:
    return tuple(GPU(i, "GPU", mib) for i in range(n))


def model(weights_gib: float, kv_kib: int, ctx: int | None = 131072) -> ModelFacts:
    return ModelFacts(Path("/m/model.gguf"), int(weights_gib * GiB), kv_kib * 1024, ctx)


@pytest.mark.parametrize(("m", "machine", "devices", "slots"), [
    # an 8B Q4 model: one backend per GPU, 8 slots of 64k+
    (model(4.9, 128), Machine(gpus(8), 2 << 20, 192, "nvidia-smi"),
     [(i,) for i in range(8)], 8),
    # a 70B f16 model (140 GB): it needs 2 GPUs' memory, and a slot's KV: groups of 4
    (model(140, 320), Machine(gpus(8), 2 << 20, 192, "nvidia-smi"),
     [(0, 1, 2, 3), (4, 5, 6, 7)], 7),
    # a 30 GB model on 24 GB cards: a pair, the odd one left
    (model(30, 96), Machine(gpus(3, 24576), 64 << 10, 16, "nvidia-smi"), [(0, 1)], 2),
    # a Vulkan device (named), and none at all: the CPU
    (model(0.2, 8), Machine((GPU("Vulkan0", "llvmpipe", 23999),), 24 << 10, 2, "x"),
     [("Vulkan0",)], 8),
    (model(0.2, 8), Machine((), 24 << 10, 2, "no GPU found"), [()], 4),
])
def test_plan(m: ModelFacts, machine: Machine, devices: list[tuple[object, ...]],
              slots: int) -> None:
    p = plan(m, machine)
    assert [b.devices for b in p.backends] == devices
    for b in p.backends:
        assert b.slots == slots and b.ctx_per_slot % 256 == 0
        assert MIN_CTX <= b.ctx_per_slot <= (m.ctx_train or 1 << 30)
        if b.devices:  # weights + KV + margin within the group's memory
            group = [g for g in machine.gpus if g.ref in b.devices]
            kv = b.slots * b.ctx_per_slot * m.kv_bytes_per_token
            assert m.weights_bytes + kv <= sum(_usable(g.total_mib) for g in group) << 20
        assert b.cache_ram_mib * len(p.backends) <= machine.ram_mib * 0.5


@pytest.mark.parametrize(("m", "machine", "says"), [
    (model(140, 320), Machine(gpus(1), 1 << 20, 64, "nvidia-smi"), "more GPUs"),
    (model(140, 320), Machine(gpus(3), 1 << 20, 64, "nvidia-smi"), "more GPUs"),
    (model(40, 128), Machine((), 32 << 10, 8, "no GPU found"), "this host's RAM"),
])
def test_what_does_not_fit_says_so(m: ModelFacts, machine: Machine, says: str) -> None:
    with pytest.raises(DoesNotFit, match=says):
        plan(m, machine)


def test_parse_nvidia_smi() -> None:
    assert parse_nvidia_smi(SMI_8)[0] == H100
    assert len(parse_nvidia_smi(SMI_8 + "No devices were found\n")) == 8


def test_init_on_a_fake_8_gpu_machine_writes_a_config_that_loads(
        tmp_path: Path, demo_model: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\nprintf '{SMI_8}'\n")
    smi.chmod(0o755)
    out = tmp_path / "config.yaml"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    r = subprocess.run([sys.executable, "-m", "proxy.cli", "init", str(demo_model),
                        "--out", str(out)], env=env, capture_output=True, text=True,
                       timeout=60, cwd=Path(__file__).parents[2])
    assert r.returncode == 0, r.stderr
    assert "devices (nvidia-smi): 0 NVIDIA H100 80GB HBM3 81559 MiB" in r.stderr
    cfg = load_config(out, check_port=False)
    assert [b.devices for b in cfg.managed()] == [(i,) for i in range(8)]
    assert all(b.slots == 8 and b.ctx_per_slot == 131072 for b in cfg.managed())
    again = subprocess.run([sys.executable, "-m", "proxy.cli", "init", str(demo_model),
                            "--out", str(out)], env=env, capture_output=True, text=True,
                           timeout=60, cwd=Path(__file__).parents[2])
    assert again.returncode == 2 and "--force" in again.stderr
