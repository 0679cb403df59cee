"""Find or build llama-server, and locate the cache that holds built artifacts.

Lookup order: the binary named in config, else `llama-server` on PATH, else
the one built from the llama.cpp tree vendored in the pinned llama-cpp-python sdist, so
the server and the proxy's tokenizer come from the same llama.cpp version. The built one
is of the variant asked for: cpu, cuda or vulkan (backends/gpu.py).

Cache layout (`KVROUTE_CACHE` overrides the whole directory):

    ~/.cache/kvroute/<llama-cpp-python version>/
        src/llama_cpp_python-<version>/   extracted sdist (pip download --no-binary), patched
        build-<variant>/                  cmake build trees, one per variant (gpu.py):
                                          cpu, cpu-native, cuda, vulkan-native...
        bin-<variant>/llama-server        each build's binary, with its libraries beside it
        llama-server-<variant>.version    `llama-server --version` of each
        llama-server-<variant>.recipe     what it was built from (build_recipe)
        models/kvroute-demo-*.gguf        demo models (backends/demo_model.py)
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from backends.cpu import PORTABLE, kernel_features
from backends.gpu import (
    GPU_ENV,
    GPUS,
    binary_path,
    build_dir,
    cmake_configure_command,
    cmake_flags,
    find_toolchain,
    missing_toolchain,
    portable,
    recipe_stamp,
    requested_gpu,
    version_stamp,
    vulkan_headers_problem,
)
from backends.vendor_patch import PatchError, applied, apply_all
from backends.vendor_patch import digest as patches_digest
from backends.vulkan_sdk import SUITE, NoSdk, debian_sdk

# NOTE: used only when llama-cpp-python is not installed (e.g. doctor in a broken venv);
# must match the pin in pyproject.toml.
PINNED_LLAMA_CPP_PYTHON = "0.3.36"

Progress = Callable[[str], None]


class BinaryError(RuntimeError):
    """llama-server could not be found or built; the message says how to fix it."""


@dataclass(frozen=True)
class LlamaServerBinary:
    path: Path
    version: str  # first line of `llama-server --version`, e.g. "version: 1 (abc123)"
    source: str  # "config" | "path" | "cache" | "built"


def llama_cpp_python_version() -> str:
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        return PINNED_LLAMA_CPP_PYTHON


def cache_dir() -> Path:
    env = os.environ.get("KVROUTE_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "kvroute" / llama_cpp_python_version()


def gpu_variant(value: str | None = None) -> str:
    """The build variant asked for: ``value``, else ``$KVROUTE_GPU``, else cpu."""
    gpu = requested_gpu(value)
    if gpu not in GPUS:
        raise BinaryError(f"{GPU_ENV}={gpu!r}: not a llama-server build variant "
                          f"(fix: one of {', '.join(GPUS)}; empty means cpu)")
    return gpu


def cached_binary_path(cache: Path | None = None, gpu: str | None = None) -> Path:
    return binary_path(cache or cache_dir(), gpu_variant(gpu))


@contextlib.contextmanager
def cache_lock(cache: Path | None = None) -> Iterator[None]:
    """Serialise builds: several `make test` runs may share one cache."""
    cache = cache or cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _print(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def binary_version(path: Path) -> str:
    """First line of `llama-server --version` (it prints to stderr), or '' if it fails."""
    try:
        out = subprocess.run(
            [str(path), "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    for line in (out.stderr + out.stdout).splitlines():
        if line.startswith("version:"):
            return line.strip()
    return ""


def _native_cpu() -> str:
    # a native build compiles with -march=native: it holds this CPU's kernels, AMX included
    return "cpu=" + (PORTABLE if portable() else ",".join(kernel_features()))


def build_recipe(gpu: str) -> str:
    """What ``gpu``'s build is made of beyond the pinned source: its cmake flags, the CPU
    features its native kernels use, and the patches. A cached binary of another recipe
    (another CPU, a changed patch) is rebuilt, incrementally where the CPU is the same."""
    flags = cmake_flags(gpu, None, os.environ.get("CUDAARCHS"))
    # the version too: $KVROUTE_CACHE is not split by version as the default cache is
    return " ".join([f"llama-cpp-python={llama_cpp_python_version()}", *flags,
                     _native_cpu(), f"patches={patches_digest()}"])


def cached_recipe(gpu: str | None = None) -> str | None:
    """The recipe the cached binary of ``gpu``'s variant was built from, if any."""
    stamp = recipe_stamp(cache_dir(), gpu_variant(gpu))
    return stamp.read_text() if stamp.is_file() else None


