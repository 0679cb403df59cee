"""The devices a llama-server build offloads to, and a managed backend's choice of them.

`llama-server --list-devices` names what its build can use: ``Vulkan0``, ``CUDA1`` (a CPU
build lists none). A backend's ``devices:`` names them as the server does (its
``--device``: the model's layers are split over them, by their free memory), or, for
CUDA, by index (``CUDA_VISIBLE_DEVICES``, the convention of CUDA tools: the server then
sees those GPUs only, as CUDA0, CUDA1...). Checked against the list before the server
starts: a name the build does not list fails the backend with what it does list.

ggml's Vulkan backend lists GPUs only by itself; a CPU-type device (Mesa's lavapipe on a
machine without a GPU) only when ``GGML_VK_VISIBLE_DEVICES`` names it. Where the build
lists nothing by itself, `listing` names every device the loader has there, and the
server of a backend naming devices is started with the same setting, so what was listed
(by `kvroute init`, doctor, the check before the start) is what the server sees.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

DeviceRef = str | int  # a device's name, or a CUDA device's index

# "  Vulkan0: llvmpipe (LLVM 15.0.6, 256 bits) (23999 MiB, 23999 MiB free)"
_LINE = re.compile(r"^\s+(\S+): (.*) \((\d+) MiB, (\d+) MiB free\)\s*$")
LIST_TIMEOUT_S = 60.0
VISIBLE_ENV = "GGML_VK_VISIBLE_DEVICES"
MAX_VISIBLE = 16  # devices named at most where the build lists none by itself


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


@dataclass(frozen=True)
class Listing:
    devices: tuple[Device, ...]
    env: tuple[tuple[str, str], ...]  # the environment the server needs to see them


def _listed(binary: Path, env: dict[str, str]) -> tuple[Device, ...]:
    out = subprocess.run([str(binary), "--list-devices"], capture_output=True, text=True,
                         timeout=LIST_TIMEOUT_S, check=False, env={**os.environ, **env})
    return tuple(parse_listed(out.stdout))


@lru_cache(maxsize=8)
def listing(binary: Path) -> Listing:
    """What ``binary`` lists (it loads its backends and exits); where that is nothing and
    the environment does not choose Vulkan devices, the CPU-type Vulkan devices, named
    one more at a time until ggml refuses an index that is not there (a CPU build lists
    nothing however many are named)."""
    found = _listed(binary, {})
    if found or VISIBLE_ENV in os.environ:
        return Listing(found, ())
    best = Listing((), ())
    for n in range(1, MAX_VISIBLE + 1):
        value = ",".join(str(i) for i in range(n))
        more = _listed(binary, {VISIBLE_ENV: value})
        if len(more) < n:
            break
        best = Listing(more, ((VISIBLE_ENV, value),))
    return best


def list_devices(binary: Path) -> tuple[Device, ...]:
    """What ``binary`` can offload to (see listing)."""
    return listing(binary).devices


def launch(devices: tuple[DeviceRef, ...], binary: Path | None = None
           ) -> tuple[list[str], dict[str, str]]:
    """The server's arguments and environment for ``devices`` (names, or CUDA indices);
    ``binary``: the llama-server, whose listing says what environment shows the named
    devices (without it: none)."""
    if not devices:
        return [], {}
    if all(isinstance(d, int) for d in devices):
        return [], {"CUDA_VISIBLE_DEVICES": ",".join(str(d) for d in devices)}
    env = dict(listing(binary).env) if binary is not None else {}
    return ["--device", ",".join(str(d) for d in devices)], env


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
