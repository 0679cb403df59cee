"""What a start keeps of a directory of the disk tier (`Starting.open`, a part of
SlotFiles, files.py): the directory taken, the index and the sidecars read, the files
found, and the plan `reconcile` makes of them (records.py) carried out, each change
logged.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

from proxy.config.fields import ConfigError
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


class Starting:
    """SlotFiles's start (see files.py for the state below)."""

    path: Path
    log: Any
    highest: int
    quarantined: int
    remove: Callable[..., None]
    quarantine: Callable[[str, str], list[str]]
    describe: Callable[[Saved], str | None]
    trim: Callable[[Iterable[Saved], float, Collection[str]], list[int]]
    unlink: Callable[[str], None]
    _quarantined: Callable[[], list[tuple[Path, float, int]]]
    _write: Callable[[list[Saved]], OSError | None]
    _index_failed: Callable[[OSError | None], None]
    claim: Callable[[], None]
    release: Callable[[], None]

    def open(self, budget: float) -> dict[int, Saved]:
        """Take the directory (`claim`: before the index is read, which another kvroute
        may be writing), then `load` it; a load that fails lets the directory go."""
        self.claim()
        try:
            return self.load(budget)
        except BaseException:
            self.release()
            raise

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
                self.unlink(file_name(i, "json"))  # (its file is gone)
        self.quarantined = sum(".bin" in p.name for p, _, _ in self._quarantined())
        if unreadable or (index is None and found):
            self.log.warning("slot.index_rebuilt", path=str(self.path),
                             reason=unreadable or "no index", kept=len(plan.keep),
                             quarantined=len(plan.quarantine), removed=len(plan.remove))
        for i in self.trim(plan.keep.values(), budget, aside):
            self.remove(plan.keep.pop(i).file, "over the budget")
        if plan.keep != (index or {}) or unreadable:
            self._index_failed(self._write(list(plan.keep.values())))
        return plan.keep

    def _apply(self, plan: Plan, index: Mapping[int, Saved] | None) -> set[str]:
        """Carry out ``plan``, each change logged; the names it put in the quarantine."""
        for file, why in plan.dropped:
            self.log.warning("slot.entry_dropped", path=str(self.path), file=file,
                             reason=why)
        for file, why in plan.remove:
            self.remove(file, why, warn=True)
        aside = {n for file, why in plan.quarantine for n in self.quarantine(file, why)}
        for i in plan.describe:
            if (why := self.describe(plan.keep[i])) is not None:
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
                self.unlink(name)
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