def cached_llama_server(gpu: str) -> LlamaServerBinary | None:
    """The cached build of ``gpu``'s variant, if it is built from this recipe."""
    cache = cache_dir()
    path = binary_path(cache, gpu)
    if not (path.is_file() and os.access(path, os.X_OK)):
        return None
    if cached_recipe(gpu) != build_recipe(gpu):
        return None
    stamp = version_stamp(cache, gpu)
    version = stamp.read_text().strip() if stamp.is_file() else binary_version(path)
    return LlamaServerBinary(path, version, "cache")


def find_llama_server(configured: str | Path | None = None,
                      gpu: str | None = None) -> LlamaServerBinary | None:
    """Resolve without building. Returns None when nothing usable is found. ``gpu``
    (default: $KVROUTE_GPU, else cpu) picks which cached build counts."""
    if configured:
        path = Path(configured).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise BinaryError(
                f"llama_server: {path} is not an executable file "
                "(fix: correct the path in config.yaml, or remove it to build one)"
            )
        return LlamaServerBinary(path.resolve(), binary_version(path), "config")
    on_path = shutil.which("llama-server")
    if on_path:
        return LlamaServerBinary(Path(on_path).resolve(), binary_version(Path(on_path)), "path")
    return cached_llama_server(gpu_variant(gpu))


def _source_candidates(cache: Path, version: str) -> list[Path]:
    name = f"llama_cpp_python-{version}"
    # the second location is the version-independent ~/.cache/kvroute/src, where a
    # hand-extracted sdist may already sit
    return [cache / "src" / name, cache.parent / "src" / name]


