"""The devices a llama-server build offloads to, and a managed backend's choice of them.

`llama-server --list-devices` names what its build can use: ``Vulkan0``, ``CUDA1`` (a CPU
build lists none). A backend's ``devices:`` names them as the server does (its
``--device``: the model's layers are split over them, by their free memory), or, for
CUDA, by index (``CUDA_VISIBLE_DEVICES``, the convention of CUDA tools: the server then
sees those GPUs only, as CUDA0, CUDA1...). Checked against the list before the server
starts: a name the build does not list fails the backend with what it does list.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

DeviceRef = str | int  # a device's name, or a CUDA device's index

# "  Vulkan0: llvmpipe (LLVM 15.0.6, 256 bits) (23999 MiB, 23999 MiB free)"
_LINE = re.compile(r"^\s+(\S+): (.*) \((\d+) MiB, (\d+) MiB free\)\s*$")
LIST_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Device:
    name: str  # what --device takes
    description: str
    total_mib: int
    free_mib: int


def parse_listed(text: str) -> list[Device]:
    """The devices in ``llama-server --list-devices`` output (none: a CPU build)."""
    return [Device(m[1], m[2], int(m[3]), int(m[4]))
            for line in text.splitlines() if (m := _LINE.match(line))]


@lru_cache(maxsize=8)
def list_devices(binary: Path) -> tuple[Device, ...]:
    """What ``binary`` lists (it loads its backends and exits)."""
    out = subprocess.run([str(binary), "--list-devices"], capture_output=True, text=True,
                         timeout=LIST_TIMEOUT_S, check=False)
    return tuple(parse_listed(out.stdout))


def launch(devices: tuple[DeviceRef, ...]) -> tuple[list[str], dict[str, str]]:
    """The server's arguments and environment for ``devices`` (names, or CUDA indices)."""
    if not devices:
        return [], {}
    if all(isinstance(d, int) for d in devices):
        return [], {"CUDA_VISIBLE_DEVICES": ",".join(str(d) for d in devices)}
    return ["--device", ",".join(str(d) for d in devices)], {}


def problem(devices: tuple[DeviceRef, ...], listed: tuple[Device, ...]) -> str | None:
    """Why ``devices`` cannot be used with a build that lists ``listed`` (None: they can)."""
    names = [d.name for d in listed]
    have = ", ".join(names) or "none: a CPU build"
    if all(isinstance(d, int) for d in devices):
        cuda = [n for n in names if n.startswith("CUDA")]
        wrong = [d for d in devices if not 0 <= int(d) < len(cuda)]
        if not wrong:
            return None
        return (f"devices {list(devices)}: CUDA indices, but this llama-server lists "
                f"{len(cuda)} CUDA device(s) ({have}) (fix: build it with GPU=cuda, or name "
                "the devices it lists)")
    if any(isinstance(d, int) for d in devices):
        return (f"devices {list(devices)}: give names or CUDA indices, not both "
                "(fix: e.g. devices: [CUDA0, CUDA1])")
    wrong = [d for d in devices if d not in names]
    if not wrong:
        return None
    return (f"device {', '.join(map(str, wrong))}: not one this llama-server lists ({have}) "
            "(fix: a name from `llama-server --list-devices`, or build the variant "
            "for it: GPU=vulkan or GPU=cuda make run)")
