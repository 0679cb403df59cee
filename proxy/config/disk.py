"""The disk tier's configuration: `kv_disk:`, and the directories external backends declare
(`slot_save_path:`), for proxy/config/load.py."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from backends.config import BackendConfig, ExternalBackendConfig, KvDiskConfig
from backends.dialect import dialect_of
from proxy.config.fields import ConfigError, _path, _Section

_SHARED_FIX = ("the directory the server's --slot-save-path names, as kvroute sees it "
               "(the same path on this host, or where a shared file system is mounted)")


def kv_disk(raw: object, base: Path) -> KvDiskConfig | None:
    if raw is None:
        return None
    sec = _Section(raw, "kv_disk.")
    path = sec.get_str("path", None, "/var/lib/kvroute/slots")
    if not path:
        raise ConfigError("kv_disk.path: required (fix: a directory of its own, e.g. "
                          "path: /var/lib/kvroute/slots)")
    d = KvDiskConfig(Path("."))
    out = KvDiskConfig(path=_path(base, path), max_gib=sec.get_num("max_gib", d.max_gib),
                       save_after_idle_s=sec.get_num("save_after_idle_s", d.save_after_idle_s,
                                                     zero=True),
                       min_tokens=sec.get_int("min_tokens", d.min_tokens, lo=0))
    sec.finish(["path", "max_gib", "save_after_idle_s", "min_tokens"])
    return out


def slot_save_path(sec: _Section, base: Path) -> Path | None:
    """An external backend's `slot_save_path`: an existing directory kvroute may write to
    (None: not given)."""
    raw = sec.get_str("slot_save_path", None, "/mnt/shared/slots")
    if raw is None:
        return None
    path = _path(base, raw)
    where = f"{sec.where}slot_save_path"
    if not path.is_dir():
        what = "not a directory" if path.exists() else "no such directory"
        raise ConfigError(f"{where}: {what}: {path} (fix: {_SHARED_FIX})")
    if not os.access(path, os.R_OK | os.W_OK | os.X_OK):
        raise ConfigError(f"{where}: kvroute cannot read and write in {path} (fix: give "
                          "the user kvroute runs as read and write access to it, as the "
                          "server's has)")
    return path


# The directories of the disk tier, kv_disk.path's and those declared, are numbered: the
# router tells their files apart by the number (proxy/disk/store.py)
MAX_DIRECTORIES = 256


def check_shared(backends: Sequence[BackendConfig], disk: KvDiskConfig | None,
                 replicas: bool) -> None:
    """What a declared `slot_save_path` needs: the disk tier on (its budget and timings
    apply to the directory), a llama-server, and one kvroute alone (each replica would
    remove the others' files as its own strays); and at most ``MAX_DIRECTORIES`` in all."""
    declared = {b.slot_save_path for b in backends
                if isinstance(b, ExternalBackendConfig) and b.slot_save_path is not None}
    if len(declared) + 1 > MAX_DIRECTORIES:
        raise ConfigError(f"backends: {len(declared)} directories declared as "
                          f"slot_save_path, at most {MAX_DIRECTORIES - 1} (fix: share "
                          "directories between the servers of one host)")
    for i, b in enumerate(backends):
        if not isinstance(b, ExternalBackendConfig) or b.slot_save_path is None:
            continue
        where = f"backends[{i}].slot_save_path"
        if not dialect_of(b.kind).saves_slots:
            raise ConfigError(f"{where}: only a llama-server saves slots, this backend is "
                              f"kind: {b.kind} (fix: remove slot_save_path)")
        if disk is None:
            raise ConfigError(f"{where}: needs the disk tier on (fix: add kv_disk: "
                              "{path: /var/lib/kvroute/slots}: its max_gib, "
                              "save_after_idle_s and min_tokens apply to this directory "
                              "too)")
        if replicas:
            raise ConfigError(f"{where}: not with replicas: each replica would take the "
                              "others' files in the directory for its own strays (fix: "
                              "remove slot_save_path, or replicas)")
