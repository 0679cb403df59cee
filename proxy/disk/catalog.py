"""The saved slots of one directory of the disk tier, as its store and the routers know
them: each file's record (`saved`), the backends each router may restore it into, the
file's removal when it is dropped, and the budget (`max_gib`) that ages files out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from proxy.config.disk import MAX_DIRECTORIES
from proxy.disk.files import SlotFiles
from proxy.disk.records import Saved
from proxy.routing.router import Router

__all__ = ["Catalog"]

# The router's entries of every directory are told apart by the directory's number: entry
# ids are a directory's own (its file names)
_DIRS = MAX_DIRECTORIES


class Catalog:
    """The files of ``files``'s directory, opened within ``max_gib``, for ``routers``
    (``router_of`` a backend: the one router, given alone); ``number``: the directory's
    among those of the tier (below ``MAX_DIRECTORIES``)."""

    def __init__(self, files: SlotFiles, max_gib: float, routers: Router | Sequence[Router],
                 router_of: Callable[[str], Router | None] | None = None,
                 number: int = 0) -> None:
        assert 0 <= number < _DIRS
        self.files, self.max_gib, self.number = files, max_gib, number
        self.routers = [routers] if isinstance(routers, Router) else list(routers)
        only = self.routers[0] if len(self.routers) == 1 else None
        self.router_of = router_of or (lambda _: only)
        self.saved: dict[int, Saved] = files.open(max_gib * (1 << 30))
        self._next = max(files.highest, *self.saved, 0) + 1  # (no name given twice)
        self._offered: dict[int, frozenset[str]] = {}  # entry -> who the routers offer it to

    # ------------------------------------------------------------ reading
    def latest(self, backend: str, slot: int, model: str) -> Saved | None:
        """The newest save of ``backend``'s ``slot`` by ``model``."""
        mine = [e for e in self.saved.values()
                if (e.backend, e.slot, e.model) == (backend, slot, model)]
        return max(mine, key=lambda e: e.saved_at, default=None)

    def has(self, backend: str, model: str | None) -> bool:
        """Are there saves of ``backend`` by ``model``?"""
        return any(e.backend == backend and e.model == model for e in self.saved.values())

    def foreign(self, backend: str, model: str | None) -> int:
        """The saves of ``backend`` by another model than ``model``."""
        return sum(e.backend == backend and e.model != model for e in self.saved.values())

    def named(self, file: str) -> Saved | None:
        return next((e for e in self.saved.values() if e.file == file), None)

    def new_id(self) -> int:
        """An id no file of the directory had (nor its quarantine, nor its index)."""
        self._next += 1
        return self._next - 1

    # ------------------------------------------------------------ changing
    def offer(self, models: Mapping[str, str]) -> None:
        """Offer each file to the backends that run its model (``models``: backend ->
        the model it runs) through their routers, and to no other."""
        for e in self.saved.values():
            self._offer(e, models)

    def add(self, e: Saved, models: Mapping[str, str]) -> None:
        """A new save: offered as `offer` does, and the oldest files aged out of the
        budget."""
        self.saved[e.id] = e
        self._offer(e, models)
        for entry_id in self.files.trim(self.saved.values(), self.max_gib * (1 << 30)):
            self.drop(entry_id, f"over the budget (kv_disk.max_gib {self.max_gib})")
        # a save given up (cancelled, timed out) may have been written after all
        self.files.sweep()

    def drop(self, entry_id: int, reason: str, lost: bool = False,
             aside: bool = False) -> None:
        """Forget entry ``entry_id`` and remove its file, logged with ``reason`` (``lost``:
        a file that could not be used, not one replaced or aged out; ``aside``: moved to
        the quarantine instead, a file whole but not what its record says)."""
        entry = self.saved.pop(entry_id, None)
        self._offered.pop(entry_id, None)
        for r in self.routers:
            r.disk.drop(self.key(entry_id))
        if entry is not None and aside:
            self.files.quarantine(entry.file, reason)
        elif entry is not None:
            self.files.remove(entry.file, reason, warn=lost)

    async def commit(self) -> None:
        """Write the index of the files as they are now."""
        await self.files.commit(self.saved)

    def key(self, entry_id: int) -> int:
        """The routers' name for an entry of this directory."""
        return entry_id * _DIRS + self.number

    def _offer(self, e: Saved, models: Mapping[str, str]) -> None:
        where = frozenset(n for n, m in models.items() if m == e.model)
        if self._offered.get(e.id) == where:
            return
        self._offered[e.id] = where
        for r in self.routers:
            mine = frozenset(n for n in where if self.router_of(n) is r)
            if mine:
                r.disk.add(self.key(e.id), e.file, e.tokens, mine)
            else:
                r.disk.drop(self.key(e.id))
