"""A backend's memory from its GGUF and command line (backends/memory.py), against what
the pinned llama-server reports for the demo models: its RAM entries' sizes (trace-level
log, `prompt_save` and the cache state) and its sliding-window cache's cells."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from backends.binary import find_llama_server, llama_cpp_source
from backends.demo_model import ensure_demo_model
from backends.memory import (
    CELL_META_BYTES,
    _arg,
    cache_types,
    server_memory,
    swa_cells,
    type_bytes,
)
from backends.process import free_port
from proxy.routing.cache.checkpoints import Memory
from proxy.routing.cache.values import BackendCapacity

MiB = 1 << 20


@pytest.mark.parametrize("kind, name, n, checkpoints, state_mib, entry_mib", [
    # "saving prompt with length 2629, total state size = 6.668 MiB";
    # "prompt ...: 2629 tokens, checkpoints: 4, 12.680 MiB"
    ("demo-swa", "swa", 2629, 4, 6.668, 12.680),
    # "saving prompt with length 2003, total state size = 3.959 MiB";
    # "prompt ...: 2003 tokens, checkpoints: 2, 4.006 MiB"
    ("demo-hybrid", "hybrid", 2003, 2, 3.959, 4.006),
])
def test_ram_entries_are_sized_as_the_server_sizes_them(
        kind: str, name: str, n: int, checkpoints: int, state_mib: float,
        entry_mib: float) -> None:
    m = server_memory(ensure_demo_model(kind=kind), [], 4096, 2)
    assert m.name == name
    assert m.kv_bytes_per_token is not None
    cap = BackendCapacity("b", 2, 4096, 64 * MiB, m.kv_bytes_per_token,
                          memory=Memory(n_swa=m.n_swa, recurrent=m.recurrent,
                                        swa_cells=m.swa_cells,
                                        partial_bytes=m.partial_bytes))
    assert cap.entry_bytes(n) / MiB == pytest.approx(state_mib, abs=0.001)
    assert cap.entry_bytes(n, checkpoints) / MiB == pytest.approx(entry_mib, abs=0.001)


def test_the_plain_demo_model_has_no_checkpoints() -> None:
    m = server_memory(ensure_demo_model(), [], 4096, 2)
    assert (m.name, m.partial_bytes, m.swa_cells) == ("dense", 0, 0)


def test_the_command_line_sets_the_checkpoint_rules() -> None:
    swa = ensure_demo_model(kind="demo-swa")
    m = server_memory(swa, ["-ub", "256", "--ctx-checkpoints=4", "-cms", "100"], 4096, 2)
    assert (m.n_ubatch, m.max_checkpoints, m.min_step, m.swa_cells) == (256, 4, 100, 512)
    assert server_memory(swa, ["--swa-full"], 4096, 2).name == "dense"
    # start-up log: "creating SWA KV cache, size = 768 cells" (1 slot, ubatch 512)
    assert server_memory(swa, [], 8192, 1).swa_cells == 768


@pytest.mark.parametrize("n_swa, ubatch, ctx, seqs, cells", [
    (256, 512, 8192, 1, 768), (256, 512, 8192, 2, 1024), (1024, 512, 8192, 1, 1536),
    (4096, 512, 2048, 1, 2048), (0, 512, 8192, 1, 0), (100, 100, 8192, 1, 256),
])
def test_swa_cells(n_swa: int, ubatch: int, ctx: int, seqs: int, cells: int) -> None:
    assert swa_cells(n_swa, ubatch, ctx, seqs) == cells


@pytest.mark.parametrize("args, value", [
    ([], 7), (["-b", "9"], 9), (["--batch-size=11"], 11), (["-b", "x"], 7),
    (["-b"], 7), (["-b", "3", "-b", "5"], 5),
])
def test_arguments(args: list[str], value: int) -> None:
    assert _arg(args, ("-b", "--batch-size"), 7) == value


# -- KV cache types -----------------------------------------------------------------------
# Real models' shapes, from the GGUFs (vocabulary and hyperparameters, no weights) that
# the vendored llama.cpp tree ships: per token, K and V are layers x KV heads x head size
# values each, stored as the cache type says (q8_0: 34 bytes per 32 values, q4_0: 18,
# f16: 2 per value).
LLAMA3_8B = "ggml-vocab-llama-bpe.gguf"  # 32 layers, 8 KV heads of 128 (GQA, 32 heads)
FALCON_7B = "ggml-vocab-falcon.gguf"  # 32 layers, 1 KV head of 64 (MQA, 71 heads)
STARCODER2 = "ggml-vocab-starcoder.gguf"  # 30 layers, 2 KV heads of 128 (GQA, 24 heads)


@pytest.mark.parametrize("model, args, kv_bytes", [
    (LLAMA3_8B, [], 131072),  # 2 x 32768 values x 2 bytes
    (LLAMA3_8B, ["-ctk", "f16", "-ctv", "f16"], 131072),
    (LLAMA3_8B, ["-ctk", "q8_0", "-ctv", "q8_0"], 69632),  # 2 x 32768 / 32 x 34
    (LLAMA3_8B, ["-ctk", "q4_0", "-ctv", "q4_0"], 36864),  # 2 x 32768 / 32 x 18
    (LLAMA3_8B, ["--cache-type-k=q8_0"], 100352),  # 34816 + 65536
    (LLAMA3_8B, ["-ctk", "q5_1", "-ctv", "q5_0"], 47104),  # 1024 x 24 + 1024 x 22
    (LLAMA3_8B, ["-ctk", "iq4_nl", "-ctv", "q4_1"], 38912),  # 1024 x 18 + 1024 x 20
    (LLAMA3_8B, ["-ctk", "f32", "-ctv", "bf16"], 196608),  # 32768 x 4 + 32768 x 2
    (LLAMA3_8B, ["-ctk", "q8_0", "-ctk", "q4_0"], 83968),  # the last one counts
    (LLAMA3_8B, ["-ctk", "q3_k"], 131072),  # not a cache type: the server refuses it
    (FALCON_7B, [], 8192),  # 2 x 2048 values x 2
    (FALCON_7B, ["-ctk", "q8_0", "-ctv", "q8_0"], 4352),  # 2 x 64 blocks x 34
    (STARCODER2, ["-ctk", "q4_0", "-ctv", "q8_0"], 12480),  # 240 x 18 + 240 x 34
])
def test_kv_bytes_per_token_follow_the_cache_types(
        model: str, args: list[str], kv_bytes: int) -> None:
    gguf = llama_cpp_source() / "vendor" / "llama.cpp" / "models" / model
    assert server_memory(gguf, args, 4096, 2).kv_bytes_per_token == kv_bytes


@pytest.mark.parametrize("args, types", [
    ([], ("f16", "f16")), (["-ctk", "q8_0"], ("q8_0", "f16")),
    (["--cache-type-v", "q4_0", "-ctk=bf16"], ("bf16", "q4_0")),
    (["-ctv", "nope"], ("f16", "f16")),
])
def test_cache_types(args: list[str], types: tuple[str, str]) -> None:
    assert cache_types(args) == types


@pytest.mark.parametrize("cache_type, values, size", [
    ("f32", 64, 256), ("f16", 64, 128), ("bf16", 64, 128), ("q8_0", 64, 68),
    ("q4_0", 64, 36), ("q4_1", 64, 40), ("q5_0", 64, 44), ("q5_1", 64, 48),
    ("iq4_nl", 64, 36),
])
def test_type_bytes(cache_type: str, values: int, size: int) -> None:
    assert type_bytes(values, cache_type) == size


def test_a_sliding_window_cache_shrinks_with_its_types_too() -> None:
    swa = ensure_demo_model(kind="demo-swa")
    f16 = server_memory(swa, [], 4096, 2)
    q8 = server_memory(swa, ["-ctk", "q8_0", "-ctv", "q8_0"], 4096, 2)
    assert q8.kv_bytes_per_token == f16.kv_bytes_per_token * 17 // 32  # 34 / 64 bytes
    cell = CELL_META_BYTES
    assert (q8.partial_bytes // q8.n_swa - cell) * 32 == (f16.partial_bytes // f16.n_swa
                                                          - cell) * 17


def _server_kv_cache_log(model: Path, args: list[str], cells: int) -> list[str]:
    """The `llama_kv_cache: size = ...` lines of a real llama-server started on ``model``
    (one per cache: a sliding-window model has two, the full-attention one first)."""
    binary = find_llama_server()
    assert binary is not None
    cmd = [str(binary.path), "-m", str(model), "-c", str(cells), "-np", "1", "-t", "1",
           "--port", str(free_port()), "-lv", "4", *args]
    lines: list[str] = []
    with subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                          text=True) as proc:
        assert proc.stderr is not None
        try:
            for line in proc.stderr:
                if "llama_kv_cache: size =" in line:
                    lines.append(line)
                if "listening on" in line or "error" in line.lower():
                    break
        finally:
            proc.kill()
    return lines


@pytest.mark.parametrize("kind, args", [
    ("demo", ["-ctk", "q8_0", "-ctv", "q4_0", "-fa", "on"]),
    ("demo", ["-ctk", "q5_1", "-ctv", "iq4_nl", "-fa", "on"]),
    ("demo", ["-ctk", "bf16"]),
    ("demo-swa", ["-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"]),
])
def test_the_server_allocates_what_is_modelled(kind: str, args: list[str]) -> None:
    """llama-server's own account: `size = 8.50 MiB (4096 cells, ...), K (q8_0): 4.25
    MiB, V (q8_0): 4.25 MiB`."""
    model = ensure_demo_model(kind=kind)
    lines = _server_kv_cache_log(model, args, 4096)
    assert lines, "no llama_kv_cache line in the server's log"
    m = re.search(r"size = +([\d.]+) MiB \( *(\d+) cells", lines[0])
    assert m is not None and int(m.group(2)) == 4096
    modelled = server_memory(model, args, 4096, 1).kv_bytes_per_token
    assert modelled is not None
    assert float(m.group(1)) == pytest.approx(modelled * 4096 / MiB, abs=0.006)
