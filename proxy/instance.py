"""One kvroute per directory it writes: the locks taken before anything starts.

A `kvroute serve` writes two kinds of directory that must be its own while it runs: its
``log_dir`` (backends.json, which `kvroute doctor` reads, and each backend's log) and
each directory of its disk tier (slot files and their index: proxy/forwarding/
slot_files.py). A second kvroute given one of them (a copy of the config with only the
port changed, a second `make run`) is refused before it builds, starts or writes
anything: so it cannot start servers beside the first one's, delete its backends.json
or append to its logs.

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
    """The descriptor `claim` took for ``directory``, handed over once (None: not taken
    here)."""
    return _held.pop(directory.resolve(), None)


class Instance:
    """The locks of one `kvroute serve`, held until `release`."""

    def __init__(self, log_dir: Path, disk_dirs: Iterable[Path]) -> None:
        """Lock ``log_dir`` (made if missing) and then each of ``disk_dirs``; a
        ConfigError naming the first one held elsewhere, with nothing kept locked."""
        self._fds: list[int] = []
        self._disk: list[Path] = []
        try:
            log_dir.mkdir(parents=True, exist_ok=True)
            self._fds.append(lock(log_dir, "log_dir", "one kvroute per log_dir: give "
                                  "this one its own log_dir, or stop the other"))
            for d in disk_dirs:
                fd = lock(d, "disk tier", DISK_FIX)
                _held[d.resolve()] = fd
                self._disk.append(d.resolve())
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        for d in self._disk:  # (those a store adopted are the store's to close)
            fd = _held.pop(d, None)
            if fd is not None:
                os.close(fd)
        self._disk.clear()
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
