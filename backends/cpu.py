"""The CPU features that decide which ggml kernels a llama-server build runs.

A native build (`-march=native`) compiles in exactly what the building CPU has, AMX
included, and faults with SIGILL on a CPU that lacks any of it: its build records these
features, and a cached native binary is rebuilt where they differ (backends/binary.py).
`kvroute doctor` shows them.
"""

from __future__ import annotations

from pathlib import Path

# x86 flags (as /proc/cpuinfo spells them) that select ggml's CPU kernels, in the order
# of the instruction sets' arrival; what ggml's CPU variants are told apart by
KERNEL_FLAGS = (
    "sse4_2", "avx", "f16c", "fma", "avx2", "bmi2", "avx_vnni",
    "avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl", "avx512vbmi",
    "avx512_vnni", "avx512_bf16", "avx512_fp16",
    "amx_tile", "amx_int8", "amx_bf16",
)

CPUINFO = Path("/proc/cpuinfo")
# a recipe's cpu= for a build of every CPU variant, loaded at run time (GGML_BACKEND_DL)
PORTABLE = "portable"


def parse_flags(cpuinfo: str) -> frozenset[str]:
    """The flags of the first processor in a /proc/cpuinfo text (all cores of a machine
    report the same set)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    try:
        return parse_flags(cpuinfo.read_text(errors="replace"))
    except OSError:
        return frozenset()


def kernel_features(flags: frozenset[str] | None = None) -> tuple[str, ...]:
    """The kernel-selecting features this CPU has, in KERNEL_FLAGS order."""
    flags = cpu_flags() if flags is None else flags
    return tuple(f for f in KERNEL_FLAGS if f in flags)


def build_report(recipe: str | None) -> dict[str, object]:
    """This CPU's kernel features and the build in use, from its recipe (binary.py's
    build_recipe; None: a llama-server kvroute did not build, on PATH or configured)."""
    here = kernel_features()
    cpu = next((p[4:] for p in (recipe or "").split() if p.startswith("cpu=")), None)
    if cpu is None:
        build, built_for = "unknown (not built by kvroute)", None
    elif cpu == PORTABLE:
        build, built_for = "portable (every CPU variant; the best one loads)", None
    else:
        build, built_for = "native (-march=native)", [f for f in cpu.split(",") if f]
    return {"features": list(here), "amx": "amx_int8" in here, "build": build,
            "built_for": built_for,
            "matches": None if built_for is None else built_for == list(here)}
