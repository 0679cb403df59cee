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

An activated LoRA (aLoRA: an adapter whose file names invocation tokens, which
`/lora-adapters` reports) changes those rules (``should_clear``, ``launched``): a change of set
keeps the slot when the slot's last set enabled nothing or only aLoRAs and the new one
enables only aLoRAs, because an aLoRA leaves the KV before its invocation as the base
model makes it. At launch, an aLoRA-only set runs one aLoRA (two or more: the server
refuses the request), from where the server's backward scan finds its invocation tokens
in the prompt; the slot then reuses nothing from one token before there. Not found: the
server sets that adapter's scale to 0 in the slot's set, which is then the set it keeps.
"""

from __future__ import annotations

import struct
from functools import lru_cache

from proxy.routing.tree.token_bytes import WIDTH

Lora = tuple[tuple[int, float], ...]  # a request's `lora`: (id, scale), ascending ids
Scales = tuple[float, ...]  # a scale per adapter the server loaded: the set a slot ran under
# per adapter the server loaded, its aLoRA invocation tokens (() for a plain adapter)
Invocations = tuple[tuple[int, ...], ...]

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


def enabled(scales: Scales) -> list[int]:
    """lora_get_enabled_ids: the adapters of a set at a scale other than 0."""
    return [i for i, x in enumerate(scales) if x != 0.0]


def all_alora(scales: Scales, inv: Invocations) -> bool:
    """lora_all_alora: the set enables at least one adapter, and only aLoRAs."""
    on = enabled(scales)
    return bool(on) and all(i < len(inv) and inv[i] for i in on)


def should_clear(current: Scales, new: Scales, inv: Invocations) -> bool:
    """Does a slot whose last request ran under ``current`` lose its cache to a request
    under ``new`` (are_lora_equal, then lora_should_clear_cache)?"""
    if current == new:
        return False
    keeps = (not enabled(current) or all_alora(current, inv)) and all_alora(new, inv)
    return not keeps


@lru_cache(maxsize=8)  # (asked once per backend and slot a request is weighed for)
def invocation_start(prompt: bytes, seq: tuple[int, ...]) -> int:
    """Where llama-server's scan finds ``seq`` in ``prompt`` (token bytes: native int32
    ids), in tokens; the prompt's length when it does not.

    The server walks the prompt backwards matching ``seq`` from its end, and on a
    mismatch starts over with the next token, without comparing the mismatched one with
    the end of ``seq``: it misses an occurrence right before a partial one. A Python
    loop from the end: it runs only for requests naming an aLoRA, whose invocation sits
    near the prompt's end; a prompt holding no occurrence is told apart first, in C."""
    ids = memoryview(prompt).cast("i")
    n = len(ids)
    if not seq or struct.pack(f"{len(seq)}i", *seq) not in prompt:
        return n
    last = len(seq) - 1
    m = last
    for i in range(n - 1, -1, -1):
        if ids[i] == seq[m]:
            if m == 0:
                return i
            m -= 1
        else:
            m = last
    return n


def launched(named: Scales, inv: Invocations, prompt: bytes
             ) -> tuple[Scales, int | None]:
    """The set a slot keeps after launching a request under ``named`` whose prompt is
    ``prompt`` (token bytes), and the most it reuses of its cache (None: no limit), as
    an aLoRA runs from its invocation (see the module's text). A set enabling two or more
    aLoRAs is refused by the server: returned as it is."""
    if not all_alora(named, inv):
        return named, None
    on = enabled(named)
    if len(on) != 1:
        return named, None
    i = on[0]
    start = invocation_start(prompt, inv[i])
    if start == len(prompt) // WIDTH:
        return tuple(0.0 if j == i else x for j, x in enumerate(named)), None
    return named, (start - 1 if start > 0 else None)
