"""One directory of the disk tier: its slot files, their sidecars and the index.

File names are kvroute's own (``kvroute-<id>.bin``: no client input reaches a path), and
so are the sidecar beside each (``kvroute-<id>.json``) and the index
(``kvroute-index.json``): what each file holds (backend, slot, the token ids the router
knew the slot to hold, the model that computed it, its size and token count as the server
wrote it; records.py). Every name kvroute writes starts with ``kvroute``, and
nothing else of the directory is read or touched: a directory an operator's llama-server
also uses keeps the operator's own files, an ``index.json`` of theirs too.

The files are the users' data, and a start keeps every one it can: an index that does not
parse is rebuilt from the sidecars, a file the index does not name but its sidecar
describes (kvroute stopped between the two) is taken back, and one that nothing
describes, or that is whole but not what its record says, is moved to
``kvroute-quarantine/``: not deleted unless the budget needs the room, and never by the
start that put it there (each removal from it is a warning naming the file). A file is
removed only when no server could load it (truncated, no sequence-state header), when it
is over the budget (``max_gib``: the quarantined ones first, then the oldest saves), or
when it is replaced or refused; every removal is logged with its reason. The sidecars
and the index are written whole or not at all (a temporary file, fsync, rename, fsync of
the directory).

One kvroute process owns a directory: it takes an exclusive lock on ``kvroute.lock``
there (flock; the kernel lets it go when the process ends, even by SIGKILL) before
reading the index, and holds it until it closes the store. Two kvroutes declaring one
shared directory would each write the index without the other's entries and quarantine
or budget out the other's files: the second is refused at start, naming the directory.
Using the directory read-only in the second instead would not hold either: the owner
drops and replaces files (budget, a newer save of a conversation) at any moment, so a
reader's index goes stale under it and a restore it sends can load a file the owner is
replacing; and the servers of the second would save nothing, which is the tier's whole
point for them.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

import structlog

from backends.client import BackendDown, BadResponse
from proxy.disk.directory import Index, Quarantine, Tally, diagnose
from proxy.disk.records import (
    Header,
    Saved,
    encode,
    examine,
    file_name,
    numbered,
    verdict,
    write_whole,
)
from proxy.disk.start import Start
from proxy.instance import DISK_FIX, adopt, lock

__all__ = ["SlotFiles", "server_error"]

_GAVE_UP_KEPT = 4096  # names of saves given up, remembered for the sweep
_GIVEN_UP = "written by a save given up"


class SlotFiles:
    """The files of ``path``; ``counted`` hears ``index_failed``. Its account of this run,
    its quarantine and its index are directory.py's; its start (`open`, `load`) is
    start.py's."""

    def __init__(self, path: Path, counted: Callable[[str], None]) -> None:
        self.path = path
        self.log = structlog.get_logger()
        self._lock: int | None = None
        self.tally = Tally(path)
        self.aside = Quarantine(path, self.tally)
        self.index = Index(path, self.tally, counted)
        self._gave_up: dict[str, None] = {}  # saves given up: the server may write later
        self.highest = 0  # the highest id the directory's names or its index carry

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
        """What a previous run left, reconciled with the directory, within ``budget``
        bytes (start.py)."""
        start = Start(self)
        kept = start.load(budget)
        self.highest = start.highest
        return kept

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

    async def close(self) -> None:
        """Let the directory go once no index write is under way (one left running by a
        cancelled caller would otherwise write into a directory another kvroute owns)."""
        await self.index.settle()
        self.release()

    def _size(self, file: str) -> int:
        """``file``'s bytes toward the budget (one that cannot be read takes none)."""
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

    # ------------------------------------------------------------ what is told
    def count(self, what: str) -> None:
        """One more ``what`` (a key of the status) in this run."""
        self.tally.count(what)

    def failed(self, what: str, reason: str, fix: str, **fields: Any) -> None:
        """A save, restore or removal that failed: one warning, and the status's last
        failure."""
        self.tally.failed(what, reason, fix, **fields)

    def status(self) -> dict[str, Any]:
        """This run's saves, failures and removals, the files in the quarantine now, and
        the last failure (what, reason, fix, at)."""
        return {**self.tally.counts, "quarantined": self.aside.count,
                "last_failure": self.tally.last_failure}

    def saved_as(self, got: object, held: bool, e: Saved, need: int, spilled: bool
                 ) -> tuple[str, str] | None:
        """Why the save of ``e`` that the server answered with ``got`` failed, and the
        fix; None: saved, and ``e`` has the file's size and token counts. ``held``: the
        slot still holds ``e.tokens``; ``need``: the bytes it was thought to take."""
        if isinstance(got, BackendDown):
            if got.timed_out and spilled:
                return (f"no answer within a spill's bound: {got.reason}", "none: the "
                        "request went on without it (the spills after it are rarer)")
            return (f"no answer: {got.reason}", f"a faster disk for {self.path}" if
                    got.timed_out else "see the server's log (it went away)")
        if isinstance(got, BadResponse):
            seen = diagnose(self.path, e.file, need)
            return (f"server: {server_error(got)}" + (f"; {seen[0]}" if seen else ""),
                    seen[1] if seen else "give the user llama-server runs write "
                    f"access to {self.path} (its --slot-save-path), with free space; "
                    "see the server's log")
        if not isinstance(got, int) or got < len(e.tokens) // 4 or not held:
            return ("the slot's next turn took it during the save", "none: the next "
                    "save holds what it holds then")
        return self._written(e, got)

    def _written(self, e: Saved, n: int) -> tuple[str, str] | None:
        """`saved_as` once the server said it saved ``n`` tokens to ``e``'s file."""
        try:
            size, head = examine(self.path / e.file)
        except FileNotFoundError:
            return (f"the server saved it, but not in {self.path}", "declare the "
                    "directory the server writes to (its --slot-save-path) as its "
                    "slot_save_path")
        except OSError as err:
            return (f"cannot read the file: {err.strerror}", "give the user kvroute runs "
                    f"read access to {self.path}")
        if (judged := verdict(size, head, None)) is not None:
            return (f"the file cannot be restored: {judged[1]}", "a llama-server that "
                    "writes llama.cpp's sequence state; check the disk")
        assert isinstance(head, Header)  # (a file with no header has a verdict)
        e.size, e.n, e.count = size, n, head.count
        self.private(e.file)
        return None

    # ------------------------------------------------------------ reading
    def judge(self, e: Saved) -> tuple[str, str] | None:
        """`verdict` on ``e``'s file as it is now, or ("keep", why): it cannot be read,
        which says nothing of the file."""
        try:
            size, head = examine(self.path / e.file)
        except FileNotFoundError:
            return "remove", "its file is gone"
        except OSError as err:
            return "keep", f"cannot read the file: {err.strerror}"
        return verdict(size, head, e)

    # ------------------------------------------------------------ removing
    def remove(self, file: str, reason: str, warn: bool = False) -> None:
        """Remove ``file`` and its sidecar, logged with ``reason`` (``warn``: a file lost,
        not one replaced or aged out)."""
        try:
            (self.path / file).unlink()
        except FileNotFoundError:
            pass
        except OSError as err:
            self.failed("remove", f"{err.strerror}: {self.path / file}", "give the "
                        f"user kvroute runs write access to {self.path}", file=file)
            return
        if (n := numbered(file)) is not None:
            self.unlink(file_name(n[0], "json"))
        self.tally.count("removed")
        (self.log.warning if warn else self.log.info)(
            "slot.file_removed", path=str(self.path), file=file, reason=reason)

    def abandon(self, file: str) -> None:
        """A save given up: the server may have written ``file`` whole or in part, or may
        write it still (a save cancelled or timed out runs on in the server)."""
        self._remove_given_up(file)
        self._gave_up[file] = None
        while len(self._gave_up) > _GAVE_UP_KEPT:
            del self._gave_up[next(iter(self._gave_up))]

    def sweep(self) -> None:
        """Remove the files of saves given up that were written after all (no name is
        given twice: none of them is being written again)."""
        for file in [f for f in self._gave_up if (self.path / f).is_file()]:
            self._remove_given_up(file)
            del self._gave_up[file]

    def _remove_given_up(self, file: str) -> None:
        try:
            (self.path / file).unlink()
        except OSError:  # (not written, or not yet: the sweep looks again)
            return
        self.tally.count("removed")
        self.log.info("slot.file_removed", path=str(self.path), file=file,
                      reason=_GIVEN_UP)

    def trim(self, saved: Iterable[Saved], budget: float,
             spare: Collection[str] = ()) -> list[int]:
        """Bring the files within ``budget`` bytes: the quarantined ones are removed
        first (oldest first), but for ``spare`` (names in the quarantine), which neither
        count nor go; the entries to drop, oldest first."""
        by_age = sorted(saved, key=lambda e: e.saved_at)
        aside = sorted((q for q in self.aside.files() if q[0].name not in spare),
                       key=lambda q: q[1])
        total = sum(self._size(e.file) for e in by_age) + sum(s for _, _, s in aside)
        for path, _, size in aside:
            if total <= budget:
                break
            if self.aside.remove(path, "over the budget"):
                total -= size
        out: list[int] = []
        while by_age and total > budget:
            oldest = by_age.pop(0)
            total -= self._size(oldest.file)
            out.append(oldest.id)
        return out

    def quarantine(self, file: str, reason: str) -> list[str]:
        """Move ``file`` (and its sidecar) to the quarantine (`Quarantine.put`)."""
        return self.aside.put(file, reason)

    # ------------------------------------------------------------ writing
    def describe(self, e: Saved) -> str | None:
        """Write ``e``'s sidecar; why it could not be (None: written)."""
        try:
            write_whole(self.path, e.sidecar, json.dumps(encode(e)).encode())
        except OSError as err:
            return f"{err.strerror}: {self.path / e.sidecar}"
        return None

    async def commit(self, saved: Mapping[int, Saved]) -> None:
        """Write the index of ``saved`` (`Index.commit`)."""
        await self.index.commit(saved)


def server_error(got: BadResponse) -> str:
    """llama-server's error message in ``got`` (its body, if it is not one)."""
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        message = json.loads(got.body)["error"]["message"]
        if isinstance(message, str):
            return message[:200]
    return f"HTTP {got.status}: {got.body[:200]}"