def find_llama_cpp_source() -> Path | None:
    """The pinned sdist's root if it is extracted already (nothing is downloaded)."""
    for cand in _source_candidates(cache_dir(), llama_cpp_python_version()):
        if (cand / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
            return cand
    return None


def llama_cpp_source(progress: Progress = _print) -> Path:
    """The pinned sdist's root (contains vendor/llama.cpp); downloaded from PyPI if missing."""
    found = find_llama_cpp_source()
    if found is not None:
        return found
    cache, version = cache_dir(), llama_cpp_python_version()
    src = cache / "src"
    src.mkdir(parents=True, exist_ok=True)
    tarball = src / f"llama_cpp_python-{version}.tar.gz"
    if not tarball.is_file():
        progress(f"==> downloading the llama-cpp-python {version} sdist from PyPI")
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            f"llama-cpp-python=={version}", "-d", str(src),
        ]
        if subprocess.run(cmd, check=False).returncode != 0 or not tarball.is_file():
            raise BinaryError(
                f"could not download llama-cpp-python=={version} sdist "
                "(fix: check network access to PyPI, or set llama_server in config.yaml)"
            )
    progress(f"==> extracting {tarball.name}")
    with tarfile.open(tarball) as tar:
        tar.extractall(src, filter="data")
    root = src / f"llama_cpp_python-{version}"
    if not (root / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
        raise BinaryError(f"{tarball} has no vendor/llama.cpp (fix: delete {src} and retry)")
    return root


def _run_streamed(cmd: list[str], progress: Progress, log: Path) -> None:
    """Run a build step, echoing cmake's `[ NN%]` lines so a 4-minute build shows progress,
    and its errors whole (a CMake error's explanation is on the lines after it)."""
    progress("$ " + " ".join(cmd))
    with open(log, "a") as fh, subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        assert proc.stdout is not None
        in_error = False
        for line in proc.stdout:
            fh.write(line)
            in_error = line.startswith("CMake Error") or (in_error and line[:1] in " \n")
            if in_error or line.startswith("[") or "Error" in line or "error:" in line:
                progress("   " + line.rstrip())
        if proc.wait() != 0:
            raise BinaryError(f"build step failed: {' '.join(cmd)} (full log: {log})")


# what a GPU configure step that fails on a machine with the compiler most often lacks
_GPU_HINTS = {
    "cuda": "a CUDA build needs the whole toolkit (nvcc, cudart and cuBLAS: CMake's error "
            "above names what it did not find); on a machine without the GPU, set "
            "CUDAARCHS to the GPUs' compute capabilities, e.g. CUDAARCHS=86",
    "vulkan": "a Vulkan build needs the Vulkan headers and loader (libvulkan-dev), glslc "
              "and spirv-headers: CMake's error above names what it did not find",
}


def _patchable_source(progress: Progress) -> Path:
    """vendor/llama.cpp of the pinned sdist, extracted anew from its tarball when it holds
    another patch set than this kvroute's (a patch changed or dropped since)."""
    source = llama_cpp_source(progress) / "vendor" / "llama.cpp"
    root = source.parent.parent
    tarball = root.with_name(f"{root.name}.tar.gz")
    if applied(source) not in (None, patches_digest()) and tarball.is_file():
        progress("==> the llama.cpp tree holds other patches: extracting it anew")
        shutil.rmtree(root)
        source = llama_cpp_source(progress) / "vendor" / "llama.cpp"
    return source


def _configure(build: Path, gpu: str, progress: Progress, log: Path) -> None:
    """Configure ``gpu``'s build tree unless it is configured with the same command."""
    compiler = find_toolchain(gpu)
    if gpu != "cpu" and compiler is None:
        raise BinaryError(missing_toolchain(gpu))  # before any download: fail at once
    headers = vulkan_headers_problem() if gpu == "vulkan" else None
    if headers and not os.environ.get("VULKAN_SDK"):
        # the system's are too old: newer ones from the Debian archive (vulkan_sdk.py)
        progress(f"==> {headers.split(' (fix')[0]}: fetching {SUITE}'s into the cache")
        try:
            os.environ["VULKAN_SDK"] = str(debian_sdk(cache_dir()))
        except NoSdk as e:
            raise BinaryError(f"a vulkan build of llama-server (GPU=vulkan): {headers}; "
                              f"and newer ones could not be had: {e}") from e
        headers = vulkan_headers_problem()
    if headers:
        raise BinaryError(f"a vulkan build of llama-server (GPU=vulkan): {headers}")
    source = _patchable_source(progress)
    try:
        apply_all(source, progress)
    except PatchError as e:
        raise BinaryError(str(e)) from e
    cmd = cmake_configure_command(source, build, gpu, compiler, os.environ.get("CUDAARCHS"))
    # cmake leaves a cache and even Makefiles behind when configuring fails: only this
    # stamp, written after it succeeds, says the tree is usable
    stamp = build / ".kvroute-configured"
    configured = " ".join([*cmd, _native_cpu()])
    if stamp.is_file() and stamp.read_text() == configured:
        progress(f"==> building llama-server ({gpu}) in {build} (incremental)")
        return
    if stamp.is_file():
        # another CPU (or flags): -march=native objects are stale though no file changed
        progress(f"==> {build} was built for another CPU or other flags: building anew")
        shutil.rmtree(build)
    progress(f"==> building llama-server ({gpu}{'' if portable() else ', native'}) from "
             f"{source} (on 2 cores: about {8 if portable() else 4} min for cpu, longer "
             "with a GPU backend)")
    try:
        _run_streamed(cmd, progress, log)
    except BinaryError as e:
        raise BinaryError(f"{e}; {_GPU_HINTS[gpu]}" if gpu in _GPU_HINTS else str(e)) from e
    stamp.write_text(configured)


def _install(built: Path, bin_dir: Path) -> None:
    """llama-server and the libraries it loads from beside itself into ``bin_dir``, swapped
    in whole: no library of an earlier build stays to be loaded (ggml loads every CPU
    variant it finds there), and a reader never sees half a binary."""
    fresh, old = bin_dir.with_name(bin_dir.name + ".new"), bin_dir.with_name(bin_dir.name + ".old")
    for d in (fresh, old):
        shutil.rmtree(d, ignore_errors=True)
    fresh.mkdir(parents=True)
    for src in [*sorted(built.glob("*.so*")), built / "llama-server"]:
        shutil.copy2(src, fresh / src.name, follow_symlinks=False)  # version links stay links
    if bin_dir.exists():
        os.replace(bin_dir, old)
    os.replace(fresh, bin_dir)
    shutil.rmtree(old, ignore_errors=True)


def build_llama_server(progress: Progress = _print, jobs: int | None = None,
                       gpu: str = "cpu") -> LlamaServerBinary:
    """Build ``gpu``'s variant of llama-server from the pinned sdist with cmake, in its own
    build tree (incremental once configured)."""
    if not shutil.which("cmake"):
        raise BinaryError(
            "cmake not found (fix: install cmake and a C++ compiler, "
            "or set llama_server in config.yaml to an existing binary)"
        )
    cache = cache_dir()
    build = build_dir(cache, gpu)
    log = cache / f"{build.name}.log"
    _configure(build, gpu, progress, log)
    _run_streamed(
        ["cmake", "--build", str(build), "--target", "llama-server",
         "-j", str(jobs or max(1, os.cpu_count() or 1))],
        progress, log,
    )
    dest = binary_path(cache, gpu)
    _install(build / "bin", dest.parent)
    version = binary_version(dest)
    version_stamp(cache, gpu).write_text(version + "\n")
    recipe_stamp(cache, gpu).write_text(build_recipe(gpu))
    return LlamaServerBinary(dest, version, "built")


def ensure_llama_server(
    configured: str | Path | None = None, progress: Progress = _print,
    gpu: str | None = None,
) -> LlamaServerBinary:
    """Find llama-server, or build ``gpu``'s variant (default: $KVROUTE_GPU, else cpu)."""
    gpu = gpu_variant(gpu)
    found = find_llama_server(configured, gpu)
    if found is not None:
        return found
    with cache_lock():
        found = find_llama_server(configured, gpu)  # another process may have built it
        return found if found is not None else build_llama_server(progress, gpu=gpu)
