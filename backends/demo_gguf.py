"""What the demo architectures' writers share: the sizes they read and seeded random
weights. backends/demo_model.py opens each GGUF with the vocabulary and the template,
then hands it to an architecture's writer (demo_swa.py, demo_hybrid.py) to add its own
keys and tensors."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from backends.binary import Progress, cache_lock


class ModelShape(Protocol):
    """The sizes of a demo model (backends.demo_model.DemoModelParams is one)."""

    @property
    def n_layer(self) -> int: ...
    @property
    def n_embd(self) -> int: ...
    @property
    def n_head(self) -> int: ...
    @property
    def n_head_kv(self) -> int: ...
    @property
    def n_ff(self) -> int: ...
    @property
    def head_dim(self) -> int: ...


def kv_bytes(n_attention_layers: int, shape: ModelShape) -> int:
    """f16 K and V bytes per token of that many attention layers."""
    return n_attention_layers * shape.n_head_kv * shape.head_dim * 2 * 2


class Weights:
    """Seeded random f16 matrices and f32 norms, in numpy's (rows, cols) order: a ggml
    tensor of shape {ne0, ne1} is mat(ne1, ne0)."""

    def __init__(self, seed: int) -> None:
        import numpy as np

        self._np = np
        self._rng = np.random.default_rng(seed)

    def mat(self, rows: int, cols: int, scale: float = 0.02) -> Any:
        # small weights keep activations finite through 8 random layers
        x = self._rng.standard_normal((rows, cols), dtype=self._np.float32) * scale
        return x.astype(self._np.float16)

    def ones(self, n: int) -> Any:
        return self._np.ones(n, dtype=self._np.float32)


def synthesised(path: Path, what: str, write: Callable[[Path], None],
                progress: Progress) -> Path:
    """``path``, written by ``write`` first if missing: under the cache's lock (a
    concurrent prepare may build it meanwhile), through a temporary file, so that a
    half-written GGUF never sits in the cache."""
    if path.is_file():
        return path
    with cache_lock():
        if path.is_file():  # built by a concurrent prepare while we waited for the lock
            return path
        progress(f"==> synthesising {what} {path.name}")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        try:
            write(tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return path
