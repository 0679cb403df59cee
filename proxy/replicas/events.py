"""What one replica tells the others, one compact event at a time:

- ``start``: a request of its own is now in this slot of this backend (of this pool),
  with this prompt: the slot is busy, and its prefill loads the backend; on the wire,
  the prompt may be the first ``keep`` tokens of a prompt an earlier start told that
  slot (or the slot ``base_from`` names) to hold (``base``: their digest, see bases.py)
  then ``tokens``; with ``at``, it claims a slot it does not go on from, as of that
  wall-clock time, and is not sent yet (claims.py): a replica of a version before
  claims drops it (it reads ``at`` on a ``held`` only), so a claim is told again
  without ``at`` once sent, and is no base for another start;
- ``moved``: that claim lost: the request was not sent there (its start is void; such a
  replica drops the unknown kind, never having read the claim);
- ``first``: that request's first token came (its prefill is over);
- ``end``: it left the slot, holding the first ``keep`` tokens of its prompt then
  ``tokens`` (its answer, typically); nothing kept and no tokens: not known;
- ``held``: the slot holds ``tokens``, as of wall-clock time ``at`` (a snapshot sent to a
  replica that joins, which keeps what it knows of a slot since then);
- ``alive`` (every second, per pool: its requests still in flight there: a peer ends
  the others, whose end it missed), ``hello`` (it joined: the others send it their
  view), ``resync`` (a start it read was relative to a base it lacks: the others send
  it their requests in flight, and their next starts whole), ``bye``.

Token ids travel zlib'd as int32 (~2-3 bytes a token). Validated on the way in: nothing a
peer sends can make a replica raise, or hold more than `MAX_TOKENS` of it.
"""

from __future__ import annotations

import base64
import binascii
import zlib
from dataclasses import dataclass
from enum import StrEnum

import orjson

from proxy.routing.cache.lora import Lora

MAX_TOKENS = 1 << 22  # a slot's context at most (the largest models': ~10^6)
MAX_EVENT_BYTES = 8 << 20  # what a peer may send in one event
_MAX_NAME = 256
_MAX_ID = 1 << 62
MAX_LIVE = 4096  # requests in flight one replica names in an `alive`
DIGEST = 8  # bytes of a start's base digest
_MAX_ADAPTERS = 1024  # (id, scale) pairs a start may name


class Kind(StrEnum):
    START = "start"
    MOVED = "moved"
    FIRST = "first"
    END = "end"
    HELD = "held"
    HELLO = "hello"
    RESYNC = "resync"
    ALIVE = "alive"
    BYE = "bye"


_KINDS = frozenset(k.value for k in Kind)
_OF_A_SLOT = (Kind.START, Kind.MOVED, Kind.FIRST, Kind.END, Kind.HELD)  # name a slot
_WITH_TOKENS = (Kind.START, Kind.HELD)  # carry at least two tokens


@dataclass(frozen=True)
class Event:
    replica: str  # who sends it
    kind: Kind
    pool: str = ""  # the model pool (its name; "" for an unnamed one)
    backend: str = ""
    slot: int = 0
    request: int = 0  # the sender's id of the request (start, first, end)
    tokens: bytes = b""  # int32 token bytes
    keep: int = 0  # (end) tokens of the request's prompt its slot still holds; (start) of
    # the sequence ``base`` names, that the prompt starts with
    at: float = 0.0  # (held) when the slot last changed, as far as the sender knows; (start)
    # when its claim was told (0: not a claim)
    live: tuple[int, ...] = ()  # (alive) the sender's requests in flight in the pool
    base: bytes = b""  # (start) the digest of the ``keep`` tokens it starts with
    base_from: tuple[str, int] | None = None  # (start) their slot, if another (backend, slot)
    lora: Lora | None = None  # (start) the LoRA adapters it names (None: no `lora` field);
    # (held) those the slot's last request ran under


def encode(e: Event) -> bytes:
    obj: dict[str, object] = {"r": e.replica, "k": e.kind.value}
    if e.kind == Kind.ALIVE:
        obj.update(p=e.pool, l=e.live)
    if e.kind in _OF_A_SLOT:
        obj.update(p=e.pool, b=e.backend, s=e.slot, i=e.request)
    if e.keep:
        obj["n"] = e.keep
    if e.at:
        obj["w"] = e.at
    if e.base:
        obj["h"] = [e.base.hex(), *(e.base_from or ())]
    if e.tokens:
        obj["t"] = base64.b64encode(zlib.compress(e.tokens, 1)).decode()
    if e.lora is not None:
        obj["a"] = [[i, scale] for i, scale in e.lora]
    return orjson.dumps(obj)


