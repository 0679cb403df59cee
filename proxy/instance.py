"""One kvroute per directory it writes: the locks taken before anything starts.

A `kvroute serve` writes two kinds of directory that must be its own while it runs: its
``log_dir`` (backends.json, which `kvroute doctor` reads, and each backend's log) and
each directory of its disk tier (slot files and their index: proxy/disk/files.py). A
second kvroute given one of them (a copy of the config with only the port changed, a
second `make run`) is refused before it builds, starts or writes anything: so it cannot
start servers beside the first one's, delete its backends.json or append to its logs.

The locks are flock(2) on a ``kvroute.lock`` file in the directory: the kernel lets one
go when its process ends, even by SIGKILL, so a crash leaves no stale lock. The holder
writes its pid there (after taking the lock: a refused instance only reads it), for the
message the next one gives. A disk directory locked here is handed to the store that
owns its files (`adopt`) rather than locked twice: flock locks of two descriptors of one
process conflict like those of two processes.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterable
from pathlib import Path

from proxy.config.fields import ConfigError

LOCK = "kvroute.lock"

# directory (resolved) -> the descriptor holding its lock, taken by `claim` and not yet
# adopted by its store (one process: the locks are the process's)
_held: dict[Path, int] = {}


class InUse(ConfigError):
    """Another kvroute holds the directory."""


DISK_FIX = ("one kvroute per directory: give this one its own kv_disk.path, or stop the "
            "other; servers that share a slot_save_path are declared in one kvroute's "
            "config")


def lock(directory: Path, what: str, fix: str) -> int:
    """An exclusive lock on ``directory``'s ``kvroute.lock`` (the descriptor holds it):
    InUse if another process holds it, a ConfigError if it cannot be taken; ``what``
    the directory is, and ``fix`` for the first, in the message."""
    path = directory / LOCK
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as err:
        raise ConfigError(f"{what}: cannot create {path}: {err.strerror} (fix: give the "
                          f"user kvroute runs as write access to {directory})") from err
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        holder = _holder(fd)
        os.close(fd)
        if isinstance(err, BlockingIOError):
            raise InUse(f"{what}: {directory} is in use by another kvroute{holder} (it "
                        f"holds {path}) (fix: {fix})") from err
        raise ConfigError(f"{what}: cannot lock {path}: {err.strerror} (fix: a file "
                          "system with locks, e.g. NFS with its lock service)") from err
    with contextlib.suppress(OSError):  # (the pid is for messages only)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _holder(fd: int) -> str:
    with contextlib.suppress(OSError, ValueError):
        return f", pid {int(os.pread(fd, 32, 0).decode().strip())}"
    return ""


def adopt(directory: Path) -> int | None:
    """A descriptor of the lock `Instance` holds on ``directory`` (None: not held here).
    A duplicate: the lock belongs to the open file both share, so the store that closes
    it when the app stops leaves the directory locked until the instance lets it go,
    after its servers stopped (they may still be writing a slot)."""
    fd = _held.get(directory.resolve())
    return None if fd is None else os.dup(fd)


class Instance:
    """The locks of one `kvroute serve` (or `kvroute agent`), held until `release`."""

    def __init__(self, log_dir: Path, disk_dirs: Iterable[Path],
                 own_disk: Path | None = None) -> None:
        """Lock ``log_dir`` (made if missing), then make ``own_disk`` (the disk tier's
        own directory, private: the servers write slots there) and lock each of
        ``disk_dirs``; one directory in two roles is locked once. A ConfigError naming
        the first one held elsewhere, with nothing kept locked or made past it."""
        self._fds: dict[Path, int] = {}
        try:
            log_dir.mkdir(parents=True, exist_ok=True)
            self._fds[log_dir.resolve()] = lock(
                log_dir, "log_dir", "one kvroute per log_dir: give this one its own "
                "log_dir, or stop the other")
            if own_disk is not None:
                own_disk.mkdir(mode=0o700, parents=True, exist_ok=True)
            for d in disk_dirs:
                key = d.resolve()
                if key not in self._fds:
                    self._fds[key] = lock(d, "disk tier", DISK_FIX)
                _held[key] = self._fds[key]
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        for key, fd in self._fds.items():
            if _held.get(key) == fd:
                del _held[key]
            os.close(fd)
        self._fds.clear()
