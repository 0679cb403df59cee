"""What a backend's memory lets llama-server reuse: plain attention, a sliding window, or
recurrent layers, and the server's context-checkpoint settings.

``/props`` names neither, so they come from the model's GGUF metadata and the server's
command line (defaults of the pinned build otherwise). docs/checkpoints.md says what each
changes; proxy/routing/cache/checkpoints.py applies it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from backends.demo_model import read_gguf_metadata

# Metadata that only models with recurrent (or short-convolution) layers carry: Mamba,
# Jamba, Falcon-H1, Granite 4, Nemotron-H, Qwen3-Next (".ssm."), LFM2 (".shortconv."),
# RWKV (".wkv.").
_RECURRENT_KEYS = (".ssm.", ".shortconv.", ".wkv.")


@dataclass(frozen=True)
class MemoryKind:
    """A backend's memory as the server's cache rules see it."""

    n_swa: int = 0  # the sliding window the server applies (0: none, or --swa-full)
    recurrent: bool = False
    swa_cells: int = 0  # cells of the sliding-window cache per sequence
    max_checkpoints: int = 32  # --ctx-checkpoints
    min_step: int = 8192  # --checkpoint-min-step
    n_ubatch: int = 512  # -ub
    n_batch: int = 2048  # -b

    @property
    def name(self) -> str:
        return "hybrid" if self.recurrent else ("swa" if self.n_swa else "dense")


DENSE = MemoryKind()


def gguf_memory(path: Path) -> tuple[int, bool]:
    """(sliding window, has recurrent layers) from a GGUF's metadata."""
    meta = read_gguf_metadata(path)
    arch = meta.get("general.architecture")
    window = meta.get(f"{arch}.attention.sliding_window", 0)
    n_swa = int(window) if isinstance(window, int | float) else 0
    recurrent = any(k.startswith(f"{arch}.") and any(m in k for m in _RECURRENT_KEYS)
                    for k in meta)
    heads_key = f"{arch}.attention.head_count_kv"
    if not recurrent and heads_key not in meta:  # an array (skipped unless asked)
        heads = read_gguf_metadata(path, arrays=True).get(heads_key)
        # hybrids list a KV head count per layer, 0 where the layer is recurrent
        recurrent = isinstance(heads, list) and 0 in heads
    return n_swa, recurrent


def _arg(args: Sequence[str], names: tuple[str, ...], default: int) -> int:
    """The value of the last of ``names`` on a llama-server command line."""
    value = default
    for i, a in enumerate(args):
        key, eq, inline = a.partition("=")
        if key in names:
            raw = inline if eq else (args[i + 1] if i + 1 < len(args) else "")
            # (not a number: the server refuses to start, nothing to model)
            with contextlib.suppress(ValueError):
                value = int(raw)
    return value


def swa_cells(n_swa: int, n_ubatch: int, slot_ctx: int, n_sequences: int = 1) -> int:
    """Cells of a sliding-window cache stream shared by ``n_sequences`` (all slots with a
    unified KV cache, else one): the window of each, plus a micro-batch, padded to 256
    cells, never more than the full cache (llama-kv-cache-iswa.cpp)."""
    if not n_swa:
        return 0
    cells = -(-(n_swa * n_sequences + n_ubatch) // 256) * 256
    return min(slot_ctx * n_sequences, cells)


def server_memory(model: Path | None, args: Sequence[str], slot_ctx: int,
                  n_slots: int) -> MemoryKind:
    """The memory kind of a server of ``model`` started with ``args`` (the model unknown:
    plain attention)."""
    if model is None:
        return DENSE
    n_swa, recurrent = gguf_memory(model)
    if "--swa-full" in args:
        n_swa = 0
    n_ubatch = _arg(args, ("-ub", "--ubatch-size"), 512)
    n_batch = _arg(args, ("-b", "--batch-size"), 2048)
    n_ubatch = min(n_ubatch, n_batch)
    unified = any(a in ("-kvu", "--kv-unified") for a in args)
    return MemoryKind(
        n_swa=n_swa, recurrent=recurrent,
        swa_cells=swa_cells(n_swa, n_ubatch, slot_ctx, n_slots if unified else 1),
        max_checkpoints=_arg(args, ("-ctxcp", "--ctx-checkpoints", "--swa-checkpoints"), 32),
        min_step=_arg(args, ("-cms", "--checkpoint-min-step"), 8192),
        n_ubatch=n_ubatch, n_batch=n_batch,
    )
