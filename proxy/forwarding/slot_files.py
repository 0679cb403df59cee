"""One directory of the disk tier: its slot files and the index beside them.

File names are kvroute's own (``kvroute-<id>.bin``: no client input reaches a path), and
so is the index (``kvroute-index.json``): what each file holds (backend, slot, the token
ids the router knew the slot to hold, the model that computed it, its size as the server
wrote it). Every name kvroute writes starts with ``kvroute``, and nothing else of the
directory is read or touched: a directory an operator's llama-server also uses keeps
the operator's own files, an ``index.json`` of theirs too.

One kvroute process owns a directory: it takes an exclusive lock on ``kvroute.lock``
there (flock; the kernel lets it go when the process ends, even by SIGKILL) before
reading the index, and holds it until it closes the store. Two kvroutes declaring one
shared directory would each write the index without the other's entries and remove the
other's files as strays (over budget, or written by no save of its own): the second is
refused at start, naming the directory. Using the directory read-only in the second
instead would not hold either: the owner drops and replaces files (budget, a newer
save of a conversation) at any moment, so a reader's index goes stale under it and a
restore it sends can load a file the owner is replacing; and the servers of the second
would save nothing, which is the tier's whole point for them.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import structlog

from proxy.instance import DISK_FIX, adopt, lock

INDEX = "kvroute-index.json"
PREFIX = "kvroute-"


@dataclass
class Saved:
    id: int
    backend: str  # where it was saved from (restored there after a restart)
    slot: int
    tokens: bytes  # int32 token bytes the slot was known to hold when saved
    saved_at: float
    model: str  # the identity of the model that computed it (see slot_identity)
    size: int = 0  # bytes of the file as the server wrote it

    @property
    def file(self) -> str:
        return f"{PREFIX}{self.id}.bin"


class SlotFiles:
    """The files of ``path``; ``counted`` hears ``index_failed``."""

    def __init__(self, path: Path, counted: Callable[[str], None]) -> None:
        self.path, self.counted = path, counted
        self.log = structlog.get_logger()
        self._lock: int | None = None

    def claim(self) -> None:
        """Take the directory for this process (see the module's docstring), or adopt
        the lock `kvroute serve` took before starting anything (proxy/instance.py): a
        ConfigError naming it if another kvroute holds it, or it cannot be locked."""
        fd = adopt(self.path)
        self._lock = fd if fd is not None else lock(self.path, "disk tier", DISK_FIX)

    def release(self) -> None:
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def size(self, file: str) -> int:
        try:
            return (self.path / file).stat().st_size
        except OSError:
            return 0

    def unlink(self, file: str) -> None:
        with contextlib.suppress(OSError):
            (self.path / file).unlink()

    def private(self, file: str) -> None:
        """0600 (a server of another user wrote it: left as it is)."""
        with contextlib.suppress(OSError):
            (self.path / file).chmod(0o600)

    def over_budget(self, saved: Iterable[Saved], budget: float) -> list[int]:
        """The entries to drop, oldest first, to bring the files within ``budget``
        bytes."""
        by_age = sorted(saved, key=lambda e: e.saved_at)
        total = sum(self.size(e.file) for e in by_age)
        out: list[int] = []
        while by_age and total > budget:
            oldest = by_age.pop(0)
            total -= self.size(oldest.file)
            out.append(oldest.id)
        return out

    def sweep(self, named: set[str]) -> None:
        """Remove the slot files of the directory that are not in ``named``."""
        with contextlib.suppress(OSError):
            for f in self.path.glob(f"{PREFIX}*.bin"):
                if f.name not in named:
                    self.unlink(f.name)

    def write(self, saved: Iterable[Saved]) -> None:
        doc = [{"id": e.id, "backend": e.backend, "slot": e.slot, "saved_at": e.saved_at,
                "model": e.model, "size": e.size,
                "tokens": base64.b64encode(e.tokens).decode()}
               for e in saved]
        tmp = self.path / (INDEX + ".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f)
            os.replace(tmp, self.path / INDEX)
        except OSError as err:
            # a full disk, the directory removed: the files serve this run all the same,
            # and the next start trusts only the last index written (files no entry of
            # it names are removed, entries whose file is gone are dropped)
            self.unlink(tmp.name)
            self.counted("index_failed")
            self.log.warning("slot.index_failed", path=str(tmp), error=str(err))

    def load(self) -> dict[int, Saved]:
        """The index a previous run left (entries whose file is gone are dropped, files
        no entry names are deleted). An entry that does not parse is skipped alone; so is
        one without a model or size (an older kvroute's: what computed its KV is
        unknown)."""
        out: dict[int, Saved] = {}
        try:
            doc = json.loads((self.path / INDEX).read_text())
        except (OSError, ValueError):
            doc = None  # none yet, or unreadable: start empty
        for d in doc if isinstance(doc, list) else ():
            try:
                e = Saved(int(d["id"]), str(d["backend"]), int(d["slot"]),
                          base64.b64decode(d["tokens"], validate=True),
                          float(d["saved_at"]), str(d["model"]), int(d["size"]))
            except (ValueError, KeyError, TypeError):  # (binascii.Error is a ValueError)
                continue
            if (self.path / e.file).is_file() and len(e.tokens) % 4 == 0:
                out[e.id] = e
        self.sweep({e.file for e in out.values()})
        return out
