"""What describes a saved slot, and what is kept of a directory when kvroute starts.

Each slot file ``kvroute-<id>.bin`` is described twice: by its sidecar ``kvroute-<id>.json``
beside it, written once when the server's save succeeds (before the index, so that no file
the index names is without one), and by its entry in the index, which lists them all. The
sidecar makes a file self-describing: an index that is lost, unreadable or older than the
files (kvroute stopped between a file and the index naming it) is rebuilt from them. Both
hold the same record (`Saved`).

The file itself starts with llama.cpp's sequence-state header (llama-context.cpp
`state_seq_save_file`): u32 magic ``ggsq``, u32 version, u32 token count, that many int32
tokens, then the state. It tells a file that can be sent to a server from one that
cannot, without sending it: a server given a truncated file aborts. Its count is the
server's own token state (llama-server writes a few words more than the tokens its save
answers with), so the record keeps both, and a file is checked against the count read
from its header when it was saved.

`reconcile` decides, from the index, the files and their sidecars, what is kept, what is
put aside (quarantined: kvroute cannot say what it holds, an operator may), and what is
removed: only a file proven unusable (no server loads it) is.
"""

from __future__ import annotations

import base64
import contextlib
import json
import struct
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

PREFIX = "kvroute-"
MAGIC = 0x67677371  # LLAMA_STATE_SEQ_MAGIC, 'ggsq'
HEADER = struct.Struct("<III")  # magic, version, token count


@dataclass
class Saved:
    id: int
    backend: str  # where it was saved from (restored there after a restart)
    slot: int
    tokens: bytes  # int32 token bytes the slot was known to hold when saved
    saved_at: float
    model: str  # the identity of the model that computed it (see slot_identity)
    size: int = 0  # bytes of the file as the server wrote it
    n: int = 0  # tokens the server said it saved (0: not known)
    count: int = 0  # the token count of the file's header (0: not known)

    @property
    def file(self) -> str:
        return f"{PREFIX}{self.id}.bin"

    @property
    def sidecar(self) -> str:
        return f"{PREFIX}{self.id}.json"


def encode(e: Saved) -> dict[str, Any]:
    return {"id": e.id, "backend": e.backend, "slot": e.slot, "saved_at": e.saved_at,
            "model": e.model, "size": e.size, "n": e.n, "count": e.count,
            "tokens": base64.b64encode(e.tokens).decode()}


def decode(d: Any) -> Saved:
    """A record of the index or a sidecar; ValueError if it does not parse, or has no model
    or size (an older kvroute's: what computed its KV is unknown)."""
    try:
        e = Saved(int(d["id"]), str(d["backend"]), int(d["slot"]),
                  base64.b64decode(d["tokens"], validate=True), float(d["saved_at"]),
                  str(d["model"]), int(d["size"]), int(d.get("n", 0)),
                  int(d.get("count", 0)))
    except (KeyError, TypeError, AttributeError) as err:  # (binascii.Error is a ValueError)
        raise ValueError(f"not a record: {err!r}") from err
    if len(e.tokens) % 4 or min(e.id, e.size, e.n, e.count) < 0:
        raise ValueError("not a record: tokens, id, size or count out of range")
    return e


def read_index(path: Path) -> tuple[dict[int, Saved] | None, str | None]:
    """The index's entries (an entry that does not parse is skipped alone), and why there
    are none: (None, None) with no index yet, (None, why) with one that does not parse."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None, None
    except OSError as err:
        return None, f"index unreadable: {err.strerror}"
    try:
        doc = json.loads(raw)
    except ValueError as err:
        return None, f"index does not parse: {err}"
    if not isinstance(doc, list):
        return None, "index is not a list"
    out: dict[int, Saved] = {}
    for d in doc:
        with contextlib.suppress(ValueError):
            e = decode(d)
            out[e.id] = e
    return out, None


def read_sidecar(path: Path) -> Saved | str:
    """The record of sidecar ``path``, or why there is none."""
    try:
        return decode(json.loads(path.read_bytes()))
    except FileNotFoundError:
        return "no sidecar"
    except (OSError, ValueError) as err:
        return f"its sidecar is unreadable ({err})"


@dataclass(frozen=True)
class Header:
    version: int
    count: int  # tokens the file holds, as the server wrote them


def header(head: bytes) -> Header | str:
    """The sequence-state header at the start of a file (its first HEADER.size bytes or
    fewer), or why it is not one. The version is not judged: a server of another build
    refuses the file by itself (cleanly), and the file is dropped then."""
    if len(head) < HEADER.size:
        return f"{len(head)} bytes: shorter than a header"
    magic, version, count = HEADER.unpack(head[:HEADER.size])
    if magic != MAGIC:
        return f"not a llama.cpp sequence state (magic {magic:08x})"
    return Header(version, count)


@dataclass(frozen=True)
class Found:
    """A slot file of the directory: ``id`` None when its name is not one kvroute gives;
    ``sidecar`` its record, or why there is none."""

    name: str
    id: int | None
    size: int
    header: Header | str
    sidecar: Saved | str = "no sidecar"


@dataclass
class Plan:
    keep: dict[int, Saved] = field(default_factory=dict)
    describe: list[int] = field(default_factory=list)  # kept: sidecar to (re)write
    quarantine: list[tuple[str, str]] = field(default_factory=list)  # (file, why)
    remove: list[tuple[str, str]] = field(default_factory=list)  # (file, why)
    dropped: list[tuple[str, str]] = field(default_factory=list)  # index entries: (file, why)


def verdict(size: int, head: Header | str, e: Saved) -> tuple[str, str] | None:
    """None: the file can be sent to a server as ``e``; else ("remove" | "quarantine",
    why). Removed only when no server loads it: no header, or fewer bytes than it had
    (a server aborts on a truncated file). Quarantined when it is whole but not what
    ``e`` says (another file under that name)."""
    if isinstance(head, str):
        return "remove", f"header: {head}"
    if size < e.size:
        return "remove", f"truncated: {size} of the {e.size} bytes the server wrote"
    if size < HEADER.size + 4 * head.count:
        return "remove", f"truncated: {size} bytes, its header says {head.count} tokens"
    if size > e.size:
        return "quarantine", f"{size} bytes, the server wrote {e.size}"
    if e.count and head.count != e.count:
        return "quarantine", f"its header says {head.count} tokens, its record {e.count}"
    return None


def reconcile(index: dict[int, Saved] | None, found: list[Found]) -> Plan:
    """What to keep of ``found`` (the directory's slot files): each file is described by
    its entry in ``index`` (None: no index could be read), else by its sidecar; one that
    neither describes is quarantined. An entry whose file is not found is dropped."""
    plan = Plan()
    ids = {f.id for f in found}
    for i, e in (index or {}).items():
        if i not in ids:
            plan.dropped.append((e.file, "its file is gone"))
    for f in found:
        side = f.sidecar if isinstance(f.sidecar, Saved) else None
        e = (index or {}).get(f.id) if f.id is not None else None
        if e is None and side is not None and side.id == f.id:
            e = side
        if e is None:
            why = f.sidecar if isinstance(f.sidecar, str) else "its sidecar names another file"
            plan.quarantine.append((f.name, f"no index entry, and {why}"))
            continue
        judged = verdict(f.size, f.header, e)
        if judged is not None:
            kind, why = judged
            (plan.remove if kind == "remove" else plan.quarantine).append((f.name, why))
            continue
        if not e.count and isinstance(f.header, Header):
            e = replace(e, count=f.header.count)
        plan.keep[e.id] = e
        if side != e:
            plan.describe.append(e.id)
    return plan
