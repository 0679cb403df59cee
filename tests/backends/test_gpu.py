"""llama-server's GPU builds (backends/gpu.py, binary.py). No GPU here: the switch is
checked by the cmake command line it produces, by where each variant lives in the cache,
and by the error a build gives when its toolchain is missing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from backends.binary import (
    BinaryError,
    _install,
    build_recipe,
    ensure_llama_server,
    find_llama_server,
    gpu_variant,
    llama_cpp_source,
)
from backends.cpu import build_report, kernel_features
from backends.gpu import (
    CMAKE_FLAGS,
    NATIVE_ENV,
    PORTABLE_FLAGS,
    VULKAN_HEADER_NEEDS,
    binary_path,
    build_dir,
    cmake_configure_command,
    find_toolchain,
    missing_toolchain,
    recipe_stamp,
    version_stamp,
    vulkan_headers_problem,
)

SRC, BUILD = Path("/src/llama.cpp"), Path("/cache/build-x")


@pytest.mark.parametrize("gpu, compiler, archs, added", [
    ("cpu", None, None, []),
    ("cpu", None, "86", []),  # CUDAARCHS means nothing to a CPU build
    ("cuda", None, None, ["-DGGML_CUDA=ON"]),
    ("cuda", "/usr/local/cuda/bin/nvcc", None,
     ["-DGGML_CUDA=ON", "-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc"]),
    ("cuda", "/opt/cuda/bin/nvcc", "86;89",
     ["-DGGML_CUDA=ON", "-DCMAKE_CUDA_COMPILER=/opt/cuda/bin/nvcc",
      "-DCMAKE_CUDA_ARCHITECTURES=86;89"]),
    ("vulkan", None, None, ["-DGGML_VULKAN=ON"]),
    ("vulkan", "/usr/bin/glslc", "86",
     ["-DGGML_VULKAN=ON", "-DVulkan_GLSLC_EXECUTABLE=/usr/bin/glslc"]),
])
def test_cmake_configure_command(gpu: str, compiler: str | None, archs: str | None,
                                 added: list[str]) -> None:
    cmd = cmake_configure_command(SRC, BUILD, gpu, compiler, archs)
    assert cmd == ["cmake", "-S", str(SRC), "-B", str(BUILD), *CMAKE_FLAGS,
                   *PORTABLE_FLAGS, *added]


def test_the_shared_flags_build_a_release_server_with_its_libraries_beside_it() -> None:
    assert {"-DLLAMA_BUILD_SERVER=ON", "-DBUILD_SHARED_LIBS=ON", "-DCMAKE_INSTALL_RPATH=$ORIGIN",
            "-DCMAKE_BUILD_TYPE=Release"} <= set(CMAKE_FLAGS)
    assert not any("GGML_CUDA" in f or "GGML_VULKAN" in f for f in CMAKE_FLAGS)


@pytest.mark.parametrize("gpu, native, build, binary, stamp", [
    ("cpu", False, "build-cpu", "bin-cpu/llama-server", "llama-server-cpu.version"),
    ("cpu", True, "build-cpu-native", "bin-cpu-native/llama-server",
     "llama-server-cpu-native.version"),
    ("cuda", False, "build-cuda", "bin-cuda/llama-server", "llama-server-cuda.version"),
    ("vulkan", True, "build-vulkan-native", "bin-vulkan-native/llama-server",
     "llama-server-vulkan-native.version"),
])
def test_each_variant_has_its_own_place(gpu: str, native: bool, build: str, binary: str,
                                        stamp: str, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = Path("/c")
    monkeypatch.setenv(NATIVE_ENV, "1" if native else "")
    assert (build_dir(cache, gpu), binary_path(cache, gpu), version_stamp(cache, gpu)) == (
        cache / build, cache / binary, cache / stamp)


@pytest.mark.parametrize("value, env, gpu", [
    (None, None, "cpu"), (None, "", "cpu"), ("", "cuda", "cpu"), (None, "vulkan", "vulkan"),
    ("CUDA", None, "cuda"), (" vulkan ", "cuda", "vulkan"), ("cpu", "cuda", "cpu"),
])
def test_gpu_variant(value: str | None, env: str | None, gpu: str,
                     monkeypatch: pytest.MonkeyPatch) -> None:
    if env is None:
        monkeypatch.delenv("KVROUTE_GPU", raising=False)
    else:
        monkeypatch.setenv("KVROUTE_GPU", env)
    assert gpu_variant(value) == gpu


def test_an_unknown_variant_is_refused() -> None:
    with pytest.raises(BinaryError, match=r"'rocm'.*one of cpu, cuda, vulkan"):
        gpu_variant("rocm")


def _executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


def test_toolchains_are_found_where_their_builds_look(tmp_path: Path) -> None:
    on_path = _executable(tmp_path / "bin" / "nvcc")
    in_root = _executable(tmp_path / "cuda" / "bin" / "nvcc")
    glslc = _executable(tmp_path / "sdk" / "bin" / "glslc")
    empty = str(tmp_path / "empty")
    assert find_toolchain("cuda", env={"PATH": str(on_path.parent)}, cuda_roots=()) == str(
        on_path)
    assert find_toolchain("cuda", env={"PATH": empty, "CUDACXX": str(in_root)},
                          cuda_roots=()) == str(in_root)
    assert find_toolchain("cuda", env={"PATH": empty, "CUDA_HOME": str(tmp_path / "cuda")},
                          cuda_roots=()) == str(in_root)
    assert find_toolchain("cuda", env={"PATH": empty},
                          cuda_roots=(str(tmp_path / "cuda"),)) == str(in_root)
    assert find_toolchain("vulkan", env={"PATH": empty, "VULKAN_SDK": str(tmp_path / "sdk")}
                          ) == str(glslc)
    assert find_toolchain("cpu", env={"PATH": empty}) is None


def test_a_missing_toolchain_is_none(tmp_path: Path) -> None:
    env = {"PATH": str(tmp_path)}
    assert find_toolchain("cuda", env=env, cuda_roots=(str(tmp_path / "cuda"),)) is None
    assert find_toolchain("vulkan", env=env) is None


@pytest.mark.parametrize("gpu, names", [
    ("cuda", ["nvcc", "CUDA Toolkit", "CUDACXX", "GPU unset"]),
    ("vulkan", ["glslc", "Vulkan SDK", "apt install libvulkan-dev glslc", "GPU unset"]),
])
def test_the_missing_toolchain_message_says_what_to_install(gpu: str,
                                                            names: list[str]) -> None:
    msg = missing_toolchain(gpu)
    assert all(n in msg for n in names), msg


@pytest.fixture
def bare_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache and a PATH with cmake only: no llama-server, nvcc or glslc."""
    bin_dir = tmp_path / "path"
    bin_dir.mkdir()
    cmake = shutil.which("cmake")
    if cmake:
        (bin_dir / "cmake").symlink_to(cmake)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setenv("KVROUTE_CACHE", str(tmp_path / "cache"))
    for var in ("KVROUTE_GPU", "VULKAN_SDK", "CUDACXX"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path / "cache"


def test_a_vulkan_build_without_the_sdk_fails_at_once(bare_machine: Path) -> None:
    if shutil.which("cmake") is None:
        pytest.skip("no cmake")
    with pytest.raises(BinaryError, match="glslc"):
        ensure_llama_server(gpu="vulkan")
    assert not build_dir(bare_machine, "vulkan").exists()  # checked before configuring


def test_prepare_says_what_to_install(bare_machine: Path, tmp_path: Path) -> None:
    """`make run GPU=vulkan` on a machine without the Vulkan SDK."""
    r = subprocess.run([sys.executable, "-m", "backends", "prepare", "--gpu", "vulkan"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert r.returncode == 1
    assert "prepare failed: a vulkan build of llama-server" in r.stderr
    assert "Vulkan SDK" in r.stderr and "glslc" in r.stderr


def test_a_cached_variant_is_found_and_leaves_the_others_alone(bare_machine: Path) -> None:
    cuda = _executable(binary_path(bare_machine, "cuda"))
    version_stamp(bare_machine, "cuda").write_text("version: 0.5.0-dev (build 1, commit "
                                                   "0c1e570)\n")
    recipe_stamp(bare_machine, "cuda").write_text(build_recipe("cuda"))
    found = find_llama_server(gpu="cuda")
    assert found is not None and (found.path, found.source) == (cuda, "cache")
    assert found.version.endswith("commit 0c1e570)")
    assert find_llama_server(gpu="cpu") is None  # the CPU build is another file
    assert ensure_llama_server(gpu="cuda").path == cuda  # cached: nothing is built


@pytest.mark.parametrize("recipe", [
    None,  # built before recipes were recorded
    "cpu=sse4_2,avx,avx2,avx512f,amx_tile,amx_int8",  # on another CPU: SIGILL here
    "patches=0",  # before a fix to the vendored tree
])
def test_a_cached_binary_of_another_recipe_is_rebuilt(bare_machine: Path,
                                                      recipe: str | None) -> None:
    _executable(binary_path(bare_machine, "cpu"))
    stamp = recipe_stamp(bare_machine, "cpu")
    stamp.write_text(build_recipe("cpu"))
    assert find_llama_server(gpu="cpu") is not None
    if recipe is None:
        stamp.unlink()
    else:
        mine = dict(part.split("=", 1) for part in build_recipe("cpu").split()
                    if part.startswith(("cpu=", "patches=")))
        key, value = recipe.split("=", 1)
        assert mine[key] != value
        stamp.write_text(build_recipe("cpu").replace(f"{key}={mine[key]}", recipe))
    assert find_llama_server(gpu="cpu") is None


def _vulkan_header(root: Path, version: int, extensions: str) -> Path:
    header = root / "vulkan" / "vulkan_core.h"
    header.parent.mkdir(parents=True)
    header.write_text(f"#define VK_HEADER_VERSION {version}\n{extensions}\n")
    return header


def test_vulkan_headers_too_old_for_the_tree_are_named(tmp_path: Path) -> None:
    """Debian 12's libvulkan-dev (header version 239) fails to compile ggml-vulkan.cpp
    minutes into the build: this says so before it starts."""
    old = _vulkan_header(tmp_path / "old", 239, "#define VK_EXT_debug_utils 1")
    new = _vulkan_header(tmp_path / "sdk" / "include", 283, f"#define {VULKAN_HEADER_NEEDS} 1")
    problem = vulkan_headers_problem({}, include_dirs=[str(tmp_path / "old")])
    assert problem is not None
    assert all(s in problem for s in (str(old.parent), "239", VULKAN_HEADER_NEEDS,
                                      "Vulkan SDK", "Ubuntu 24.04"))
    # the SDK's headers come first, as they do for CMake once setup-env.sh is sourced
    sdk = {"VULKAN_SDK": str(tmp_path / "sdk")}
    assert vulkan_headers_problem(sdk, include_dirs=[str(tmp_path / "old")]) is None
    assert new.is_file()
    assert vulkan_headers_problem({}, include_dirs=[str(tmp_path / "none")]) is None


def test_the_pinned_tree_uses_what_the_header_check_asks_for() -> None:
    source = llama_cpp_source() / "vendor" / "llama.cpp" / "ggml" / "src" / "ggml-vulkan"
    text = (source / "ggml-vulkan.cpp").read_text(errors="replace")
    assert VULKAN_HEADER_NEEDS in text and "vk::LayerSettingEXT" in text



def test_a_native_build_is_its_own_and_says_for_which_cpu(
        bare_machine: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    portable_bin = binary_path(bare_machine, "cpu")
    report = build_report(build_recipe("cpu"))
    assert report["build"].startswith("portable") and report["matches"] is None
    monkeypatch.setenv(NATIVE_ENV, "1")
    flags = cmake_configure_command(SRC, BUILD, "cpu")
    assert not set(PORTABLE_FLAGS) & set(flags)  # GGML_NATIVE's default: -march=native
    assert binary_path(bare_machine, "cpu").parent != portable_bin.parent
    assert f"cpu={','.join(kernel_features())}" in build_recipe("cpu").split()
    assert build_report(build_recipe("cpu"))["matches"] is True  # built for this CPU


def test_a_build_is_installed_whole_and_alone(tmp_path: Path) -> None:
    """The binary and its libraries swap in together; a library of an earlier build does
    not stay (ggml would load a CPU variant it finds there); version links stay links."""
    built, bin_dir = tmp_path / "build" / "bin", tmp_path / "bin-cpu"
    built.mkdir(parents=True)
    bin_dir.mkdir()
    (bin_dir / "libggml-cpu-old.so").write_text("an earlier build's")
    _executable(built / "llama-server")
    (built / "libllama.so.0").write_text("lib")
    (built / "libllama.so").symlink_to("libllama.so.0")
    (built / "README").write_text("not installed")
    _install(built, bin_dir)
    assert sorted(p.name for p in bin_dir.iterdir()) == [
        "libllama.so", "libllama.so.0", "llama-server"]
    assert (bin_dir / "libllama.so").is_symlink()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("bin-cpu")] == ["bin-cpu"]
