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
removed: only a file proven unusable (no server loads it) is. Where the index and a
sidecar disagree about a file, the newer record describes it (an index left stale by a
failed write names an older save under the same id), and a file that does not fit it is
put aside, never removed on the strength of a record that may be the wrong one.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

PREFIX = "kvroute-"
INDEX = "kvroute-index.json"
QUARANTINE = "kvroute-quarantine"
# A slot file's name, or its sidecar's; a name moved to the quarantine may carry a suffix
NUMBERED = re.compile(rf"{PREFIX}(\d+)\.(bin|json)")
MAGIC = 0x67677371  # LLAMA_STATE_SEQ_MAGIC, 'ggsq'
HEADER = struct.Struct("<III")  # magic, version, token count


@dataclass
class Saved:
    id: int
    backend: str  # where it was saved from (restored there after a restart)
    slot: int
    tokens: bytes  # int32 token bytes the slot was known to hold when saved
    saved_at: float
    model: str  # the identity of the model that computed it (see identity.py)
    size: int = 0  # bytes of the file as the server wrote it
    n: int = 0  # tokens the server said it saved (0: not known)
    count: int = 0  # the token count of the file's header (0: not known)

    @property
    def file(self) -> str:
        return file_name(self.id)

    @property
    def sidecar(self) -> str:
        return file_name(self.id, "json")


def file_name(i: int, kind: str = "bin") -> str:
    """The name of slot file ``i`` (``kind`` "bin"), or of its sidecar ("json")."""
    return f"{PREFIX}{i}.{kind}"


def numbered(name: str) -> tuple[int, str] | None:
    """(id, "bin" | "json") of a slot file's or a sidecar's name; None for another."""
    m = NUMBERED.fullmatch(name)
    return None if m is None else (int(m[1]), m[2])


def highest(names: Iterable[str], index: Mapping[int, Saved] | None) -> int:
    """The highest id ``names`` (the directory's and its quarantine's) or ``index`` carry.
    The index counts even for a file that is gone: an index whose rewrite failed still
    names it, and a new save under that id would be judged by the old entry."""
    return max([int(m[1]) for n in names if (m := NUMBERED.match(n))] + [*(index or ())],
               default=0)


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


def examine(path: Path) -> tuple[int, Header | str]:
    """The size of the file at ``path`` and its header (or why it has none); OSError
    when it cannot be read."""
    with path.open("rb") as f:
        return os.fstat(f.fileno()).st_size, header(f.read(HEADER.size))


def write_whole(directory: Path, name: str, data: bytes) -> None:
    """``directory``'s ``name`` holds ``data``, whole, or is left as it was (OSError): a
    temporary file, fsync, rename, fsync of the directory."""
    tmp = directory / (name + ".tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / name)
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


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


def verdict(size: int, head: Header | str, e: Saved | None) -> tuple[str, str] | None:
    """None: the file can be sent to a server (as ``e``; None: a file just saved, known by
    itself alone); else ("remove" | "quarantine", why). Removed only when no server loads
    it: no header, or fewer bytes than it had (a server aborts on a truncated file).
    Quarantined when it is whole but not what ``e`` says (another file under that name)."""
    if isinstance(head, str):
        return "remove", f"header: {head}"
    if e is not None and size < e.size:
        return "remove", f"truncated: {size} of the {e.size} bytes the server wrote"
    if size < HEADER.size + 4 * head.count:
        return "remove", f"truncated: {size} bytes, its header says {head.count} tokens"
    if e is not None and size > e.size:
        return "quarantine", f"{size} bytes, the server wrote {e.size}"
    if e is not None and e.count and head.count != e.count:
        return "quarantine", f"its header says {head.count} tokens, its record {e.count}"
    return None


def reconcile(index: dict[int, Saved] | None, found: list[Found]) -> Plan:
    """What to keep of ``found`` (the directory's slot files): each file is described by
    the newer of its entry in ``index`` (None: no index could be read) and its sidecar;
    one that neither describes is quarantined. An entry whose file is not found is
    dropped."""
    plan = Plan()
    ids = {f.id for f in found}
    for i, e in (index or {}).items():
        if i not in ids:
            plan.dropped.append((e.file, "its file is gone"))
    for f in found:
        side = f.sidecar if isinstance(f.sidecar, Saved) and f.sidecar.id == f.id else None
        entry = (index or {}).get(f.id) if f.id is not None else None
        e = _newer(entry, side)
        if e is None:
            why = f.sidecar if isinstance(f.sidecar, str) else "its sidecar names another file"
            plan.quarantine.append((f.name, f"no index entry, and {why}"))
            continue
        judged = _judge_found(f, e, disagree=None not in (entry, side) and entry != side)
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


def _newer(entry: Saved | None, side: Saved | None) -> Saved | None:
    """The record that describes a file: its sidecar, written at each save before the
    index, unless its index entry is the newer one."""
    if entry is None or side is None:
        return entry or side
    return entry if entry.saved_at > side.saved_at else side


def _judge_found(f: Found, e: Saved, disagree: bool) -> tuple[str, str] | None:
    """`verdict` on ``f`` as ``e``; ``disagree``: its two records differ, and then only
    the file itself proves it unusable (its header): else it is put aside."""
    judged = verdict(f.size, f.header, e)
    if judged is None or not disagree or verdict(f.size, f.header, None) is not None:
        return judged
    return "quarantine", f"{judged[1]}; its index entry and its sidecar disagree"
