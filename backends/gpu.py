"""The llama-server build variants: cpu (the default), cuda and vulkan. Each has its own
cmake command line (the flags of the vendored tree's docs/build.md), the toolchain it
needs, and its own build tree, binary and version stamp in the cache, so building one
never touches another and each stays incremental.

The variant comes from ``--gpu`` (``python -m backends prepare``), else ``$KVROUTE_GPU``
(``make run GPU=cuda`` sets it), else cpu.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

GPUS = ("cpu", "cuda", "vulkan")
GPU_ENV = "KVROUTE_GPU"
NATIVE_ENV = "KVROUTE_NATIVE"

CMAKE_FLAGS = (
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    # shared libraries: libllama serves the proxy's tokenizer too (libllama.libllama_dir),
    # so llama.cpp is compiled once; $ORIGIN lets the binary find them beside itself
    # wherever its directory is copied (a GPU variant still loads the driver's and
    # toolkit's libraries, as any GPU program)
    "-DBUILD_SHARED_LIBS=ON",
    "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",
    "-DCMAKE_INSTALL_RPATH=$ORIGIN",
    "-DCMAKE_BUILD_TYPE=Release",
)
# The default, portable build: ggml's CPU code built for every x86-64 (or arm64) level as
# libraries, the best for the CPU at hand loaded at start (the tree's docs/build.md,
# GGML_CPU_ALL_VARIANTS), as llama.cpp's releases are. It runs on any CPU, and on the
# demo model prefills 1.25x faster than -march=native here (BENCHMARKS.md, "CPU builds").
PORTABLE_FLAGS = (
    "-DGGML_NATIVE=OFF",
    "-DGGML_BACKEND_DL=ON",
    "-DGGML_CPU_ALL_VARIANTS=ON",
)
# where the CUDA toolkit installs when it is not on PATH (CMake's FindCUDAToolkit looks
# there too)
CUDA_ROOTS = ("/usr/local/cuda", "/opt/cuda")

# The pinned tree's ggml-vulkan.cpp uses this extension's types (vk::LayerSettingEXT):
# older Vulkan headers (Debian 12's, header version 239) fail to compile it
VULKAN_HEADER_NEEDS = "VK_EXT_layer_settings"
VULKAN_INCLUDE_DIRS = ("/usr/include", "/usr/local/include")

Which = Callable[..., str | None]  # shutil.which


def requested_gpu(value: str | None = None) -> str:
    """The variant asked for, normalised: ``value``, else ``$KVROUTE_GPU``, else cpu
    (binary.gpu_variant checks it is one of GPUS)."""
    raw = value if value is not None else os.environ.get(GPU_ENV, "")
    return raw.strip().lower() or "cpu"


def portable() -> bool:
    """Whether the build asked for is portable (the default) or native ($KVROUTE_NATIVE):
    this CPU's instructions only (-march=native), one CPU library compiled instead of
    every variant, which runs nowhere else."""
    return os.environ.get(NATIVE_ENV, "").strip().lower() not in ("1", "true", "yes", "on")


def _name(gpu: str, native: bool | None = None) -> str:
    native = not portable() if native is None else native
    return f"{gpu}-native" if native else gpu


def build_dir(cache: Path, gpu: str) -> Path:
    return cache / f"build-{_name(gpu)}"


def binary_path(cache: Path, gpu: str, native: bool | None = None) -> Path:
    """Where the build's llama-server is kept, with the libraries it loads beside it
    (``native``: that build rather than the one asked for)."""
    return cache / f"bin-{_name(gpu, native)}" / "llama-server"


def version_stamp(cache: Path, gpu: str) -> Path:
    return cache / f"llama-server-{_name(gpu)}.version"


def recipe_stamp(cache: Path, gpu: str) -> Path:
    """What the cached binary was built from (binary.build_recipe)."""
    return cache / f"llama-server-{_name(gpu)}.recipe"


def cmake_configure_command(source: Path, build: Path, gpu: str,
                            compiler: str | None = None,
                            cuda_archs: str | None = None) -> list[str]:
    """The cmake configure step of ``gpu``'s variant. ``compiler`` is the variant's
    toolchain program (nvcc for cuda, glslc for vulkan), named so cmake uses the one
    kvroute checked; ``cuda_archs`` ($CUDAARCHS, e.g. "86;89") the GPU generations to
    build for, else ggml builds for the GPUs present (and fails where there are none)."""
    return ["cmake", "-S", str(source), "-B", str(build), *cmake_flags(gpu, compiler, cuda_archs)]


def cmake_flags(gpu: str, compiler: str | None = None,
                cuda_archs: str | None = None) -> list[str]:
    """The cmake flags of ``gpu``'s variant (see cmake_configure_command)."""
    cmd = list(CMAKE_FLAGS)
    if portable():
        cmd.extend(PORTABLE_FLAGS)
    if gpu == "cuda":
        cmd.append("-DGGML_CUDA=ON")
        if compiler:
            cmd.append(f"-DCMAKE_CUDA_COMPILER={compiler}")
        if cuda_archs:
            cmd.append(f"-DCMAKE_CUDA_ARCHITECTURES={cuda_archs}")
    elif gpu == "vulkan":
        cmd.append("-DGGML_VULKAN=ON")
        if compiler:
            cmd.append(f"-DVulkan_GLSLC_EXECUTABLE={compiler}")
    return cmd


