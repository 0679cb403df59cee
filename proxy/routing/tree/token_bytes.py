"""Token sequences as ``bytes`` of native 32-bit ints: the radix tree's key format.

Why bytes (for speed and memory, see BENCHMARKS.md): 4 bytes per token
(``array('i').tobytes()``), and ``q.startswith(key, offset)`` is an in-place ``memcmp``,
so the tree's hot path never loops over tokens in Python nor copies them. The first
mismatch inside an edge is found by bisecting such comparisons (:func:`common_len`).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

TokenBytes = bytes

WIDTH = 4  # bytes per token (native int32)


def to_token_bytes(tokens: Sequence[int] | bytes | array) -> TokenBytes:
    """Encode token ids as native int32 bytes (the tree's key format).

    Passing an ``array('i')`` is a memcpy; a list of ints costs ~40 ns per token.
    ``bytes`` are assumed to be encoded already.
    """
    if isinstance(tokens, bytes):
        assert len(tokens) % WIDTH == 0, "token bytes must be a whole number of int32"
        return tokens
    if isinstance(tokens, array) and tokens.typecode == "i":
        return tokens.tobytes()
    return array("i", tokens).tobytes()


def from_token_bytes(data: bytes) -> list[int]:
    """Decode the tree's key format back to a list of ints (tests and debugging)."""
    out = array("i")
    out.frombytes(data)
    return out.tolist()


def common_len(key: bytes, q: bytes, off: int) -> int:
    """Tokens of ``key`` equal to ``q[off:]`` from the start, by bisecting memcmp.

    ``q.startswith(view, pos)`` compares in place: slicing bytes would copy them."""
    hi = min(len(key), len(q) - off) // WIDTH  # candidate answer is in [0, hi]
    k = memoryview(key)
    if q.startswith(k[: hi * WIDTH], off):
        return hi
    lo = 0  # invariant: first lo tokens equal, first hi tokens not equal
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if q.startswith(k[lo * WIDTH : mid * WIDTH], off + lo * WIDTH):
            lo = mid
        else:
            hi = mid
    return lo
