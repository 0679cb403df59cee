"""One directory of the disk tier: its slot files, their sidecars and the index.

File names are kvroute's own (``kvroute-<id>.bin``: no client input reaches a path), and
so are the sidecar beside each (``kvroute-<id>.json``) and the index
(``kvroute-index.json``): what each file holds (backend, slot, the token ids the router
knew the slot to hold, the model that computed it, its size and token count as the server
wrote it; slot_records.py). Every name kvroute writes starts with ``kvroute``, and
nothing else of the directory is read or touched: a directory an operator's llama-server
also uses keeps the operator's own files, an ``index.json`` of theirs too.

The files are the users' data, and a start keeps every one it can: an index that does not
parse is rebuilt from the sidecars, a file the index does not name but its sidecar
describes (kvroute stopped between the two) is taken back, and one that nothing
describes is moved to ``kvroute-quarantine/``, never deleted. A file is removed only when
no server could load it (truncated, no sequence-state header), when it is over the budget
(``max_gib``: the quarantined ones first, then the oldest saves), or when it is replaced
or refused; every removal is logged with its reason. The sidecars and the index are
written whole or not at all (a temporary file, fsync, rename, fsync of the directory).

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

import asyncio
import contextlib
import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import structlog

from backends.client import BackendDown, BadResponse
from proxy.forwarding.slot_records import (
    HEADER,
    PREFIX,
    Found,
    Header,
    Saved,
    encode,
    header,
    read_index,
    read_sidecar,
    reconcile,
)
from proxy.instance import DISK_FIX, adopt, lock

__all__ = ["INDEX", "PREFIX", "QUARANTINE", "Saved", "SlotFiles", "server_error"]

INDEX = "kvroute-index.json"
QUARANTINE = "kvroute-quarantine"
_NUMBERED = re.compile(rf"{PREFIX}(\d+)\.(bin|json)")
_GAVE_UP_KEPT = 4096  # names of saves given up, remembered for the sweep


class SlotFiles:
    """The files of ``path``; ``counted`` hears ``index_failed``."""

    def __init__(self, path: Path, counted: Callable[[str], None]) -> None:
        self.path, self.counted = path, counted
        self.log = structlog.get_logger()
        self._lock: int | None = None
        self._index_order = asyncio.Lock()  # index writes, in the order they are asked
        self._index_write = threading.Lock()  # (one asked for left behind in a thread)
        self._gave_up: dict[str, None] = {}  # saves given up: the server may write later
        self.highest = 0  # the highest id any name of the directory carries
        self.quarantined = 0  # files in the quarantine now
        self.tally = dict.fromkeys(("saved", "save_failed", "restore_failed", "removed",
                                    "remove_failed", "index_failed"), 0)
        self.last_failure: dict[str, Any] | None = None

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

    # ------------------------------------------------------------ what is told
    def failed(self, what: str, reason: str, fix: str, **fields: Any) -> None:
        """A save, restore or removal that failed: one warning, and the status's last
        failure."""
        if f"{what}_failed" in self.tally:
            self.tally[f"{what}_failed"] += 1
        self.last_failure = {"what": what, "reason": reason, "fix": fix,
                             "at": round(time.time(), 3), **fields}
        self.log.warning(f"slot.{what}_failed", path=str(self.path), reason=reason,
                         fix=fix, **fields)

    def status(self) -> dict[str, Any]:
        """This run's saves, failures and removals, the files in the quarantine now, and
        the last failure (what, reason, fix, at)."""
        return {**self.tally, "quarantined": self.quarantined,
                "last_failure": self.last_failure}

    def diagnose(self, file: str, need: int = 0) -> tuple[str, str] | None:
        """What in the directory keeps ``file`` (``need`` bytes) from being written there,
        as kvroute sees it, and the fix (None: nothing seen; a server of another user
        may see it otherwise)."""
        where = self.path / file
        if not self.path.is_dir():
            return (f"directory missing: {self.path}", f"create {self.path}, or declare "
                    "the directory the server writes to (its --slot-save-path)")
        if not os.access(self.path, os.W_OK | os.X_OK):
            return (f"directory not writable: {self.path}", "give the user llama-server "
                    f"and kvroute run as write access to {self.path}")
        if where.exists() and not where.is_file():
            return (f"not a file in the way: {where}", f"remove {where}")
        with contextlib.suppress(OSError):
            st = os.statvfs(self.path)
            free = st.f_bavail * st.f_frsize
            if free < max(need, 1 << 20):
                return (f"disk full: {free >> 20} MiB free in {self.path}",
                        "free space there, or lower kv_disk.max_gib")
        return None

    def saved_as(self, got: object, want: int, held: bool, file: str, need: int,
                 spilled: bool) -> Header | tuple[str, str]:
        """The header of ``file``, saved by a server that answered ``got``; or why the
        save failed, and the fix. ``want``: the tokens the router knew the slot to hold;
        ``held``: whether it still does; ``need``: the bytes it was thought to take."""
        if isinstance(got, BackendDown):
            if got.timed_out and spilled:
                return (f"no answer within a spill's bound: {got.reason}", "none: the "
                        "request went on without it (the spills after it are rarer)")
            return (f"no answer: {got.reason}", f"a faster disk for {self.path}" if
                    got.timed_out else "see the server's log (it went away)")
        if isinstance(got, BadResponse):
            seen = self.diagnose(file, need)
            return (f"server: {server_error(got)}" + (f"; {seen[0]}" if seen else ""),
                    seen[1] if seen else "give the user llama-server runs as write "
                    f"access to {self.path} (its --slot-save-path), with free space; "
                    "see the server's log")
        if not isinstance(got, int) or got < want or not held:
            return ("the slot's next turn took it during the save", "none: the next "
                    "save holds what it holds then")
        if not self.size(file):
            return (f"the server saved it, but not in {self.path}", "declare the "
                    "directory the server writes to (its --slot-save-path) as its "
                    "slot_save_path")
        head = self.header(file)
        if isinstance(head, str):
            return (f"the file is not a sequence state: {head}", "a llama-server that "
                    "writes llama.cpp's sequence state")
        return head

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
        if (m := _NUMBERED.fullmatch(file)) is not None:
            self.unlink(f"{PREFIX}{m[1]}.json")
        self.tally["removed"] += 1
        (self.log.warning if warn else self.log.info)(
            "slot.file_removed", path=str(self.path), file=file, reason=reason)

    def abandon(self, file: str) -> None:
        """A save given up: the server may have written ``file`` whole or in part, or may
        write it still (a save cancelled or timed out runs on in the server)."""
        self.unlink(file)
        self._gave_up[file] = None
        while len(self._gave_up) > _GAVE_UP_KEPT:
            del self._gave_up[next(iter(self._gave_up))]

    def sweep(self) -> None:
        """Remove the files of saves given up that were written after all (no name is
        given twice: none of them is being written again)."""
        for file in [f for f in self._gave_up if (self.path / f).is_file()]:
            self.unlink(file)
            del self._gave_up[file]
            self.tally["removed"] += 1
            self.log.info("slot.file_removed", path=str(self.path), file=file,
                          reason="written by a save given up")

    def trim(self, saved: Iterable[Saved], budget: float) -> list[int]:
        """Bring the files within ``budget`` bytes: the quarantined ones are removed
        first (oldest first); the entries to drop, oldest first."""
        by_age = sorted(saved, key=lambda e: e.saved_at)
        aside = sorted(self._quarantined(), key=lambda p: p[1])
        total = sum(self.size(e.file) for e in by_age) + sum(s for _, _, s in aside)
        for path, _, size in aside:
            if total <= budget:
                break
            with contextlib.suppress(OSError):
                path.unlink()
                total -= size
                self.quarantined -= ".bin" in path.name
                self.tally["removed"] += 1
                self.log.info("slot.file_removed", path=str(self.path),
                              file=f"{QUARANTINE}/{path.name}", reason="over the budget")
        out: list[int] = []
        while by_age and total > budget:
            oldest = by_age.pop(0)
            total -= self.size(oldest.file)
            out.append(oldest.id)
        return out

    def _quarantined(self) -> list[tuple[Path, float, int]]:
        """(path, mtime, size) of each file in the quarantine."""
        out = []
        with contextlib.suppress(OSError):
            for f in (self.path / QUARANTINE).iterdir():
                with contextlib.suppress(OSError):
                    st = f.lstat()
                    if f.is_file():
                        out.append((f, st.st_mtime, st.st_size))
        return out

    def quarantine(self, file: str, reason: str) -> None:
        """Move ``file`` (and its sidecar) aside: kept, never sent to a server."""
        aside = self.path / QUARANTINE
        try:
            aside.mkdir(mode=0o700, exist_ok=True)
            m = _NUMBERED.fullmatch(file)
            for name in (file, f"{PREFIX}{m[1]}.json") if m else (file,):
                if (self.path / name).is_file():
                    to, n = aside / name, 0
                    while to.exists():
                        n += 1
                        to = aside / f"{name}.{n}"
                    os.replace(self.path / name, to)
                    self.quarantined += name == file
        except OSError as err:
            self.failed("remove", f"cannot move {file} to {aside}: {err.strerror}",
                        f"give the user kvroute runs write access to {self.path}",
                        file=file)
            return
        self.log.warning("slot.file_quarantined", path=str(self.path), file=file,
                         reason=reason, to=str(aside), fix="see what the file is; "
                         "remove it when done (it counts toward kv_disk.max_gib)")

    # ------------------------------------------------------------ writing
    def _replace(self, name: str, data: bytes) -> None:
        """``name`` holds ``data``, whole, or is left as it was (OSError)."""
        tmp = self.path / (name + ".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path / name)
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            self.unlink(tmp.name)
            raise

    def header(self, file: str) -> Header | str:
        """``file``'s sequence-state header, or why it has none."""
        try:
            with (self.path / file).open("rb") as f:
                return header(f.read(HEADER.size))
        except OSError as err:
            return f"unreadable: {err.strerror}"

    def describe(self, e: Saved) -> str | None:
        """Write ``e``'s sidecar; why it could not be (None: written)."""
        try:
            self._replace(e.sidecar, json.dumps(encode(e)).encode())
        except OSError as err:
            return f"{err.strerror}: {self.path / e.sidecar}"
        return None

    def write(self, saved: Iterable[Saved]) -> None:
        doc = json.dumps([encode(e) for e in saved]).encode()
        try:
            with self._index_write:
                self._replace(INDEX, doc)
        except OSError as err:
            # a full disk, the directory removed: the files serve this run all the same,
            # and the next start finds them by their sidecars
            seen = self.diagnose(INDEX + ".tmp")
            self.counted("index_failed")
            self.failed("index", f"{err.strerror}: {self.path / INDEX}",
                        seen[1] if seen else "free space in the directory",
                        note="the files are described by their sidecars meanwhile")

    async def commit(self, saved: Mapping[int, Saved]) -> None:
        """Write the index of ``saved`` as it is when the write starts, in a thread (an
        fsync would hold up every request), after those asked for before."""
        async with self._index_order:
            entries = list(saved.values())
            await asyncio.to_thread(self.write, entries)

    # ------------------------------------------------------------ starting
    def load(self, budget: float) -> dict[int, Saved]:
        """What a previous run left, reconciled with the directory (the module's
        docstring), within ``budget`` bytes."""
        index, unreadable = read_index(self.path / INDEX)
        found, sidecars = self._scan()
        plan = reconcile(index, found)
        for file, why in plan.dropped:
            self.log.warning("slot.entry_dropped", path=str(self.path), file=file,
                             reason=why)
        for file, why in plan.remove:
            self.remove(file, why, warn=True)
        for file, why in plan.quarantine:
            self.quarantine(file, why)
        for i in plan.describe:
            if (why := self.describe(plan.keep[i])) is not None:
                self.log.warning("slot.sidecar_failed", path=str(self.path),
                                 file=plan.keep[i].file, reason=why)
        for i in sorted(plan.keep.keys() - index.keys()) if index is not None else ():
            self.log.info("slot.file_adopted", path=str(self.path), file=plan.keep[i].file,
                          reason="the index does not name it; its sidecar describes it")
        for name in sidecars:
            if not (self.path / name.replace(".json", ".bin")).exists():
                self.unlink(name)  # (its file is gone)
        self.quarantined = sum(".bin" in p.name for p, _, _ in self._quarantined())
        if unreadable or (index is None and found):
            self.log.warning("slot.index_rebuilt", path=str(self.path),
                             reason=unreadable or "no index", kept=len(plan.keep),
                             quarantined=len(plan.quarantine), removed=len(plan.remove))
        for i in self.trim(plan.keep.values(), budget):
            self.remove(plan.keep.pop(i).file, "over the budget")
        if (plan.keep.keys() != (index or {}).keys() or plan.describe or unreadable
                or (index is None and found)):
            self.write(plan.keep.values())
        return plan.keep

    def _scan(self) -> tuple[list[Found], set[str]]:
        """The slot files of the directory, and the names of its sidecars (kvroute's
        temporary files left by a stop mid-write are removed; a file that cannot be
        read is left alone)."""
        found, sidecars = [], set()
        names = sorted(os.listdir(self.path))
        aside: list[str] = []
        with contextlib.suppress(OSError):
            aside = os.listdir(self.path / QUARANTINE)
        self.highest = max((int(m[1]) for n in names + aside
                            if (m := re.match(rf"{PREFIX}(\d+)\.", n))), default=0)
        for name in names:
            where, m = self.path / name, _NUMBERED.fullmatch(name)
            if name.startswith(PREFIX) and name.endswith(".tmp"):
                self.unlink(name)
            elif m is not None and m[2] == "json":
                sidecars.add(name)
            elif name.startswith(PREFIX) and name.endswith(".bin") and where.is_file():
                try:
                    with where.open("rb") as f:
                        head, size = f.read(HEADER.size), os.fstat(f.fileno()).st_size
                except OSError as err:
                    self.log.warning("slot.file_unreadable", path=str(self.path),
                                     file=name, reason=err.strerror, fix="give the user "
                                     f"kvroute runs read access to {where}")
                    continue
                found.append(Found(name, int(m[1]) if m else None, size, header(head),
                                   read_sidecar(self.path / f"{PREFIX}{m[1]}.json")
                                   if m else "no sidecar"))
        return found, sidecars


def server_error(got: BadResponse) -> str:
    """llama-server's error message in ``got`` (its body, if it is not one)."""
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        message = json.loads(got.body)["error"]["message"]
        if isinstance(message, str):
            return message[:200]
    return f"HTTP {got.status}: {got.body[:200]}"
