"""The fixes to the vendored llama.cpp (backends/patches/, backends/vendor_patch.py).

ggml's AMX matmul file compiles to nothing unless the compiler targets AMX, and a native
build targets it only on a CPU that has it. So the patched file is compiled here for an
AMX target whatever this CPU is, and tests/backends/amx_mul_mat.cpp runs the kernels that
need only AVX-512 (the F16 ones that crashed llama-server on hybrid models, and the
quantized one-row ones) against a float reference; the multi-row quantized kernels too
where the CPU has AMX. The unpatched file, built the same way, must fail the same run.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from backends import vendor_patch
from backends.binary import cache_dir, find_llama_cpp_source
from backends.cpu import cpu_flags
from backends.gpu import binary_path

HARNESS = Path(__file__).with_name("amx_mul_mat.cpp")
AMX_PATCH = vendor_patch.PATCH_DIR / "ggml-amx-batched-mul-mat.patch"
# what the AVX-512 paths of the AMX file execute; the compiler is told to target AMX too
AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni")
TARGET = ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl",
          "-mavx512dq", "-mavx512vnni", "-mamx-tile", "-mamx-int8")


@pytest.fixture(scope="module")
def tree(llama_server_bin: Path) -> Path:
    assert binary_path(cache_dir(), "cpu").with_name("libggml-base.so").is_file(), \
        "the cpu build's libraries"
    src = find_llama_cpp_source()
    assert src is not None, "the pinned sdist is extracted when llama-server is built"
    return src / "vendor" / "llama.cpp"


def _build_harness(tree: Path, amx_dir: Path, out: Path) -> Path:
    # ggml-base (tensors, quantization) from the cpu build llama-server is
    libs = binary_path(cache_dir(), "cpu").parent
    ggml = tree / "ggml"
    cmd = ["g++", "-std=c++17", "-O2", "-fopenmp", *TARGET, "-o", str(out),
           str(HARNESS), str(amx_dir / "mmq.cpp"),
           f"-I{amx_dir.parent.parent}", f"-I{ggml / 'include'}", f"-I{ggml / 'src'}",
           f"-I{ggml / 'src' / 'ggml-cpu'}", f"-L{libs}", "-lggml-base",
           f"-Wl,-rpath,{libs}", "-lpthread", "-lm"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=240)
    return out


def _run(harness: Path) -> subprocess.CompletedProcess[str]:
    amx = {"amx_tile", "amx_int8"} <= cpu_flags()
    return subprocess.run([str(harness), *(["amx"] if amx else [])], capture_output=True,
                          text=True, timeout=120, check=False)


needs_avx512 = pytest.mark.skipif(
    not set(AVX512) <= cpu_flags(),
    reason="the AMX file's kernels need AVX-512 (F, BW, VL, DQ, VNNI) to run; "
           "this CPU lacks " + ", ".join(sorted(set(AVX512) - cpu_flags())))


def test_the_tree_llama_server_is_built_from_holds_every_patch(tree: Path) -> None:
    assert vendor_patch.patches(), "no patch found: PATCH_DIR moved?"
    for patch in vendor_patch.patches():
        assert vendor_patch.is_applied(tree, patch), patch.name


@needs_avx512
def test_batched_amx_matmul_matches_the_reference(tree: Path, tmp_path: Path) -> None:
    harness = _build_harness(tree, tree / "ggml" / "src" / "ggml-cpu" / "amx",
                             tmp_path / "amx_mul_mat")
    run = _run(harness)
    assert run.returncode == 0, run.stdout + run.stderr
    # batches beyond the first were the ones read and written out of bounds
    assert "batch=5" in run.stdout and run.stdout.splitlines()[-1].startswith("0 failed")


@needs_avx512
def test_the_unpatched_amx_matmul_fails_the_same_run(tree: Path, tmp_path: Path) -> None:
    amx = tmp_path / "ggml" / "src" / "ggml-cpu" / "amx"
    shutil.copytree(tree / "ggml" / "src" / "ggml-cpu" / "amx", amx)
    subprocess.run(["git", "apply", "--reverse", "--include=ggml/src/ggml-cpu/amx/*",
                    str(AMX_PATCH)], cwd=tmp_path, check=True, capture_output=True)
    run = _run(_build_harness(tree, amx, tmp_path / "amx_mul_mat"))
    assert run.returncode != 0  # a segfault (-11) or cases that FAIL
    assert run.returncode < 0 or "FAIL" in run.stdout


def _pristine_copy(tree: Path, dest: Path) -> Path:
    amx = dest / "ggml" / "src" / "ggml-cpu" / "amx"
    shutil.copytree(tree / "ggml" / "src" / "ggml-cpu" / "amx", amx)
    subprocess.run(["git", "apply", "--reverse", str(AMX_PATCH)], cwd=dest, check=True,
                   capture_output=True)
    return dest


def test_patches_apply_once(tree: Path, tmp_path: Path) -> None:
    copy = _pristine_copy(tree, tmp_path)
    assert not vendor_patch.is_applied(copy, AMX_PATCH)
    said: list[str] = []
    vendor_patch.apply_all(copy, said.append)
    assert vendor_patch.is_applied(copy, AMX_PATCH) and len(said) == 1
    assert vendor_patch.applied(copy) == vendor_patch.digest()  # the set it holds
    vendor_patch.apply_all(copy, said.append)  # already there: nothing to do
    assert len(said) == 1


def test_a_tree_the_patch_does_not_fit_is_refused_with_the_fix(tmp_path: Path) -> None:
    amx = tmp_path / "ggml" / "src" / "ggml-cpu" / "amx"
    amx.mkdir(parents=True)
    (amx / "amx.cpp").write_text("not the pinned file\n")
    (amx / "mmq.cpp").write_text("not the pinned file\n")
    with pytest.raises(vendor_patch.PatchError, match="fix: delete"):
        vendor_patch.apply_all(tmp_path, print)
