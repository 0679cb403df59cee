"""What a start keeps of a directory of the disk tier (`Start`, for SlotFiles.load,
files.py): the index and the sidecars read, the files found, and the plan `reconcile`
makes of them (records.py) carried out, each change logged.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Protocol

import structlog

from proxy.config.fields import ConfigError
from proxy.disk.directory import Index, Quarantine
from proxy.disk.records import (
    INDEX,
    PREFIX,
    QUARANTINE,
    Found,
    Plan,
    Saved,
    examine,
    file_name,
    highest,
    numbered,
    read_index,
    read_sidecar,
    reconcile,
)


class Directory(Protocol):
    """What a start does with a directory's files (SlotFiles, files.py)."""

    path: Path
    aside: Quarantine
    index: Index

    def remove(self, file: str, reason: str, warn: bool = False) -> None: ...

    def describe(self, e: Saved) -> str | None: ...

    def trim(self, saved: Iterable[Saved], budget: float,
             spare: Collection[str] = ()) -> list[int]: ...

    def unlink(self, file: str) -> None: ...


class Start:
    """The start of ``files``'s directory: `load` once; ``highest``, the highest id its
    names (the quarantine's too) or its index carry, once loaded."""

    def __init__(self, files: Directory) -> None:
        self.files, self.path = files, files.path
        self.log = structlog.get_logger()
        self.highest = 0

    def load(self, budget: float) -> dict[int, Saved]:
        """What a previous run left, reconciled with the directory (files.py's
        docstring), within ``budget`` bytes; the files this start puts aside neither
        count toward it nor go for it (the operator has their warning first)."""
        index, unreadable = read_index(self.path / INDEX)
        found, sidecars = self._scan(index)
        plan = reconcile(index, found)
        aside = self._apply(plan, index)
        for i in sidecars:
            if not (self.path / file_name(i)).exists():
                self.files.unlink(file_name(i, "json"))  # (its file is gone)
        self.files.aside.recount()
        if unreadable or (index is None and found):
            self.log.warning("slot.index_rebuilt", path=str(self.path),
                             reason=unreadable or "no index", kept=len(plan.keep),
                             quarantined=len(plan.quarantine), removed=len(plan.remove))
        for i in self.files.trim(plan.keep.values(), budget, aside):
            self.files.remove(plan.keep.pop(i).file, "over the budget")
        if plan.keep != (index or {}) or unreadable:
            self.files.index.write_now(list(plan.keep.values()))
        return plan.keep

    def _apply(self, plan: Plan, index: Mapping[int, Saved] | None) -> set[str]:
        """Carry out ``plan``, each change logged; the names it put in the quarantine."""
        for file, why in plan.dropped:
            self.log.warning("slot.entry_dropped", path=str(self.path), file=file,
                             reason=why)
        for file, why in plan.remove:
            self.files.remove(file, why, warn=True)
        aside = {n for file, why in plan.quarantine for n in self.files.aside.put(file, why)}
        for i in plan.describe:
            if (why := self.files.describe(plan.keep[i])) is not None:
                self.log.warning("slot.sidecar_failed", path=str(self.path),
                                 file=plan.keep[i].file, reason=why)
        for i in sorted(plan.keep.keys() - index.keys()) if index is not None else ():
            self.log.info("slot.file_adopted", path=str(self.path), file=plan.keep[i].file,
                          reason="the index does not name it; its sidecar describes it")
        return aside

    def _scan(self, index: Mapping[int, Saved] | None) -> tuple[list[Found], set[int]]:
        """The slot files of the directory, and the ids of its sidecars (kvroute's
        temporary files left by a stop mid-write are removed; a file that cannot be
        read is left alone). A ConfigError if the directory cannot be read."""
        try:
            names = sorted(os.listdir(self.path))
        except OSError as err:
            raise ConfigError(f"disk tier: cannot read {self.path}: {err.strerror} (fix: "
                              f"give the user kvroute runs as read access to "
                              f"{self.path})") from err
        aside: list[str] = []
        with contextlib.suppress(OSError):
            aside = os.listdir(self.path / QUARANTINE)
        self.highest = highest(names + aside, index)
        found: list[Found] = []
        sidecars: set[int] = set()
        for name in names:
            n = numbered(name)
            if name.startswith(PREFIX) and name.endswith(".tmp"):
                self.files.unlink(name)
            elif n is not None and n[1] == "json":
                sidecars.add(n[0])
            elif name.startswith(PREFIX) and name.endswith(".bin") and \
                    (self.path / name).is_file() and (f := self._found(name, n)) is not None:
                found.append(f)
        return found, sidecars

    def _found(self, name: str, n: tuple[int, str] | None) -> Found | None:
        """Slot file ``name`` (``n``: its id, if kvroute gives its name) as it is found,
        or None if it cannot be read (logged)."""
        try:
            size, head = examine(self.path / name)
        except OSError as err:
            self.log.warning("slot.file_unreadable", path=str(self.path), file=name,
                             reason=err.strerror, fix="give the user kvroute runs read "
                             f"access to {self.path / name}")
            return None
        if n is None:
            return Found(name, None, size, head)
        return Found(name, n[0], size, head, read_sidecar(self.path / file_name(n[0], "json")))
