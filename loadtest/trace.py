"""Mooncake-format traces: loading, and deterministic token ids per 512-token block
(as a list, or as the prompt bytes the simulator replays).

A Mooncake trace line is ``{"timestamp": ms, "input_length": n, "output_length": m,
"hash_ids": [...]}`` with one id per block of ``block`` tokens; requests sharing a leading
run of ids share that prefix. Token ids are derived from the id alone, so any process
(simulator, live replay) produces the same prompt for the same line.
"""

from __future__ import annotations

import json
import lzma
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import IO

BLOCK = 512
# NOTE: the demo vocabulary has 151,936 ids with special tokens from 151,643: stay below
VOCAB_LO = 1000
VOCAB_HI = 150_000
_DIR = Path(__file__).resolve().parent / "traces"
# The traces kept in the repository (traces/README.md), by the name --trace accepts
TRACES = {"synthetic": _DIR / "mooncake_synthetic_trace.jsonl",
          "conversation": _DIR / "mooncake_conversation_trace.jsonl.xz"}
_STRIDE = 7919  # prime, coprime with the span: distinct block starts for ids < span


@dataclass(frozen=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def trace_path(name_or_path: str | Path) -> Path:
    """A trace kept here by its name (``TRACES``), else the path given."""
    return TRACES.get(str(name_or_path), Path(name_or_path))


def _open(path: Path) -> IO[str]:
    if path.suffix == ".xz":
        return lzma.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def load_mooncake(path: str | Path) -> list[TraceRequest]:
    """Read a Mooncake JSONL trace (xz-compressed if its name ends in .xz, or one of
    ``TRACES`` by name), sorted by timestamp (stable)."""
    out: list[TraceRequest] = []
    path = trace_path(path)
    with _open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            d = json.loads(line)
            r = TraceRequest(
                float(d["timestamp"]),
                int(d["input_length"]),
                int(d["output_length"]),
                tuple(int(h) for h in d["hash_ids"]),
            )
            if r.input_length < 1 or r.input_length > len(r.hash_ids) * BLOCK:
                raise ValueError(f"{path}:{i}: input_length does not fit its hash_ids")
            out.append(r)
    out.sort(key=lambda r: r.timestamp_ms)
    return out


def block_start(hash_id: int, vocab_lo: int = VOCAB_LO, vocab_hi: int = VOCAB_HI) -> int:
    """Offset (from vocab_lo) of a block's first token; distinct for ids < vocab span."""
    return (hash_id * _STRIDE) % (vocab_hi - vocab_lo)


def block_tokens(
    hash_id: int, block: int = BLOCK, vocab_lo: int = VOCAB_LO, vocab_hi: int = VOCAB_HI
) -> list[int]:
    """Deterministic token ids of one block: a run of consecutive ids from block_start.

    Two different ids at the same position differ at their first token (for ids below
    the vocabulary span), which is all prefix matching needs.
    """
    span = vocab_hi - vocab_lo
    start = block_start(hash_id, vocab_lo, vocab_hi)
    return [vocab_lo + (start + i) % span for i in range(block)]


def request_tokens(r: TraceRequest, block: int = BLOCK) -> list[int]:
    """The prompt of one trace request (blocks concatenated, cut to input_length)."""
    out: list[int] = []
    for h in r.hash_ids:
        out.extend(block_tokens(h, block))
    return out[: r.input_length]


class BlockPrompts:
    """Prompt bytes (int32 token ids) per trace request, as `request_tokens` gives them,
    for the simulator: joined from views into one precomputed ramp.

    A block is a slice of the ramp; memoising views rather than copies keeps the source
    of every join in ~600 KB of cache-warm memory instead of a copy per distinct block
    (~90 MB on the Mooncake trace, a page fault and cache miss per first use)."""

    def __init__(self, block: int = BLOCK) -> None:
        ramp = array("i", range(VOCAB_LO, VOCAB_HI))
        self._ramp = memoryview((ramp + ramp[:block]).tobytes())  # wrap-around, no modulo
        self._block = block
        self._memo: dict[int, memoryview] = {}  # hash id -> its block (ids repeat a lot)

    def _get(self, h: int) -> memoryview:
        start = 4 * block_start(h)
        b = self._memo[h] = self._ramp[start : start + 4 * self._block]
        return b

    def prompt(self, r: TraceRequest) -> bytes:
        memo = self._memo
        get = self._get
        # the blocks the length reaches: a line may carry more ids than its length needs
        n = -(-r.input_length // self._block)
        parts = [memo.get(h) or get(h) for h in r.hash_ids[:n]]
        cut = 4 * (r.input_length - (n - 1) * self._block)
        if cut < len(parts[-1]):
            parts[-1] = parts[-1][:cut]
        return b"".join(parts)