def decode(data: bytes) -> Event | None:
    """The event in ``data``; None when it is not one (or too large)."""
    if len(data) > MAX_EVENT_BYTES:
        return None
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not _name(obj.get("r")) \
            or not isinstance(obj.get("k"), str) or obj["k"] not in _KINDS:
        return None
    kind = Kind(obj["k"])
    if kind == Kind.ALIVE:
        return _alive(obj)
    if kind not in _OF_A_SLOT:
        return None if len(obj) != 2 else Event(obj["r"], kind)
    pool, backend, slot, request = obj.get("p"), obj.get("b"), obj.get("s"), obj.get("i")
    keep, packed, at = obj.get("n", 0), obj.get("t"), obj.get("w", 0.0)
    if not (_name(pool) and _name(backend) and _count(slot, 1 << 16)
            and _count(request, _MAX_ID) and _count(keep, MAX_TOKENS + 1)):
        return None
    tokens = b"" if packed is None else _unpack(packed)
    base = _base(obj.get("h"), kind == Kind.START and keep)
    lora = _lora(obj.get("a"), kind in (Kind.START, Kind.HELD))
    if tokens is None or base is None or lora is False \
            or (kind in _WITH_TOKENS and len(tokens) + 4 * keep < 8) \
            or (kind in (Kind.FIRST, Kind.MOVED) and (tokens or keep)) \
            or (kind == Kind.HELD and keep) \
            or (kind == Kind.START and len(tokens) + 4 * keep > MAX_TOKENS * 4) \
            or not isinstance(at, float | int) or isinstance(at, bool) \
            or not 0 <= at < 1e11 or (kind not in (Kind.HELD, Kind.START) and at):
        return None
    return Event(obj["r"], kind, pool, backend, slot, request, tokens, keep, float(at),
                 base=base[0], base_from=base[1], lora=lora)


def _base(v: object, wanted: object) -> tuple[bytes, tuple[str, int] | None] | None:
    """A start's ``base`` digest (DIGEST bytes) and slot: there exactly when wanted."""
    if v is None:
        return None if wanted else (b"", None)
    if not wanted or not isinstance(v, list) or len(v) not in (1, 3) \
            or not isinstance(v[0], str) or len(v[0]) != 2 * DIGEST:
        return None
    if len(v) == 3 and not (_name(v[1]) and _count(v[2], 1 << 16)):
        return None
    try:
        digest = bytes.fromhex(v[0])
    except ValueError:
        return None
    return digest, (v[1], v[2]) if len(v) == 3 else None


def _lora(v: object, allowed: bool) -> Lora | bool | None:
    """A start's adapters (None: none named; False: not such a list, or not allowed)."""
    if v is None:
        return None
    if not allowed or not isinstance(v, list) or not 0 < len(v) <= _MAX_ADAPTERS:
        return False
    out = []
    for item in v:
        if not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], int) \
                or isinstance(item[0], bool) or not -(1 << 31) <= item[0] < 1 << 31 \
                or not isinstance(item[1], float | int) or isinstance(item[1], bool):
            return False
        out.append((item[0], float(item[1])))
    return tuple(out)


def _alive(obj: dict[str, object]) -> Event | None:
    pool, live = obj.get("p"), obj.get("l")
    if len(obj) != 4 or not _name(pool) or not isinstance(live, list) \
            or len(live) > MAX_LIVE or not all(_count(i, _MAX_ID) for i in live):
        return None
    return Event(obj["r"], Kind.ALIVE, pool, live=tuple(live))  # type: ignore[arg-type]


def _name(v: object) -> bool:
    return isinstance(v, str) and len(v) <= _MAX_NAME


def _count(v: object, below: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < below


def _unpack(packed: object) -> bytes | None:
    if not isinstance(packed, str):
        return None
    try:
        z = zlib.decompressobj()
        tokens = z.decompress(base64.b64decode(packed, validate=True), MAX_TOKENS * 4)
    except (binascii.Error, ValueError, zlib.error):
        return None
    if z.unconsumed_tail or not z.eof or len(tokens) % 4 or not tokens:
        return None  # (cut, truncated, or not int32s)
    return tokens
