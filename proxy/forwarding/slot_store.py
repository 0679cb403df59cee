"""The disk tier: slots saved to files, restored into a backend of the same model.

llama-server writes a slot's KV to a file in its `--slot-save-path` and reads it back into
any slot of any server of the same model and build (`POST /slots/{id}?action=save|
restore`). A SlotStore holds the files of one such directory (slot_files.py) for the
backends that read it: kv_disk.path for the managed ones, a directory external servers
declare (`slot_save_path`) for those (slot_tier.py). A slot that stays idle for
`save_after_idle_s` after a turn (the agent is thinking, the user reading) is saved; a
later save of the same conversation replaces the file, another conversation in that slot
gets a file of its own. A request about to displace a slot's content before it was saved
(a busy fleet turns slots over faster than that) has it saved first, a spill, when the
save is short (`SPILL_MAX_S` at the write rate the saves so far measured): it delays that
request by as long. A request that waited for a slot is told what the slot held when the
router handed it over (`Handoff.displaced`): on a fleet where requests queue, a slot
goes from one turn to the next with no idle moment, so this is the one chance to save
it. The router holds every file's tokens in its tree: a request whose prefix a file
holds better than the slot it is given (the conversation's backend is busy or gone, its
slot reused since) has that file restored into the slot first (`Decision.restore`, or
`Handoff.restore` for one that waited). And when a backend comes back (the supervisor
restarts it, an external one answers again, or kvroute itself restarts) each of its
slots gets its last saved content back before requests are routed there.

Each file carries its model's identity (slot_identity.py), and is restored only into a
backend that runs that model now and reads its directory. An external server may have
been restarted with another model between two health probes: it is asked again before
each save and restore (a restore into a server of another model is refused and counted
`foreign`). A file of another model than its backend's is kept, for its own model (a
configuration switched back finds it), within the budget (`max_gib`, per directory)
that ages it out otherwise, and counted `foreign` when that backend starts. A file the
server refuses (it answered, and said no: another build, a short count) is dropped and
counted, and the slot starts empty. A server that does not answer (down, restarting,
hung) says nothing of the file, which is kept for its next start; but one that goes away
during the same file's restore twice in a row is taken to be brought down by it, and the
file is dropped. A file whose size is not what the server wrote is dropped without being
sent: the server aborts on a truncated one (a GGML_ASSERT in llama_state_seq_load_file),
and every restart would die on it again. Events counted: saved, spilled, save_failed,
restored, restore_failed, restore_interrupted, foreign, index_failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence

import aiohttp
import structlog

from backends.client import BackendClient, BackendDown
from backends.config import KvDiskConfig
from backends.info import BackendInfo
from proxy.forwarding.slot_files import Saved, SlotFiles
from proxy.forwarding.slot_identity import reported_identity, reported_model
from proxy.routing.router import Router

__all__ = ["RESTORE_BASE_S", "Saved", "SlotStore"]

# A restore reads its file whole into the server's KV, in the server's loop: allow the loop
# this long to take the task, and the file's size at a hard disk's speed. Past that the
# server is hung (stopped, a wedged loop), and a request goes on without the restore: the
# server takes its tasks in order, so the restore, if it ever runs, still comes first.
RESTORE_BASE_S = 5.0
RESTORE_BYTES_PER_S = 100 * (1 << 20)
_SAVE_TIMEOUT_S = 120.0  # off the request path: a large slot on a slow disk
# A spill is on the request path: a save this short (a few percent of a cold prefill of
# the same tokens on any hardware kvroute serves) is paid once to spare a prefill later.
SPILL_MAX_S = 0.25
# How long a spill may take before the request goes on without it: its estimate several
# times over, and a round trip.
SPILL_BASE_S = 1.0
SPILL_SLACK = 4.0
_WRITE_BPS_FIRST = 200 * (1 << 20)  # until a save measures it: a slow SSD's write rate
# An external server asked which model it runs: at once (its HTTP threads answer), and
# its adapters after the batch under way (its loop answers: seconds on a long prefill)
_IDENTITY_TIMEOUT_S = 5.0
_ADAPTERS_TIMEOUT_S = 30.0
# The router's entries of every directory are told apart by the directory's number: entry
# ids are a directory's own (its file names)
_DIRS = 1 << 8


class SlotStore:
    """The files of one directory (``cfg.path``), for the routers of every model pool:
    ``routers``, and ``router_of`` a backend (the one router, given alone); ``number``:
    the directory's among those of the tier (below 256)."""

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
        self._writing: set[str] = set()  # files a save in flight may be writing
        self.saved: dict[int, Saved] = self.files.load()
        self._next = max(self.saved, default=0) + 1
        # backend -> the identity of its model when it last became ready (backend_ready)
        self.models: dict[str, str] = {}
        # external backend -> reported_model when it last became ready: asked again
        # before each save and restore
        self._reported: dict[str, str | None] = {}
        self._offered: dict[int, frozenset[str]] = {}  # entry -> who the router offers it to
        self._strikes: dict[int, int] = {}  # entry -> restores the server went away during
        self._pending: dict[tuple[str, int], asyncio.Task[None]] = {}
        # (backend, slot) -> what the slot held when its last turn ended, until saved
        self._unsaved: dict[tuple[str, int], bytes] = {}
        self._saving: set[tuple[str, int]] = set()  # idle saves past their wait
        self.write_bps = float(_WRITE_BPS_FIRST)  # the servers' save rate, as measured

    def backend_ready(self, name: str, model: str | None, count: bool = True) -> None:
        """Backend ``name``, which reads this directory, became ready running ``model``
        (slot_identity; None: unknown, and then nothing is saved from it or restored into
        it); ``count``: its files of another model as ``foreign``. Only then are the
        files of that model offered to it: no file reaches a backend of another model, or
        one that does not read this directory."""
        if model is None:
            self.models.pop(name, None)
        else:
            self.models[name] = model
        for key in [k for k in (*self._pending, *self._unsaved) if k[0] == name]:
            self._cancel_pending(key)  # (a new process: its slots start empty)
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
                r.disk_add(self._key(e.id), e.file, e.tokens, mine)
            else:
                r.disk_drop(self._key(e.id))

    def _key(self, entry_id: int) -> int:
        """The router's name for an entry of this directory."""
        return entry_id * _DIRS + self.number

    async def _model_of(self, info: BackendInfo) -> str | None:
        """The model ``info`` runs now (None: unknown). An external server is asked: it
        may have been restarted with another model between two health probes, unseen."""
        model = self.models.get(info.name)
        if info.managed or model is None:
            return model
        now = await reported_model(self._client(info))
        if now is None or now == self._reported.get(info.name):
            return None if now is None else model  # (no answer: nothing learnt)
        self.log.warning("slot.model_changed", backend=info.name)
        await self.external_ready(info, count=False)
        return self.models.get(info.name)

    async def external_ready(self, info: BackendInfo, count: bool = True) -> None:
        """External backend ``info``, which reads this directory, answers (again): what
        it runs is what it reports (kvroute did not start it)."""
        model = await reported_model(self._client(info))
        self._reported[info.name] = model
        if model is None:
            self.log.warning("slot.model_unknown", backend=info.name, fix="start it with "
                             "-m and the GGUF's absolute path; check its api_key")
        self.backend_ready(info.name, None if model is None else await reported_identity(
            self._client(info, _ADAPTERS_TIMEOUT_S), model), count)

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
        if info.memory.name != "dense":
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
        if displaced is not None:
            tokens = displaced
        if tokens is None or len(tokens) // 4 - keeps < self.cfg.min_tokens:
            return
        estimate = len(tokens) // 4 * (info.kv_bytes_per_token or 0) / self.write_bps
        if estimate > SPILL_MAX_S:
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
        if model is None or len(tokens) // 4 < self.cfg.min_tokens:
            return
        if await self._model_of(info) != model:
            return  # (restarted with another model: its slot does not hold what was noted)
        known = self._latest(info.name, slot, model)
        if known is not None and known.tokens == tokens:
            return  # (nothing new since the last save)
        entry = Saved(self._next, info.name, slot, tokens, time.time(), model)
        self._next += 1
        client = BackendClient(self.session, info.url, info.api_key,
                               timeout=_SAVE_TIMEOUT_S if timeout is None else timeout)
        ok = False
        self._writing.add(entry.file)
        began = time.monotonic()
        try:
            got = await client.slot_file(slot, "save", entry.file)
            ok = isinstance(got, int) and got >= len(tokens) // 4 and still_held()
        finally:
            self._writing.discard(entry.file)
            entry.size = self.files.size(entry.file)
            if not ok:  # the server may have written it, whole or in part: no entry names it
                self.files.unlink(entry.file)
        if not ok or not entry.size:
            self.counted("save_failed")
            if spilled:  # (a disk that stalls: the next spills are skipped, not waited on)
                self.write_bps /= 2
            return
        self._unsaved.pop((info.name, slot), None)
        took = time.monotonic() - began
        if took > 0:  # (the round trip counted in: what a spill waits)
            self.write_bps = 0.7 * self.write_bps + 0.3 * entry.size / took
        self.files.private(entry.file)
        if known is not None and tokens.startswith(known.tokens):
            self._drop(known.id)  # the same conversation, further on
        self.saved[entry.id] = entry
        self._offer(entry)
        self.counted("spilled" if spilled else "saved")
        self._enforce_budget()
        self.files.write(self.saved.values())
        self.log.info("slot.saved", backend=info.name, slot=slot, tokens=len(tokens) // 4,
                      spilled=spilled, ms=round(took * 1000, 1))

    # --------------------------------------------------------------- restoring
    def has(self, backend: str) -> bool:
        """Are there files to restore into ``backend`` (of the model it runs)?"""
        model = self.models.get(backend)
        return any(e.backend == backend and e.model == model for e in self.saved.values())

    def _latest(self, backend: str, slot: int, model: str) -> Saved | None:
        mine = [e for e in self.saved.values()
                if (e.backend, e.slot, e.model) == (backend, slot, model)]
        return max(mine, key=lambda e: e.saved_at, default=None)

    async def _restore(self, info: BackendInfo, slot: int, e: Saved) -> bool | None:
        """Restore ``e`` into ``info``'s ``slot``: True; False: refused, ``e`` is
        dropped; None: no answer (the server is down or hung)."""
        if self.files.size(e.file) != e.size:
            got: object = "the file is not the size the server wrote"
        else:
            timeout = RESTORE_BASE_S + e.size / RESTORE_BYTES_PER_S
            client = BackendClient(self.session, info.url, info.api_key, timeout=timeout)
            got = await client.slot_file(slot, "restore", e.file)
            if isinstance(got, int) and got >= len(e.tokens) // 4:
                self._strikes.pop(e.id, None)
                self.counted("restored")
                return True
        self.log.warning("slot.restore_failed", backend=info.name, slot=slot, file=e.file,
                         error=str(got))
        down = isinstance(got, BackendDown)
        strikes = self._strikes.get(e.id, 0) + 1
        if down and strikes < 2:
            self._strikes[e.id] = strikes  # once says nothing of the file
            self.counted("restore_interrupted")
            return None
        self.counted("restore_failed")
        self._drop(e.id)  # else chosen again (and, if it brings the server down, again)
        return None if down else False

    async def restore_into(self, info: BackendInfo, slot: int, file: str) -> bool | None:
        """Restore ``file`` into ``info``'s ``slot`` (a request is about to be sent there,
        predicted to reuse it): True. False: it failed, and the slot may hold nothing now
        (the server clears it on a refusal; after no answer, what it holds is unknown).
        None: nothing was asked of the server, the slot holds what it held."""
        e = next((e for e in self.saved.values() if e.file == file), None)
        model = None if e is None else await self._model_of(info)
        if e is None or e.model != model:
            # dropped since the decision (budget, a refusal), or of another model than the
            # one the server runs now (an external one restarted with another, unseen)
            if e is not None and model is not None:
                self.counted("foreign")
            self.log.info("slot.restore_skipped", backend=info.name, slot=slot, file=file)
            return None
        done = await self._restore(info, slot, e)
        if e.id not in self.saved:
            self.files.write(self.saved.values())
        return bool(done)

    async def restore(self, info: BackendInfo) -> list[tuple[int, bytes]]:
        """Restore ``info``'s saved slots into it (a new process: its slots are empty);
        the (slot, tokens) that came back. The server gone or hung: the rest wait for
        its next start."""
        model = await self._model_of(info)
        out: list[tuple[int, bytes]] = []
        if model is None:
            return out
        slots = {e.slot for e in self.saved.values()
                 if e.backend == info.name and e.model == model}
        for slot in sorted(s for s in slots if s < info.n_slots):
            entry = self._latest(info.name, slot, model)
            assert entry is not None
            done = await self._restore(info, slot, entry)
            if done is None:
                break
            if done:
                out.append((slot, entry.tokens))
        if out:
            self.log.info("slot.restored", backend=info.name,
                          slots=[(s, len(t) // 4) for s, t in out])
        self.files.write(self.saved.values())
        return out

    async def close(self) -> None:
        for task in list(self._pending.values()):
            task.cancel()
        await asyncio.gather(*self._pending.values(), return_exceptions=True)

    def _drop(self, entry_id: int) -> None:
        entry = self.saved.pop(entry_id, None)
        self._offered.pop(entry_id, None)
        self._strikes.pop(entry_id, None)
        for r in self.routers:
            r.disk_drop(self._key(entry_id))
        if entry is not None:
            self.files.unlink(entry.file)

    def _enforce_budget(self) -> None:
        for entry_id in self.files.over_budget(self.saved.values(),
                                               self.cfg.max_gib * (1 << 30)):
            self._drop(entry_id)
        # a save given up (cancelled, timed out) may have been written after all
        self.files.sweep({e.file for e in self.saved.values()} | self._writing)
