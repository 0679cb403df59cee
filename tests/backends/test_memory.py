"""A backend's memory from its GGUF and command line (backends/memory.py), against what
the pinned llama-server reports for the demo models: its RAM entries' sizes (trace-level
log, `prompt_save` and the cache state) and its sliding-window cache's cells."""

from __future__ import annotations

import pytest

from backends.demo_model import ensure_demo_model
from backends.memory import _arg, server_memory, swa_cells
from proxy.routing.cache.checkpoints import Memory
from proxy.routing.cache.predict import BackendCapacity

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