def _find_nvcc(which: Which, env: Mapping[str, str], cuda_roots: Sequence[str]) -> str | None:
    if env.get("CUDACXX"):
        return which(env["CUDACXX"], path=env.get("PATH"))
    roots = [env.get("CUDA_PATH"), env.get("CUDA_HOME"), *cuda_roots]
    return which("nvcc", path=env.get("PATH")) or next(
        (str(p) for r in roots if r and (p := Path(r) / "bin" / "nvcc").is_file()), None)


def _find_glslc(which: Which, env: Mapping[str, str]) -> str | None:
    sdk = env.get("VULKAN_SDK")
    found = which("glslc", path=env.get("PATH"))
    return found or (which("glslc", path=str(Path(sdk) / "bin")) if sdk else None)


_MISSING = {
    "cuda": ("the CUDA compiler nvcc, which is not in $CUDACXX, on PATH, or under "
             "$CUDA_PATH, $CUDA_HOME, " + ", ".join(CUDA_ROOTS),
             "install the CUDA Toolkit (https://developer.nvidia.com/cuda-downloads, or "
             "`apt install nvidia-cuda-toolkit`) and put its bin/ on PATH, or set "
             "CUDACXX=/path/to/nvcc"),
    "vulkan": ("the Vulkan SDK's shader compiler glslc, which is not on PATH or in "
               "$VULKAN_SDK/bin",
               "install the Vulkan SDK (https://vulkan.lunarg.com/sdk/home) and source its "
               "setup-env.sh, or on Debian/Ubuntu `apt install libvulkan-dev glslc "
               "spirv-headers`"),
}


def find_toolchain(gpu: str, which: Which = shutil.which, env: Mapping[str, str] | None = None,
                   cuda_roots: Sequence[str] = CUDA_ROOTS) -> str | None:
    """The toolchain program ``gpu``'s build needs (nvcc, glslc), or None: missing, or
    the cpu variant, which needs none beyond a C++ compiler."""
    env = os.environ if env is None else env
    if gpu == "cuda":
        return _find_nvcc(which, env, cuda_roots)
    return _find_glslc(which, env) if gpu == "vulkan" else None


def missing_toolchain(gpu: str) -> str:
    """What ``gpu``'s build lacks when find_toolchain finds nothing, and what to install."""
    needs, fix = _MISSING[gpu]
    return (f"a {gpu} build of llama-server (GPU={gpu}) needs {needs} "
            f"(fix: {fix}; or leave GPU unset for the CPU build)")


def vulkan_headers_problem(env: Mapping[str, str] | None = None,
                           include_dirs: Sequence[str] = VULKAN_INCLUDE_DIRS) -> str | None:
    """Why the first Vulkan headers found ($VULKAN_SDK/include, then the system's) cannot
    compile the pinned tree, or None: they can, or none are found there (CMake then says
    what it misses). Checked before a build that would fail minutes in."""
    env = os.environ if env is None else env
    sdk = [str(Path(env["VULKAN_SDK"]) / "include")] if env.get("VULKAN_SDK") else []
    for root in (*sdk, *include_dirs):
        header = Path(root) / "vulkan" / "vulkan_core.h"
        if not header.is_file():
            continue
        text = header.read_text(errors="replace")
        if VULKAN_HEADER_NEEDS in text:
            return None
        version = re.search(r"#define VK_HEADER_VERSION (\d+)", text)
        return (f"the Vulkan headers in {header.parent} (header version "
                f"{version.group(1) if version else 'unknown'}) lack {VULKAN_HEADER_NEEDS}, "
                "which this llama.cpp uses (fix: install the Vulkan SDK "
                "(https://vulkan.lunarg.com/sdk/home) and source its setup-env.sh, or the "
                "libvulkan-dev of a newer distribution, e.g. Ubuntu 24.04)")
    return None

