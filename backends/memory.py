"""What a backend's memory lets llama-server reuse: plain attention, a sliding window, or
recurrent layers, and the server's context-checkpoint settings.

``/props`` names neither, so they come from the model's GGUF metadata and the server's
command line (defaults of the pinned build otherwise). docs/checkpoints.md says what
each changes; proxy/routing/cache/checkpoints.py applies it. So do the bytes a token takes
in the cache: each layer's KV heads, in the cache types of -ctk and -ctv.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from backends.demo_model import read_gguf_metadata

# Metadata that only models with recurrent (or short-convolution) layers carry: Mamba,
# Jamba, Falcon-H1, Granite 4, Nemotron-H, Qwen3-Next (".ssm."), LFM2 (".shortconv."),
# RWKV (".wkv.").
_RECURRENT_KEYS = (".ssm.", ".shortconv.", ".wkv.")
# architectures whose rope is M-RoPE or may be (src/llama-model.cpp, llama_model_rope_type)
_MROPE = frozenset({"qwen2vl", "paddleocr", "qwen3vl", "qwen3vlmoe", "qwen35", "qwen35moe",
                    "qwen4exp", "qwen3tts", "glm4", "glm4moe", "hunyuan_vl", "dflash",
                    "bailingmoe3"})
# Which layers slide when the GGUF does not say (src/models/*.cpp load_swa_pattern): of
# every n layers the last attends to everything (the first, where marked).
_SWA_PATTERN = {"gemma2": (2, False), "gemma3": (6, False), "gemma3n": (5, False),
                "gemma-embedding": (6, False), "cohere2": (4, False), "gpt-oss": (2, False),
                "llama4": (4, False), "exaone4": (4, False), "olmo2": (4, False),
                "plamo3": (8, False), "cohere2moe": (4, True), "laguna": (4, True)}
CELL_META_BYTES = 12  # per cached cell: its position, sequence count and id (int32 each)
# The KV cache types llama-server accepts (-ctk, -ctv; common/arg.cpp kv_cache_types) as
# ggml stores them: values per block, bytes per block (ggml-common.h block_*).
KV_CACHE_TYPES = {"f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34),
                  "q4_0": (32, 18), "q4_1": (32, 20), "iq4_nl": (32, 18), "q5_0": (32, 22),
                  "q5_1": (32, 24)}


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
    # Bytes the server keeps of the memory that cannot be cut back, per sequence: the
    # sliding layers' window or the recurrent state. A RAM entry holds it once, plus once
    # per context checkpoint, beside the full-attention KV (llama_state_seq_get_size).
    partial_bytes: int = 0
    # of the full-attention layers, in the server's cache types (None: unknown)
    kv_bytes_per_token: int | None = None

    @property
    def name(self) -> str:
        return "hybrid" if self.recurrent else ("swa" if self.n_swa else "dense")


DENSE = MemoryKind()


@dataclass(frozen=True)
class ModelMemory:
    """What a GGUF says of its memory."""

    n_swa: int = 0
    recurrent: bool = False
    kv_bytes_per_token: int | None = None  # f16 K+V of the full-attention layers
    swa_cell_bytes: int = 0  # f16 K+V of the sliding layers, and the cell's metadata
    recurrent_bytes: int = 0  # the recurrent state of one sequence (f32)
    # K and V values per token of the full-attention layers and per cell of the sliding
    # ones (KV heads x head size, summed over the layers): what the cache types size
    k_values: int = 0
    v_values: int = 0
    k_swa_values: int = 0
    v_swa_values: int = 0
    arch: str = ""  # general.architecture

    @property
    def mrope(self) -> bool:
        """An image takes fewer positions than tokens (M-RoPE): windows and checkpoints,
        counted in positions, fall elsewhere in the tokens than on other models."""
        return self.arch in _MROPE


def gguf_memory(path: Path) -> ModelMemory:
    """The memory of the model in a GGUF, from its metadata (per-layer arrays read only
    when the scalar keys do not tell)."""
    return _gguf_memory(str(path), path.stat().st_mtime_ns)


def gguf_kv_bytes_per_token(path: Path) -> int | None:
    """f16 K+V bytes per token of the layers whose cache grows with the context (None:
    the metadata does not tell)."""
    return gguf_memory(path).kv_bytes_per_token


@lru_cache(maxsize=32)
def _gguf_memory(file: str, mtime_ns: int) -> ModelMemory:
    path = Path(file)
    meta = read_gguf_metadata(path)
    arch = str(meta.get("general.architecture"))
    if f"{arch}.attention.head_count_kv" not in meta or (
            f"{arch}.attention.sliding_window" in meta
            and f"{arch}.attention.sliding_window_pattern" not in meta):
        meta = {**read_gguf_metadata(path, arrays=True), **meta}  # per-layer arrays

    def num(key: str, default: int = 0) -> int:
        value = meta.get(f"{arch}.{key}", default)
        return int(value) if isinstance(value, int | float) else default

    n_layer, n_embd = num("block_count"), num("embedding_length")
    n_head = max(1, num("attention.head_count", 1))
    heads = meta.get(f"{arch}.attention.head_count_kv", n_head)
    per_layer = heads if isinstance(heads, list) else [int(heads)] * n_layer  # type: ignore[arg-type]
    k_len = num("attention.key_length", n_embd // n_head)
    v_len = num("attention.value_length", k_len)
    n_swa = num("attention.sliding_window")
    recurrent = any(k.startswith(f"{arch}.") and any(m in k for m in _RECURRENT_KEYS)
                    for k in meta) or 0 in per_layer
    swa = _sliding_layers(meta, arch, n_layer) if n_swa else [False] * n_layer
    k_swa, v_swa = num("attention.key_length_swa", k_len), num("attention.value_length_swa", v_len)
    full_heads = sum(h for h, s in zip(per_layer, swa, strict=False) if h and not s)
    swa_heads = sum(h for h, s in zip(per_layer, swa, strict=False) if h and s)
    full = full_heads * (k_len + v_len) * 2
    sliding = swa_heads * (k_swa + v_swa) * 2
    if "kvroute.kv_bytes_per_token" in meta:  # a demo model says it itself
        full = int(meta["kvroute.kv_bytes_per_token"])  # type: ignore[call-overload]
    rec = 0
    if recurrent:
        # LFM2's short convolutions keep (kernel - 1) inputs per layer; Mamba-style layers
        # their convolution inputs and the SSM state
        n_rec = sum(1 for h in per_layer if not h) or n_layer
        if num("shortconv.l_cache"):
            rec = n_rec * (num("shortconv.l_cache") - 1) * n_embd * 4
        elif num("ssm.inner_size"):
            inner, state = num("ssm.inner_size"), num("ssm.state_size")
            groups = max(1, num("ssm.group_count", 1))
            conv = (num("ssm.conv_kernel", 4) - 1) * (inner + 2 * groups * state)
            rec = n_rec * (conv + state * inner) * 4
    return ModelMemory(n_swa=n_swa, recurrent=recurrent, kv_bytes_per_token=full or None,
                       swa_cell_bytes=sliding + CELL_META_BYTES if sliding else 0,
                       recurrent_bytes=rec, k_values=full_heads * k_len,
                       v_values=full_heads * v_len, k_swa_values=swa_heads * k_swa,
                       v_swa_values=swa_heads * v_swa, arch=arch)


def _sliding_layers(meta: dict[str, object], arch: str, n_layer: int) -> list[bool]:
    """Which layers attend to a sliding window (llama_hparams::set_swa_pattern)."""
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        return [bool(x) for x in pattern][:n_layer]
    n, dense_first = _SWA_PATTERN.get(arch, (2, False))
    if isinstance(pattern, int):
        n = pattern
    if dense_first:
        return [n == 0 or i % n != 0 for i in range(n_layer)]
    return [n == 0 or i % n < n - 1 for i in range(n_layer)]


def _arg(args: Sequence[str], names: tuple[str, ...], default: int) -> int:
    """The value of the last of ``names`` on a llama-server command line."""
    value = default
    for raw in _values(args, names):
        # (not a number: the server refuses to start, nothing to model)
        with contextlib.suppress(ValueError):
            value = int(raw)
    return value


def _values(args: Sequence[str], names: tuple[str, ...]) -> list[str]:
    """The values given to any of ``names`` (``-x v`` or ``-x=v``), in order."""
    out = []
    for i, a in enumerate(args):
        key, eq, inline = a.partition("=")
        if key in names:
            out.append(inline if eq else (args[i + 1] if i + 1 < len(args) else ""))
    return out


def cache_types(args: Sequence[str]) -> tuple[str, str]:
    """The K and V cache types a server started with ``args`` uses (f16 unless told; a
    type the server does not know makes it refuse to start, so it is not modelled)."""
    k = [v for v in _values(args, ("-ctk", "--cache-type-k")) if v in KV_CACHE_TYPES]
    v = [v for v in _values(args, ("-ctv", "--cache-type-v")) if v in KV_CACHE_TYPES]
    return (k[-1] if k else "f16"), (v[-1] if v else "f16")


def type_bytes(values: int, cache_type: str) -> int:
    """Bytes of ``values`` K or V values stored as ``cache_type`` (ggml_row_size: heads
    are whole blocks, which llama.cpp requires of a quantized cache)."""
    per_block, block_bytes = KV_CACHE_TYPES[cache_type]
    return values * block_bytes // per_block


def typed_kv_bytes(f16_bytes: int, k_values: int, v_values: int,
                   types: tuple[str, str]) -> int:
    """``f16_bytes`` of K and V stored in ``types`` instead."""
    if types == ("f16", "f16") or not (k_values or v_values):
        return f16_bytes
    typed = type_bytes(k_values, types[0]) + type_bytes(v_values, types[1])
    # the f16 size is a demo model's own word when it carries one: scaled, not replaced
    return f16_bytes * typed // (2 * (k_values + v_values))


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
    m = gguf_memory(model)
    n_swa, recurrent = m.n_swa, m.recurrent
    if "--swa-full" in args:
        n_swa = 0
    n_ubatch = _arg(args, ("-ub", "--ubatch-size"), 512)
    n_batch = _arg(args, ("-b", "--batch-size"), 2048)
    n_ubatch = min(n_ubatch, n_batch)
    unified = any(a in ("-kvu", "--kv-unified") for a in args)
    types = cache_types(args)
    full = typed_kv_bytes(m.kv_bytes_per_token or 0, m.k_values, m.v_values, types)
    swa = m.swa_cell_bytes and typed_kv_bytes(m.swa_cell_bytes - CELL_META_BYTES,
                                              m.k_swa_values, m.v_swa_values, types)
    return MemoryKind(
        n_swa=n_swa, recurrent=recurrent,
        swa_cells=swa_cells(n_swa, n_ubatch, slot_ctx, n_slots if unified else 1),
        max_checkpoints=_arg(args, ("-ctxcp", "--ctx-checkpoints", "--swa-checkpoints"), 32),
        min_step=_arg(args, ("-cms", "--checkpoint-min-step"), 8192),
        n_ubatch=n_ubatch, n_batch=n_batch,
        # a sliding cache keeps its window of each sequence in a save (measured: a state
        # reloaded covers the last n_swa positions); --swa-full caches every layer whole
        partial_bytes=(n_swa * (swa + CELL_META_BYTES) if n_swa else 0) + m.recurrent_bytes,
        kv_bytes_per_token=(full if n_swa or not swa else full + swa) or None,
    )
