"""The disk tier: slots saved to files, restored into a backend of the same model.

llama-server writes a slot's KV to a file in its `--slot-save-path` and reads it back
into any slot of any server of the same model and build (`POST /slots/{id}?action=save|
restore`). A SlotStore holds the files of one such directory (files.py) for the
backends that read it: kv_disk.path for the managed ones, a
directory external servers declare (`slot_save_path`) for those (tier.py). A slot
that stays idle for `save_after_idle_s` after a turn (the agent is thinking, the user
reading) is saved; a later save of the same conversation replaces the file, another
conversation in that slot gets a file of its own. A request about to displace a slot's
content before it was saved (a busy fleet turns slots over faster than that) has it saved
first, a spill, when the save is short, outright or next to the prefill it spares
(`spill_estimate`, at the write rate the saves so far measured): it delays that request
by as long. A request that waited for a slot is told what the slot held when the router
handed it over (`Handoff.displaced`): on a fleet where requests queue, a slot goes from
one turn to the next with no idle moment, so this is the one chance to save it. The
router holds every file's tokens in its tree: a request whose prefix a file holds better
than the slot it is given (the conversation's backend is busy or gone, its slot reused
since) has that file restored into the slot first (`Decision.restore`, or
`Handoff.restore` for one that waited). And when a backend comes back (the supervisor
restarts it, an external one answers again, or kvroute itself restarts) each of its slots
gets its last saved content back before requests are routed there.

Each file carries its model's identity (identity.py), and is restored only into a
backend that runs that model now and reads its directory. An external server may have
been restarted with another model between two health probes: it is asked again before
each save and restore (a restore into a server of another model is refused and counted
`foreign`). A file of another model than its backend's is kept, for its own model (a
configuration switched back finds it), within the budget (`max_gib`, per directory)
that ages it out otherwise, and counted `foreign` when that backend starts. What a
failed restore costs its file is restore.py's to say. Events counted: saved, spilled,
save_failed, restored, restore_failed, restore_interrupted, foreign, index_failed. Each
failed save, restore and removal is also a warning in the log, with its reason and the
fix (the server's own error when it gave one; what kvroute sees of the directory:
missing, not writable, full), and each directory's counts and last failure are in the
status (SlotFiles.status).

A SlotStore is composed of its parts, each owning its state: the directory's files
(`SlotFiles`, files.py), their records as the routers know them (`Catalog`, catalog.py),
the model each backend runs (`Identities`, identity.py), the saves (`Saver`, save.py) and
the restores (`Restorer`, restore.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence

import aiohttp
import structlog

from backends.config import KvDiskConfig
from backends.info import BackendInfo
from proxy.disk.catalog import Catalog
from proxy.disk.files import SlotFiles
from proxy.disk.identity import Identities
from proxy.disk.records import Saved
from proxy.disk.restore import Restorer
from proxy.disk.save import Saver
from proxy.routing.router import Router

__all__ = ["SlotStore"]

# An external server, routed at once, has its identity and slots restored within this
EXTERNAL_UP_LIMIT_S = 120.0


class SlotStore:
    """The files of one directory (``cfg.path``), for the routers of every model pool:
    ``routers``, and ``router_of`` a backend (the one router, given alone); ``number``:
    the directory's among those of the tier (below ``MAX_DIRECTORIES``)."""

    def __init__(self, cfg: KvDiskConfig, session: aiohttp.ClientSession,
                 routers: Router | Sequence[Router], counted: Callable[[str], None],
                 router_of: Callable[[str], Router | None] | None = None,
                 number: int = 0) -> None:
        self.cfg, self.counted = cfg, counted
        self.log = structlog.get_logger()
        self.files = SlotFiles(cfg.path, counted)
        self.catalog = Catalog(self.files, cfg.max_gib, routers, router_of, number)
        self.identities = Identities(session, self.backend_ready)
        self.saver = Saver(cfg, self.files, self.catalog, self.identities, session, counted)
        self.restorer = Restorer(self.files, self.catalog, self.identities, session, counted)

    @property
    def saved(self) -> dict[int, Saved]:
        """The directory's files, by entry id."""
        return self.catalog.saved

    @property
    def models(self) -> dict[str, str]:
        """Backend -> the identity of the model it runs (identity.py), when known."""
        return self.identities.models

    def backend_ready(self, name: str, model: str | None, count: bool = True,
                      fresh: bool = True) -> None:
        """Backend ``name``, which reads this directory, became ready running ``model``
        (identity.py; None: unknown, and then nothing is saved from it or restored into
        it); ``count``: its files of another model as ``foreign``; ``fresh``: a new
        process, whose slots start empty (its saves not made yet are dropped; not so for
        an external server whose model is learnt while it is routed: its turns since
        are saved). Only then are the files of that model offered to it: no file
        reaches a backend of another model, or one that does not read this directory."""
        self.identities.learn(name, model)
        if fresh:
            self.saver.forget(name)
        foreign = self.catalog.foreign(name, model)
        if foreign and model is not None and count:
            self.log.warning("slot.foreign", backend=name, files=foreign)
            for _ in range(foreign):
                self.counted("foreign")
        self.catalog.offer(self.identities.models)

    def has(self, backend: str) -> bool:
        """Are there files to restore into ``backend`` (of the model it runs)?"""
        return self.catalog.has(backend, self.identities.models.get(backend))

    async def external_up(self, info: BackendInfo) -> None:
        """External backend ``info``, routed already, answers (again): learn what it runs,
        and restore its saved slots that are idle and empty on the server and in the
        router, within `EXTERNAL_UP_LIMIT_S` (a busy server answers between batches)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(EXTERNAL_UP_LIMIT_S):
                await self.identities.ask(info)
                await self.restorer.restore(info, routed=True)

    def note(self, info: BackendInfo, slot: int) -> None:
        """A turn ended in ``info``'s ``slot`` (`Saver.note`)."""
        self.saver.note(info, slot)

    async def spill(self, info: BackendInfo, slot: int, keeps: int,
                    displaced: bytes | None = None) -> None:
        """A request is about to displace what ``info``'s ``slot`` holds (`Saver.spill`)."""
        await self.saver.spill(info, slot, keeps, displaced)

    async def restore_into(self, info: BackendInfo, slot: int, file: str) -> bool:
        """Restore ``file`` into ``info``'s ``slot`` for a request (`Restorer.restore_into`)."""
        return await self.restorer.restore_into(info, slot, file)

    async def restore(self, info: BackendInfo, routed: bool = False
                      ) -> list[tuple[int, bytes]]:
        """Restore ``info``'s saved slots into it (`Restorer.restore`)."""
        return await self.restorer.restore(info, routed)

    async def close(self) -> None:
        await self.saver.close()
        await self.identities.close()
        await self.files.close()
