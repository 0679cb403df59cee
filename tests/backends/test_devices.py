"""Devices a backend offloads to: what a build lists, what a backend names, the server's
arguments for them, and a backend naming one its build lacks (a real llama-server)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest

from backends.devices import (
    VISIBLE_ENV,
    Device,
    launch,
    list_devices,
    listing,
    parse_listed,
    problem,
)
from backends.supervisor import Supervisor
from proxy.config.load import Config

VULKAN = """Available devices:
  Vulkan0: llvmpipe (LLVM 15.0.6, 256 bits) (23999 MiB, 23999 MiB free)
"""
CUDA = """ggml_cuda_init: found 2 CUDA devices:
Available devices:
  CUDA0: NVIDIA H100 80GB HBM3 (81079 MiB, 80500 MiB free)
  CUDA1: NVIDIA H100 80GB HBM3 (81079 MiB, 80512 MiB free)
"""
CPU = "Available devices:\n  (none)\n"


@pytest.mark.parametrize(("text", "want"), [
    (VULKAN, [Device("Vulkan0", "llvmpipe (LLVM 15.0.6, 256 bits)", 23999, 23999)]),
    (CUDA, [Device("CUDA0", "NVIDIA H100 80GB HBM3", 81079, 80500),
            Device("CUDA1", "NVIDIA H100 80GB HBM3", 81079, 80512)]),
    (CPU, []),
    ("", []),
])
def test_parse_listed(text: str, want: list[Device]) -> None:
    assert parse_listed(text) == want


@pytest.mark.parametrize(("devices", "args", "env"), [
    ((), [], {}),
    (("Vulkan0",), ["--device", "Vulkan0"], {}),
    (("CUDA0", "CUDA1"), ["--device", "CUDA0,CUDA1"], {}),
    ((0, 1), [], {"CUDA_VISIBLE_DEVICES": "0,1"}),
])
def test_launch(devices: tuple[str | int, ...], args: list[str], env: dict[str, str]) -> None:
    assert launch(devices) == (args, env)


@pytest.mark.parametrize(("devices", "listed", "fails"), [
    (("Vulkan0",), VULKAN, None),
    (("Vulkan1",), VULKAN, "Vulkan1: not one this llama-server lists (Vulkan0)"),
    (("Vulkan0",), CPU, "none: a CPU build"),
    ((0, 1), CUDA, None),
    ((2,), CUDA, "lists 2 CUDA device(s)"),
    ((0,), VULKAN, "build it with GPU=cuda"),
    ((0, "CUDA1"), CUDA, "not both"),
])
def test_problem(devices: tuple[str | int, ...], listed: str, fails: str | None) -> None:
    got = problem(devices, tuple(parse_listed(listed)))
    assert (got is None) == (fails is None), got
    if fails is not None:
        assert fails in got  # type: ignore[operator]


# ggml's behaviour, as a script: GPUs listed by themselves; CPU-type devices only when
# GGML_VK_VISIBLE_DEVICES names them, the whole list refused for an index not there
FAKE = """#!/bin/sh
gpus="{gpus}"; cpus={cpus}; echo "Available devices:"
if [ -z "${{GGML_VK_VISIBLE_DEVICES+x}}" ]; then
  i=0; for g in $gpus; do echo "  Vulkan$i: $g (8192 MiB, 8000 MiB free)"; i=$((i+1)); done
  exit 0
fi
n=0; for i in $(echo "$GGML_VK_VISIBLE_DEVICES" | tr , ' '); do
  [ "$i" -lt "$cpus" ] || {{ echo "Invalid device index $i" >&2; exit 0; }}; n=$((n+1))
done
i=0; while [ $i -lt $n ]; do echo "  Vulkan$i: llvmpipe (2048 MiB, 2048 MiB free)"; i=$((i+1)); done
"""


@pytest.mark.parametrize(("gpus", "cpus", "preset", "names", "env"), [
    ("", 1, None, ["Vulkan0"], {VISIBLE_ENV: "0"}),
    ("", 2, None, ["Vulkan0", "Vulkan1"], {VISIBLE_ENV: "0,1"}),
    ("", 0, None, [], {}),
    ("A100", 1, None, ["Vulkan0"], {}),  # a GPU: the build's own choice stands
    ("", 1, "", [], {}),  # the operator's choice stands
])
def test_a_build_that_lists_nothing_by_itself_is_shown_its_cpu_devices(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gpus: str, cpus: int,
        preset: str | None, names: list[str], env: dict[str, str]) -> None:
    fake = tmp_path / "llama-server"
    fake.write_text(FAKE.format(gpus=gpus, cpus=cpus))
    fake.chmod(0o755)
    if preset is not None:
        monkeypatch.setenv(VISIBLE_ENV, preset)
    else:
        monkeypatch.delenv(VISIBLE_ENV, raising=False)
    got = listing(fake)
    assert ([d.name for d in got.devices], dict(got.env)) == (names, env)
    assert launch(("Vulkan0",), fake) == (["--device", "Vulkan0"], env)


def test_this_cpu_build_lists_no_device(llama_server_bin: Path) -> None:
    assert list_devices(llama_server_bin) == ()


async def test_a_backend_naming_a_device_its_build_lacks_fails_and_says_why(
        pool_config: Callable[..., Config]) -> None:
    cfg = pool_config(n=1)
    b = dataclasses.replace(cfg.backends[0], devices=("Vulkan0",))
    sup = Supervisor(dataclasses.replace(cfg, backends=(b,)))
    await sup.start()
    try:
        (status,) = sup.statuses()
        assert status["state"] == "failed"
        assert status["devices"] == ["Vulkan0"]
        assert "Vulkan0: not one this llama-server lists (none: a CPU build)" in \
            str(status["last_error"])
    finally:
        await sup.stop()
