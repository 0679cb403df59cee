"""The disk tier's directories, one SlotStore each: kv_disk.path for the managed backends,
and each directory external llama-servers declare (`slot_save_path`) for those that
declare it. External backends that declare the same directory share its files (one
saved from one is restored into another of the same model); one that declares none has
no disk tier, nor has a backend an agent runs (the files would be on its host). Each
directory is this kvroute's alone while it runs (files.py: its lock): a second
kvroute declaring one of them is refused at start.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import aiohttp

from backends.config import (
    BackendConfig,
    ExternalBackendConfig,
    KvDiskConfig,
    ManagedBackendConfig,
)
from backends.info import BackendInfo
from proxy.disk.identity import model_identity
from proxy.disk.save import saves
from proxy.disk.store import SlotStore
from proxy.observability.logging import get_logger
from proxy.routing.router import Router


def directories(kv_disk: KvDiskConfig, backends: Sequence[BackendConfig]
                ) -> dict[Path, list[str]]:
    """Each directory of the tier and the backends that read it (kv_disk.path first). One
    directory reached by two paths (a bind mount, a symbolic link) is one: two stores
    of it would each remove the other's files as strays."""
    own = kv_disk.path.resolve()
    out: dict[Path, list[str]] = {own: []}
    seen: dict[tuple[int, int] | Path, Path] = {_same(own): own}
    for b in backends:
        if not isinstance(b, ExternalBackendConfig):
            out[own].append(b.name)
        elif b.slot_save_path is not None:
            path = b.slot_save_path.resolve()
            path = seen.setdefault(_same(path), path)
            out.setdefault(path, []).append(b.name)
    return out


def _same(path: Path) -> tuple[int, int] | Path:
    """What tells a directory from another whatever the path to it (a missing one, as
    kv_disk.path may be before its first save: its path)."""
    try:
        st = path.stat()
    except OSError:
        return path
    return (st.st_dev, st.st_ino)


class DiskTier:
    def __init__(self, kv_disk: KvDiskConfig, backends: Sequence[BackendConfig],
                 session: aiohttp.ClientSession, routers: Sequence[Router],
                 counted: Callable[[str], None],
                 router_of: Callable[[str], Router | None]) -> None:
        self.cfg = kv_disk
        self._managed = {b.name: b for b in backends if isinstance(b, ManagedBackendConfig)}
        self.stores: list[SlotStore] = []
        self._of: dict[str, SlotStore] = {}
        for number, (path, names) in enumerate(directories(kv_disk, backends).items()):
            try:
                store = SlotStore(replace(kv_disk, path=path), session, routers, counted,
                                  router_of, number=number)
            except BaseException:  # (another kvroute's, unreadable: let go of those taken)
                for taken in self.stores:
                    taken.files.release()
                raise
            self.stores.append(store)
            self._of.update(dict.fromkeys(names, store))

    def of(self, backend: str) -> SlotStore | None:
        """The store of the directory ``backend`` reads (None: it has no disk tier)."""
        return self._of.get(backend)

    def backend_ready(self, info: BackendInfo, router: Router) -> SlotStore | None:
        """Backend ``info`` became ready (a new process, or an external server answering
        again): ``router``, its pool's, learns whether a hand-off there carries a spill,
        and the store of a managed one what the process just loaded. The store its saved
        slots come back from (`restored_up`); None: it is routed now, as it is."""
        store = self.of(info.name)
        # (what a hand-off there carries for a spill: only where the tier saves slots)
        router.disk.spills(info.name, store is not None and saves(info))
        if store is None:
            return None
        if info.managed:
            # what the process just loaded: only files of that model are restored into it
            cfg = self._managed.get(info.name)
            store.backend_ready(info.name, model_identity(cfg) if cfg is not None else None)
        # (an external server is asked what it runs first)
        return store if not info.managed or store.has(info.name) else None

    async def close(self) -> None:
        for store in self.stores:
            await store.close()

    def status(self) -> dict[str, object]:
        """Where, the budget (each directory's), the conversations held, and each
        directory's saves, failures, removals and quarantine (SlotFiles.status)."""
        return {"path": str(self.cfg.path), "max_gib": self.cfg.max_gib,
                "files": sum(len(s.saved) for s in self.stores),
                "tokens": sum(_tokens(s) for s in self.stores),
                "directories": [{"path": str(s.cfg.path), "files": len(s.saved),
                                 "tokens": _tokens(s), "backends": sorted(
                                     n for n, t in self._of.items() if t is s),
                                 **s.files.status()}
                                for s in self.stores]}


def _tokens(store: SlotStore) -> int:
    return sum(len(e.tokens) // 4 for e in store.saved.values())


async def restored_up(store: SlotStore, info: BackendInfo, router: Router,
                      route: Callable[[BackendInfo], None],
                      still_ready: Callable[[], bool]) -> None:
    """A backend (re)started: restore its saved slots, then ``route`` it (its health's
    `backend_up`) while it is ``still_ready``, ``router`` told what its slots hold. An
    external server is routed at once (it may be busy, and slow to say what it runs):
    what it runs and its slots that are still empty follow (SlotStore.external_up)."""
    if not info.managed:
        route(info)
    try:
        if not info.managed:
            await store.external_up(info)
            return
        restored = await store.restore(info)
    except Exception:
        # the restore is a head start, never a condition: routed with empty slots rather
        # than not at all (what did come back is then unknown: mispredicted, not wrong)
        get_logger().warning("slot.restore_crashed", backend=info.name, exc_info=True)
        restored = []
    if info.managed and still_ready():  # (not down again meanwhile)
        route(info)
        for slot, tokens in restored:
            router.seed(info.name, slot, tokens)
