"""The LoRA adapters a request runs under, and when they cost a slot its cache.

llama-server (tools/server/server-context.cpp ``launch_slot_with_task``, measured in
tests/backends/test_demo_lora.py) keeps, per slot, the adapter scales its last request
ran under. A request with a ``lora`` field runs under the set it names (every loaded
adapter it leaves out at scale 0); where that set differs from the slot's, in any scale,
the server clears the slot after choosing it, and after loading a RAM entry into it: the
request reuses nothing. A request without the field (or with ``[]``) runs under the
server's global set (``/lora-adapters``) and never clears, even where the slot's KV
was made under other adapters: its answer is then computed over that KV. So kvroute
names the global set in such a request it sends to a server with adapters, and the
model takes a request without the field as one naming the global set. A slot that never
ran a request holds no set, which differs from every set of a server with adapters.

aLoRA adapters (kept, not cleared, in some of those changes) are not modelled.
"""

from __future__ import annotations

import struct

Lora = tuple[tuple[int, float], ...]  # a request's `lora`: (id, scale), ascending ids
Scales = tuple[float, ...]  # a scale per adapter the server loaded: the set a slot ran under

_F32 = struct.Struct("f")


def f32(x: float) -> float:
    """``x`` as the server keeps it (a C float): two scales equal there compare equal."""
    try:
        return float(_F32.unpack(_F32.pack(x))[0])
    except OverflowError:
        return float("inf") if x > 0 else float("-inf")


def requested(body: object) -> Lora | None:
    """The ``lora`` field of a request body as the server reads it (parse_lora_request,
    json_value: numbers and booleans convert, C-style; anything else, or nothing, gives
    the default: ``id`` -1, ``scale`` 0; a later entry of an id replaces an earlier one).
    None: no field, or an empty or malformed one (the server then runs the global set,
    or refuses the request)."""
    raw = body.get("lora") if isinstance(body, dict) else None
    if not isinstance(raw, list) or not raw:
        return None
    got: dict[int, float] = {}
    for entry in raw:
        item = entry if isinstance(entry, dict) else {}
        i, scale = item.get("id"), item.get("scale")
        i = _number(i, -1)
        got[int(i) if abs(i) < 2**31 else -1] = f32(_number(scale, 0.0))
    return tuple(sorted(got.items()))


def _number(v: object, default: float) -> float:
    if not isinstance(v, int | float) or v != v:
        return default
    return float(v)


def scales(lora: Lora, n_adapters: int) -> Scales:
    """construct_lora_list: the set ``lora`` names on a server of ``n_adapters``."""
    named = dict(lora)
    return tuple(named.get(i, 0.0) for i in range(n_adapters))
