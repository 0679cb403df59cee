"""Devices a backend offloads to: what a build lists, what a backend names, the server's
arguments for them, and a backend naming one its build lacks (a real llama-server)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest

from backends.devices import Device, launch, list_devices, parse_listed, problem
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
