"""The parts of a directory of the disk tier that its files (files.py) and its start
(start.py) share: its account of this run (`Tally`), its quarantine (`Quarantine`), its
index (`Index`), and what keeps a file from being written there (`diagnose`). Each owns
its state; SlotFiles composes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import structlog

from proxy.disk.records import INDEX, QUARANTINE, Saved, encode, file_name, numbered, write_whole

__all__ = ["Index", "Quarantine", "Tally", "diagnose"]

_COUNTED = ("saved", "save_failed", "restore_failed", "removed", "remove_failed",
            "index_failed")


class Tally:
    """What the status tells of ``path`` for this run: its saves, failures and removals
    (`counts`), and the last failure."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.log = structlog.get_logger()
        self.counts = dict.fromkeys(_COUNTED, 0)
        self.last_failure: dict[str, Any] | None = None

    def count(self, what: str) -> None:
        """One more ``what`` (a key of `counts`)."""
        self.counts[what] += 1

    def failed(self, what: str, reason: str, fix: str, **fields: Any) -> None:
        """A save, restore, removal or index write that failed: one warning, and the last
        failure."""
        if f"{what}_failed" in self.counts:
            self.counts[f"{what}_failed"] += 1
        self.last_failure = {"what": what, "reason": reason, "fix": fix,
                             "at": round(time.time(), 3), **fields}
        self.log.warning(f"slot.{what}_failed", path=str(self.path), reason=reason,
                         fix=fix, **fields)


def diagnose(path: Path, file: str, need: int = 0) -> tuple[str, str] | None:
    """What in directory ``path`` keeps ``file`` (``need`` bytes) from being written
    there, as kvroute sees it, and the fix (None: nothing seen; a server of another user
    may see it otherwise)."""
    where = path / file
    if not path.is_dir():
        return (f"directory missing: {path}", f"create {path}, or declare the directory "
                "the server writes to (its --slot-save-path)")
    if not os.access(path, os.W_OK | os.X_OK):
        return (f"directory not writable: {path}", "give the user llama-server and "
                f"kvroute run as write access to {path}")
    if where.exists() and not where.is_file():
        return (f"not a file in the way: {where}", f"remove {where}")
    with contextlib.suppress(OSError):
        st = os.statvfs(path)
        free = st.f_bavail * st.f_frsize
        if free < max(need, 1 << 20):
            return (f"disk full: {free >> 20} MiB free in {path}",
                    "free space there, or lower kv_disk.max_gib")
    return None


class Quarantine:
    """``path``'s quarantine (``kvroute-quarantine/``): files kvroute cannot say what they
    hold, kept aside and never sent to a server. ``count``: the slot files in it now."""

    def __init__(self, path: Path, tally: Tally) -> None:
        self.path, self.tally = path, tally
        self.log = structlog.get_logger()
        self.count = 0

    def recount(self) -> None:
        """Count the slot files in the quarantine as they are now (an operator may have
        removed some since the last run)."""
        self.count = sum(".bin" in p.name for p, _, _ in self.files())

    def files(self) -> list[tuple[Path, float, int]]:
        """(path, mtime, size) of each file in the quarantine."""
        out = []
        with contextlib.suppress(OSError):
            for f in (self.path / QUARANTINE).iterdir():
                with contextlib.suppress(OSError):
                    st = f.lstat()
                    if f.is_file():
                        out.append((f, st.st_mtime, st.st_size))
        return out

    def put(self, file: str, reason: str) -> list[str]:
        """Move ``file`` (and its sidecar) aside: kept, never sent to a server; the names
        they have in the quarantine."""
        aside, moved = self.path / QUARANTINE, []
        n = numbered(file)
        try:
            aside.mkdir(mode=0o700, exist_ok=True)
            for name in (file, file_name(n[0], "json")) if n else (file,):
                if (self.path / name).is_file():
                    to, k = aside / name, 0
                    while to.exists():
                        k += 1
                        to = aside / f"{name}.{k}"
                    os.replace(self.path / name, to)
                    moved.append(to.name)
                    self.count += name == file
        except OSError as err:
            self.tally.failed("remove", f"cannot move {file} to {aside}: {err.strerror}",
                              f"give the user kvroute runs write access to {self.path}",
                              file=file)
            return moved
        self.log.warning("slot.file_quarantined", path=str(self.path), file=file,
                         reason=reason, to=str(aside), fix="see what the file is; "
                         "remove it when done (it counts toward kv_disk.max_gib)")
        return moved

    def remove(self, path: Path, reason: str) -> bool:
        """Remove ``path``, in the quarantine: a warning, as kvroute could not say what it
        held; whether it is gone."""
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as err:
            self.tally.failed("remove", f"{err.strerror}: {path}", "give the user kvroute "
                              f"runs write access to {path.parent}",
                              file=f"{QUARANTINE}/{path.name}")
            return False
        else:
            self.tally.count("removed")
            self.log.warning("slot.file_removed", path=str(self.path), reason=reason,
                             file=f"{QUARANTINE}/{path.name}", was=str(path))
        self.count -= ".bin" in path.name
        return True


class Index:
    """``path``'s index (``kvroute-index.json``), written whole, in the order its writes
    are asked for; ``counted`` hears ``index_failed``."""

    def __init__(self, path: Path, tally: Tally, counted: Callable[[str], None]) -> None:
        self.path, self.tally, self.counted = path, tally, counted
        self._order = asyncio.Lock()  # writes, in the order they are asked
        # A write whose caller was cancelled runs on in its thread: the next one waits for
        # it there, or an older index could be renamed over a newer one
        self._write = threading.Lock()
        self._writes: set[asyncio.Future[OSError | None]] = set()  # writes under way

    def write(self, saved: list[Saved]) -> OSError | None:
        """Write the index of ``saved`` (safe in a worker thread: it touches nothing the
        event loop reads); why it could not be."""
        doc = json.dumps([encode(e) for e in saved]).encode()
        try:
            with self._write:
                write_whole(self.path, INDEX, doc)
        except OSError as err:
            return err
        return None

    def write_now(self, saved: list[Saved]) -> None:
        """Write the index of ``saved`` on this thread (a start, before any request is
        served), a failure told."""
        self._tell(self.write(saved))

    async def commit(self, saved: Mapping[int, Saved]) -> None:
        """Write the index of ``saved`` as it is when the write starts, in a thread (an
        fsync would hold up every request), after those asked for before. A caller
        cancelled leaves the write to finish (`settle` waits for it)."""
        async with self._order:
            write = asyncio.get_running_loop().run_in_executor(
                None, self.write, list(saved.values()))
            self._writes.add(write)
            write.add_done_callback(self._written)
            await asyncio.shield(write)

    async def settle(self) -> None:
        """Return once no write is under way."""
        while self._writes:
            await asyncio.wait(set(self._writes))

    def _written(self, write: asyncio.Future[OSError | None]) -> None:
        self._writes.discard(write)
        if not write.cancelled() and write.exception() is None:
            self._tell(write.result())

    def _tell(self, err: OSError | None) -> None:
        """Tell of a write that failed (on the event loop). A full disk, the directory
        removed: the files serve this run all the same, and the next start finds them by
        their sidecars."""
        if err is None:
            return
        seen = diagnose(self.path, INDEX + ".tmp")
        self.counted("index_failed")
        self.tally.failed("index", f"{err.strerror}: {self.path / INDEX}",
                          seen[1] if seen else "free space in the directory",
                          note="the files are described by their sidecars meanwhile")
