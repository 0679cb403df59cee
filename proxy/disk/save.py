"""The disk tier's saves: a slot saved once it stayed idle after a turn (`note`), or
spilled before a request displaces what it held unsaved (`spill`). A `Saver` is a part of
SlotStore (store.py), which tells what the tier saves and when; it adds each file to the
directory's catalog (catalog.py), of the model its backend runs (identity.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import aiohttp
import structlog

from backends.client import BackendClient
from backends.config import KvDiskConfig
from backends.info import BackendInfo
from proxy.disk.catalog import Catalog
from proxy.disk.files import SlotFiles
from proxy.disk.identity import Identities
from proxy.disk.records import Saved

__all__ = ["Saver", "saves", "spill_estimate"]

_SAVE_TIMEOUT_S = 120.0  # off the request path: a large slot on a slow disk
# A spill is on the request path, paid once to spare a prefill later: taken when it is
# this short (a few percent of a cold prefill of the same tokens on any hardware kvroute
# serves), or when it is at most SPILL_SHARE of the prefill it spares, as long as the
# backend's timings say those positions take (a long agent conversation: seconds of
# prefill against a fraction of one to save it, even at the cautious first guess of the
# write rate below).
SPILL_MAX_S = 0.25
SPILL_SHARE = 0.05
# How long a spill may take before the request goes on without it: its estimate several
# times over, and a round trip.
SPILL_BASE_S = 1.0
SPILL_SLACK = 4.0
_WRITE_BPS_FIRST = 200 * (1 << 20)  # until a save measures it: a slow SSD's write rate


class Saver:
    """The saves of the slots of the backends that read ``files``'s directory (``cfg``:
    its settings), added to ``catalog`` by the model their backend runs
    (``identities``), through ``session``; ``counted`` hears saved, spilled and
    save_failed. ``write_bps``: the servers' save rate, as measured."""

    def __init__(self, cfg: KvDiskConfig, files: SlotFiles, catalog: Catalog,
                 identities: Identities, session: aiohttp.ClientSession,
                 counted: Callable[[str], None]) -> None:
        self.cfg, self.files, self.catalog, self.identities = cfg, files, catalog, identities
        self.session, self.counted = session, counted
        self.log = structlog.get_logger()
        self._pending: dict[tuple[str, int], asyncio.Task[None]] = {}
        # (backend, slot) -> what the slot held when its last turn ended, until saved
        self._unsaved: dict[tuple[str, int], bytes] = {}
        self._saving: set[tuple[str, int]] = set()  # idle saves past their wait
        self.write_bps = float(_WRITE_BPS_FIRST)

    def forget(self, backend: str) -> None:
        """``backend`` is a new process, its slots empty: its saves not made yet are
        dropped."""
        for key in [k for k in (*self._pending, *self._unsaved) if k[0] == backend]:
            self._cancel_pending(key)
            self._unsaved.pop(key, None)

    async def close(self) -> None:
        """Cancel the saves under way."""
        tasks = list(self._pending.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _client(self, info: BackendInfo, timeout: float) -> BackendClient:
        return BackendClient(self.session, info.url, info.api_key, timeout=timeout)

    def _held(self, backend: str, slot: int) -> bytes | None:
        r = self.catalog.router_of(backend)
        return None if r is None else r.held(backend, slot)

    def note(self, info: BackendInfo, slot: int) -> None:
        """A turn ended in ``info``'s ``slot``: save it once it has stayed idle. Not on a
        sliding-window or hybrid model: the server restores a slot without its context
        checkpoints, so only a continuation could use it (docs/checkpoints.md)."""
        if not saves(info):
            return
        key = (info.name, slot)
        self._cancel_pending(key)
        tokens = self._held(info.name, slot)
        if tokens is None:  # (handed to a queued request already)
            self._unsaved.pop(key, None)
        else:
            self._unsaved[key] = tokens
        task = asyncio.create_task(self._save_when_idle(info, slot))
        self._pending[key] = task
        task.add_done_callback(lambda t: self._done(key, t))

    def _done(self, key: tuple[str, int], task: asyncio.Task[None]) -> None:
        if self._pending.get(key) is task:
            del self._pending[key]
            self._saving.discard(key)

    def _cancel_pending(self, key: tuple[str, int]) -> None:
        old = self._pending.pop(key, None)
        self._saving.discard(key)
        if old is not None:
            old.cancel()

    async def _save_when_idle(self, info: BackendInfo, slot: int) -> None:
        await asyncio.sleep(self.cfg.save_after_idle_s)
        self._saving.add((info.name, slot))  # (from here on a spill waits for it)
        tokens = self._held(info.name, slot)
        if tokens is not None:
            # the slot must still hold it after the save: a turn that started meanwhile
            # on it would make the record wrong
            await self._save(info, slot, tokens,
                             lambda: self._held(info.name, slot) == tokens)

    async def spill(self, info: BackendInfo, slot: int, keeps: int,
                    displaced: bytes | None = None) -> None:
        """A request is about to be sent to ``info``'s ``slot``, reusing its first
        ``keeps`` tokens: save what the slot holds first if the request displaces it, it
        was not saved, and the save is short. The slot is the request's meanwhile, so
        it holds the same when the save is done. ``displaced``: what the slot held when
        the router handed it to this request, a queued one (the turn before ended a
        moment ago: `note` found the slot taken already)."""
        key = (info.name, slot)
        tokens = self._unsaved.pop(key, None)
        if not saves(info):
            return  # (as in `note`: a hand-off carries what any slot held)
        if displaced is not None:
            tokens = displaced
        if tokens is None or len(tokens) // 4 - keeps < self.cfg.min_tokens:
            return
        router = self.catalog.router_of(info.name)
        held = len(tokens) // 4
        estimate = spill_estimate(held, info.kv_bytes_per_token or 0, self.write_bps,
                                  router.prefill_s(info.name, keeps, held) if router else None)
        if estimate is None:
            return  # lost: the request would wait too long (the idle save wakes too late)
        pending = self._pending.get(key)
        if pending is not None and key in self._saving:
            # the idle save is under way, and the server runs it first anyway: wait for
            # it (the save below then finds those tokens saved, or saves them)
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.shield(pending)
        else:
            self._cancel_pending(key)
        await self._save(info, slot, tokens, lambda: True,
                         timeout=SPILL_BASE_S + SPILL_SLACK * estimate)

    async def _save(self, info: BackendInfo, slot: int, tokens: bytes,
                    still_held: Callable[[], bool], timeout: float | None = None) -> None:
        """Save ``slot`` as holding ``tokens``; ``timeout``: a spill's bound (the request
        waits for it), none for an idle save."""
        spilled = timeout is not None
        model = self.identities.models.get(info.name)
        if model is None and not spilled:
            model = await self.identities.model_of(info)  # (unknown: asked, off the request path)
        if model is None or len(tokens) // 4 < self.cfg.min_tokens:
            return
        known = self.catalog.latest(info.name, slot, model)
        if known is not None and known.tokens == tokens:
            return  # (nothing new since the last save: no need to ask the server either)
        if await self.identities.model_of(info) != model:
            return  # (restarted with another model: its slot does not hold what was noted)
        entry = Saved(self.catalog.new_id(), info.name, slot, tokens, time.time(), model)
        client = self._client(info, _SAVE_TIMEOUT_S if timeout is None else timeout)
        began = time.monotonic()
        try:
            got = await client.slot_file(slot, "save", entry.file)
            trouble = self.files.saved_as(
                got, still_held(), entry,
                len(tokens) // 4 * (info.kv_bytes_per_token or 0), spilled)
            took = time.monotonic() - began
            if trouble is None and (
                    why := await asyncio.to_thread(self.files.describe, entry)) is not None:
                trouble = (f"cannot write its sidecar: {why}", f"free space in {self.cfg.path}")
        except BaseException:  # (cancelled: the server may write it still)
            self.files.abandon(entry.file)
            raise
        if trouble is not None:
            self.files.abandon(entry.file)  # (the server may have written it, in part)
            self.counted("save_failed")
            self.files.failed("save", *trouble, backend=info.name, slot=slot,
                              file=entry.file, spilled=spilled)
            if spilled:  # (a disk that stalls: the next spills are skipped, not waited on)
                self.write_bps /= 2
            return
        self._unsaved.pop((info.name, slot), None)
        if took > 0:  # (the round trip counted in: what a spill waits)
            self.write_bps = 0.7 * self.write_bps + 0.3 * entry.size / took
        if known is not None and tokens.startswith(known.tokens):
            self.catalog.drop(known.id, "replaced by a newer save of its conversation")
        self.catalog.add(entry, self.identities.models)
        await self.catalog.commit()
        self.files.count("saved")
        self.counted("spilled" if spilled else "saved")
        self.log.info("slot.saved", backend=info.name, slot=slot, tokens=len(tokens) // 4,
                      spilled=spilled, ms=round(took * 1000, 1))


def saves(info: BackendInfo) -> bool:
    """Are ``info``'s slots saved (see `Saver.note`)? Not with LoRA adapters: a slot's KV
    was made under the adapters of its last request, which a file does not record, and
    a restore under others would decode wrong."""
    return info.memory.name == "dense" and not info.lora


def spill_estimate(held: int, kv_bytes_per_token: int, write_bps: float,
                   spared_s: float | None) -> float | None:
    """How long saving a slot of ``held`` tokens takes, if it pays to wait for it: it
    spares a prefill of ``spared_s`` seconds (None: not known; it does not pay then)."""
    took = held * kv_bytes_per_token / write_bps
    if took <= SPILL_MAX_S or (spared_s is not None and took <= SPILL_SHARE * spared_s):
        return took
    return None
