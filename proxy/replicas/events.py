"""What one replica tells the others: a request of its own ended and left these tokens in
this slot of this backend of this pool. Compact (zlib'd int32 ids, ~2-3 bytes a token),
and validated on the way in: nothing a peer sends can make a replica raise, or hold more
than `MAX_TOKENS` of it.
"""

from __future__ import annotations

import base64
import binascii
import zlib
from dataclasses import dataclass

import orjson

MAX_TOKENS = 1 << 22  # a slot's context at most (the largest models': ~10^6)
MAX_EVENT_BYTES = 8 << 20  # what a peer may send in one event
_MAX_NAME = 256


@dataclass(frozen=True)
class Held:
    replica: str  # who routed the request
    pool: str  # the model pool (its name; "" for an unnamed one)
    backend: str
    slot: int
    tokens: bytes  # int32 token bytes the slot holds now


def encode(e: Held) -> bytes:
    return orjson.dumps({"r": e.replica, "p": e.pool, "b": e.backend, "s": e.slot,
                         "t": base64.b64encode(zlib.compress(e.tokens, 1)).decode()})


def decode(data: bytes) -> Held | None:
    """The event in ``data``; None when it is not one (or too large)."""
    if len(data) > MAX_EVENT_BYTES:
        return None
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(obj, dict):
        return None
    names = [obj.get(k) for k in ("r", "p", "b")]
    slot, packed = obj.get("s"), obj.get("t")
    if not all(isinstance(v, str) and len(v) <= _MAX_NAME for v in names) \
            or not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < 1 << 16 \
            or not isinstance(packed, str):
        return None
    tokens = _unpack(packed)
    if tokens is None:
        return None
    replica, pool, backend = names
    return Held(replica, pool, backend, slot, tokens)  # type: ignore[arg-type]


def _unpack(packed: str) -> bytes | None:
    try:
        z = zlib.decompressobj()
        tokens = z.decompress(base64.b64decode(packed, validate=True), MAX_TOKENS * 4)
    except (binascii.Error, ValueError, zlib.error):
        return None
    if z.unconsumed_tail or not z.eof or len(tokens) % 4 or not tokens:
        return None  # (cut, truncated, or not int32s)
    return tokens
