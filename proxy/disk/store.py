"""The disk tier: slots saved to files, restored into a backend of the same model.

llama-server writes a slot's KV to a file in its `--slot-save-path` and reads it back
into any slot of any server of the same model and build (`POST /slots/{id}?action=save|
restore`). A SlotStore holds the files of one such directory (files.py; its restores
are restore.py) for the backends that read it: kv_disk.path for the managed ones, a
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
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence

import aiohttp
import structlog

from backends.client import BackendClient
from backends.config import KvDiskConfig
from backends.info import BackendInfo
from proxy.config.disk import MAX_DIRECTORIES
from proxy.disk.files import SlotFiles
from proxy.disk.identity import reported_identity, reported_model
from proxy.disk.records import Saved
from proxy.disk.restore import STRIKE_WINDOW_S, Restoring
from proxy.routing.router import Router

__all__ = ["SlotStore"]

_SAVE_TIMEOUT_S = 120.0  # off the request path: a large slot on a slow disk
# A spill is on the request path, paid once to spare a prefill later: taken when it is
# this short (a few percent of a cold prefill of the same tokens on any hardware kvroute
# serves), or when it is at most SPILL_SHARE of the prefill it spares at the backend's
# learned rate (a long agent conversation: seconds of prefill against a fraction of one
# to save it, even at the cautious first guess of the write rate below).
SPILL_MAX_S = 0.25
SPILL_SHARE = 0.05
# How long a spill may take before the request goes on without it: its estimate several
# times over, and a round trip.
SPILL_BASE_S = 1.0
SPILL_SLACK = 4.0
_WRITE_BPS_FIRST = 200 * (1 << 20)  # until a save measures it: a slow SSD's write rate
# An external server asked which model it runs: at once (its HTTP threads answer), and
# its adapters after the batch under way (its loop answers: seconds on a long prefill)
_IDENTITY_TIMEOUT_S = 5.0
_ADAPTERS_TIMEOUT_S = 30.0
_IDENTITY_RETRY_S = 300.0  # an external server that did not say: asked again this seldom
# An external server, routed at once, has its identity and slots restored within this
EXTERNAL_UP_LIMIT_S = 120.0
# The router's entries of every directory are told apart by the directory's number: entry
# ids are a directory's own (its file names)
_DIRS = MAX_DIRECTORIES


class SlotStore(Restoring):
    """The files of one directory (``cfg.path``), for the routers of every model pool:
    ``routers``, and ``router_of`` a backend (the one router, given alone); ``number``:
    the directory's among those of the tier (below ``MAX_DIRECTORIES``)."""

    def __init__(self, cfg: KvDiskConfig, session: aiohttp.ClientSession,
                 routers: Router | Sequence[Router], counted: Callable[[str], None],
                 router_of: Callable[[str], Router | None] | None = None,
                 number: int = 0) -> None:
        assert 0 <= number < _DIRS
        self.cfg, self.session, self.counted, self.number = cfg, session, counted, number
        self.files = SlotFiles(cfg.path, counted)
        self.routers = [routers] if isinstance(routers, Router) else list(routers)
        only = self.routers[0] if len(self.routers) == 1 else None
        self.router_of = router_of or (lambda _: only)
        self.log = structlog.get_logger()
        self.saved: dict[int, Saved] = self.files.open(cfg.max_gib * (1 << 30))
        self._next = max(self.files.highest, *self.saved, 0) + 1  # (no name given twice)
        # backend -> the identity of its model when it last became ready (backend_ready)
        self.models: dict[str, str] = {}
        # external backend -> reported_model when it last became ready: asked again
        # before each save and restore
        self._reported: dict[str, str | None] = {}
        self._asked: dict[str, float] = {}  # external backend -> when it was last asked
        self._asking: dict[str, asyncio.Task[None]] = {}  # external backend -> its ask
        self.identity_retry_s = _IDENTITY_RETRY_S
        self._offered: dict[int, frozenset[str]] = {}  # entry -> who the router offers it to
        # entry -> when the server last went away during its restore (restore.py)
        self._strikes: dict[int, float] = {}
        self.strike_window_s = STRIKE_WINDOW_S
        self._pending: dict[tuple[str, int], asyncio.Task[None]] = {}
        # (backend, slot) -> what the slot held when its last turn ended, until saved
        self._unsaved: dict[tuple[str, int], bytes] = {}
        self._saving: set[tuple[str, int]] = set()  # idle saves past their wait
        self.write_bps = float(_WRITE_BPS_FIRST)  # the servers' save rate, as measured

    def backend_ready(self, name: str, model: str | None, count: bool = True,
                      fresh: bool = True) -> None:
        """Backend ``name``, which reads this directory, became ready running ``model``
        (identity.py; None: unknown, and then nothing is saved from it or restored into
        it); ``count``: its files of another model as ``foreign``; ``fresh``: a new
        process, whose slots start empty (its saves not made yet are dropped; not so for
        an external server whose model is learnt while it is routed: its turns since
        are saved). Only then are the files of that model offered to it: no file
        reaches a backend of another model, or one that does not read this directory."""
        if model is None:
            self.models.pop(name, None)
        else:
            self.models[name] = model
        for key in [k for k in (*self._pending, *self._unsaved) if k[0] == name and fresh]:
            self._cancel_pending(key)
            self._unsaved.pop(key, None)
        foreign = sum(e.backend == name and e.model != model for e in self.saved.values())
        if foreign and model is not None and count:
            self.log.warning("slot.foreign", backend=name, files=foreign)
            for _ in range(foreign):
                self.counted("foreign")
        for e in self.saved.values():
            self._offer(e)

    def _offer(self, e: Saved) -> None:
        where = frozenset(n for n, m in self.models.items() if m == e.model)
        if self._offered.get(e.id) == where:
            return
        self._offered[e.id] = where
        for r in self.routers:
            mine = frozenset(n for n in where if self.router_of(n) is r)
            if mine:
                r.disk.add(self._key(e.id), e.file, e.tokens, mine)
            else:
                r.disk.drop(self._key(e.id))

    def _key(self, entry_id: int) -> int:
        """The router's name for an entry of this directory."""
        return entry_id * _DIRS + self.number

    async def _model_of(self, info: BackendInfo) -> str | None:
        """The model ``info`` runs now (None: unknown). An external server is asked: it
        may have been restarted with another model between two health probes, unseen;
        one whose model is unknown (it did not say when it became ready) is asked again,
        once in ``identity_retry_s``, and one being asked is waited for."""
        model = self.models.get(info.name)
        if info.managed:
            return model
        if model is None:
            if info.name not in self._asking and time.monotonic() - self._asked.get(
                    info.name, 0.0) < self.identity_retry_s:
                return None
            await self.external_ready(info, count=False)
            return self.models.get(info.name)
        now = await reported_model(self._client(info))
        if now is None or now == self._reported.get(info.name):
            return None if now is None else model  # (no answer: nothing learnt)
        self.log.warning("slot.model_changed", backend=info.name)
        await self.external_ready(info, count=False)
        return self.models.get(info.name)

    async def external_ready(self, info: BackendInfo, count: bool = True) -> None:
        """External backend ``info``, which reads this directory, answers (again): what
        it runs is what it reports (kvroute did not start it). One ask at a time: a
        caller that comes while one is under way waits for that one (a turn's save in
        the seconds its /lora-adapters waits for the server's loop), and one that goes
        away leaves it to finish (within its clients' timeouts)."""
        asking = self._asking.get(info.name)
        if asking is None:
            asking = self._asking[info.name] = asyncio.ensure_future(self._ask(info, count))
            asking.add_done_callback(
                lambda t: self._asking.pop(info.name) if self._asking.get(info.name) is t
                else None)
        await asyncio.shield(asking)

    async def _ask(self, info: BackendInfo, count: bool) -> None:
        self._asked[info.name] = time.monotonic()
        known = self.models.get(info.name)
        model = await reported_model(self._client(info))
        got = None if model is None else await reported_identity(
            self._client(info, _ADAPTERS_TIMEOUT_S), model)
        # (with its identity, not before: an ask cut short between the two, its request
        # gone, would leave `_model_of` taking the new report for the old model)
        self._reported[info.name] = model
        if not isinstance(got, str):
            self.log.warning("slot.model_unknown", backend=info.name,
                             reason="/props, /v1/models: no model" if got is None
                             else str(got), fix="start it with -m and the GGUF's "
                             "absolute path; check its api_key; a llama-server that "
                             "answers /lora-adapters")
        identity = got if isinstance(got, str) else None
        self.backend_ready(info.name, identity, count,
                           fresh=known is not None and identity != known)

    async def external_up(self, info: BackendInfo) -> None:
        """External backend ``info``, routed already, answers (again): learn what it runs,
        and restore its saved slots that are idle and empty on the server and in the
        router, within `EXTERNAL_UP_LIMIT_S` (a busy server answers between batches)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(EXTERNAL_UP_LIMIT_S):
                await self.external_ready(info)
                await self.restore(info, routed=True)

    def _client(self, info: BackendInfo, timeout: float = _IDENTITY_TIMEOUT_S
                ) -> BackendClient:
        return BackendClient(self.session, info.url, info.api_key, timeout=timeout)

    def _held(self, backend: str, slot: int) -> bytes | None:
        r = self.router_of(backend)
        return None if r is None else r.held(backend, slot)

    # ------------------------------------------------------------------ saving
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
        router = self.router_of(info.name)
        estimate = spill_estimate(len(tokens) // 4, len(tokens) // 4 - keeps,
                                  info.kv_bytes_per_token or 0, self.write_bps,
                                  router.prefill_rate(info.name) if router else None)
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
        model = self.models.get(info.name)
        if model is None and not spilled:
            model = await self._model_of(info)  # (unknown: asked, off the request path)
        if model is None or len(tokens) // 4 < self.cfg.min_tokens:
            return
        known = self._latest(info.name, slot, model)
        if known is not None and known.tokens == tokens:
            return  # (nothing new since the last save: no need to ask the server either)
        if await self._model_of(info) != model:
            return  # (restarted with another model: its slot does not hold what was noted)
        entry = Saved(self._next, info.name, slot, tokens, time.time(), model)
        self._next += 1
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
            self._drop(known.id, "replaced by a newer save of its conversation")
        self.saved[entry.id] = entry
        self._offer(entry)
        self._enforce_budget()
        await self.files.commit(self.saved)
        self.files.count("saved")
        self.counted("spilled" if spilled else "saved")
        self.log.info("slot.saved", backend=info.name, slot=slot, tokens=len(tokens) // 4,
                      spilled=spilled, ms=round(took * 1000, 1))

    async def close(self) -> None:
        tasks = [*self._pending.values(), *self._asking.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.files.close()

    def _drop(self, entry_id: int, reason: str, lost: bool = False,
              aside: bool = False) -> None:
        """Forget entry ``entry_id`` and remove its file, logged with ``reason`` (``lost``:
        a file that could not be used, not one replaced or aged out; ``aside``: moved to
        the quarantine instead, a file whole but not what its record says)."""
        entry = self.saved.pop(entry_id, None)
        self._offered.pop(entry_id, None)
        self._strikes.pop(entry_id, None)
        for r in self.routers:
            r.disk.drop(self._key(entry_id))
        if entry is not None and aside:
            self.files.quarantine(entry.file, reason)
        elif entry is not None:
            self.files.remove(entry.file, reason, warn=lost)

    def _enforce_budget(self) -> None:
        for entry_id in self.files.trim(self.saved.values(), self.cfg.max_gib * (1 << 30)):
            self._drop(entry_id, f"over the budget (kv_disk.max_gib {self.cfg.max_gib})")
        # a save given up (cancelled, timed out) may have been written after all
        self.files.sweep()


def saves(info: BackendInfo) -> bool:
    """Are ``info``'s slots saved (see `SlotStore.note`)?"""
    return info.memory.name == "dense"


def spill_estimate(held: int, spared: int, kv_bytes_per_token: int, write_bps: float,
                   prefill_tps: float | None) -> float | None:
    """How long saving a slot of ``held`` tokens takes, if it pays to wait for it: it
    spares a prefill of ``spared`` tokens (None: it does not pay)."""
    took = held * kv_bytes_per_token / write_bps
    if took <= SPILL_MAX_S or (prefill_tps and took <= SPILL_SHARE * spared / prefill_tps):
        return took
    return None
