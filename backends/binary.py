"""Find or build llama-server, and locate the cache that holds built artifacts.

Lookup order: the binary named in config, else `llama-server` on PATH, else
the one built from the llama.cpp tree vendored in the pinned llama-cpp-python sdist, so
the server and the proxy's tokenizer come from the same llama.cpp version.

Cache layout (`KVROUTE_CACHE` overrides the whole directory):

    ~/.cache/kvroute/<llama-cpp-python version>/
        src/llama_cpp_python-<version>/   extracted sdist (pip download --no-binary)
        build/                            cmake build tree
        bin/llama-server                  the built binary, copied out of build/
        llama-server.version              `llama-server --version` of that binary
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

# NOTE: used only when llama-cpp-python is not installed (e.g. doctor in a broken venv);
# must match the pin in pyproject.toml.
PINNED_LLAMA_CPP_PYTHON = "0.3.36"

CMAKE_FLAGS = (
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    # one static binary: nothing to find at run time, safe to copy out of build/
    "-DBUILD_SHARED_LIBS=OFF",
    "-DCMAKE_BUILD_TYPE=Release",
)

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


def cached_binary_path(cache: Path | None = None) -> Path:
    return (cache or cache_dir()) / "bin" / "llama-server"


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


def find_llama_server(configured: str | Path | None = None) -> LlamaServerBinary | None:
    """Resolve without building. Returns None when nothing usable is found."""
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
    cached = cached_binary_path()
    if cached.is_file() and os.access(cached, os.X_OK):
        stamp = cached.parent.parent / "llama-server.version"
        version = stamp.read_text().strip() if stamp.is_file() else binary_version(cached)
        return LlamaServerBinary(cached, version, "cache")
    return None


def _source_candidates(cache: Path, version: str) -> list[Path]:
    name = f"llama_cpp_python-{version}"
    # the second location is the version-independent ~/.cache/kvroute/src, where a
    # hand-extracted sdist may already sit
    return [cache / "src" / name, cache.parent / "src" / name]


def llama_cpp_source(progress: Progress = _print) -> Path:
    """The pinned sdist's root (contains vendor/llama.cpp); downloaded from PyPI if missing."""
    cache, version = cache_dir(), llama_cpp_python_version()
    for cand in _source_candidates(cache, version):
        if (cand / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
            return cand
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
    """Run a build step, echoing cmake's `[ NN%]` lines so a 4-minute build shows progress."""
    progress("$ " + " ".join(cmd))
    with open(log, "a") as fh, subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            fh.write(line)
            if line.startswith("[") or "Error" in line or "error:" in line:
                progress("   " + line.rstrip())
        if proc.wait() != 0:
            raise BinaryError(f"build step failed: {' '.join(cmd)} (full log: {log})")


def build_llama_server(progress: Progress = _print, jobs: int | None = None) -> LlamaServerBinary:
    """Build llama-server from the pinned sdist with cmake; incremental if build/ exists."""
    if not shutil.which("cmake"):
        raise BinaryError(
            "cmake not found (fix: install cmake and a C++ compiler, "
            "or set llama_server in config.yaml to an existing binary)"
        )
    cache = cache_dir()
    build = cache / "build"
    log = cache / "build.log"
    jobs = jobs or max(1, os.cpu_count() or 1)
    if not (build / "CMakeCache.txt").is_file():
        source = llama_cpp_source(progress) / "vendor" / "llama.cpp"
        progress(f"==> building llama-server from {source} (about 4 min on 2 cores)")
        _run_streamed(["cmake", "-S", str(source), "-B", str(build), *CMAKE_FLAGS], progress, log)
    else:
        # an existing tree remembers its own source dir; re-running configure with a
        # different -S would fail, so only build
        progress(f"==> building llama-server in {build} (incremental)")
    _run_streamed(
        ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)],
        progress, log,
    )
    built = build / "bin" / "llama-server"
    dest = cached_binary_path(cache)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".tmp")
    shutil.copy2(built, tmp)
    os.replace(tmp, dest)  # atomic: a concurrent reader never sees half a binary
    version = binary_version(dest)
    (cache / "llama-server.version").write_text(version + "\n")
    return LlamaServerBinary(dest, version, "built")


def ensure_llama_server(
    configured: str | Path | None = None, progress: Progress = _print
) -> LlamaServerBinary:
    found = find_llama_server(configured)
    if found is not None:
        return found
    with cache_lock():
        found = find_llama_server(configured)  # another process may have built it meanwhile
        return found if found is not None else build_llama_server(progress)
