"""The disk tier's restores: a saved slot's file read back into a slot of a backend of
the same model, for a request about to use that slot (`restore_into`), and into a backend
that (re)started, before it is routed (`restore`): a `Restorer`, a part of SlotStore
(store.py), reading the directory's files through its catalog (catalog.py) and what each
backend runs through its identities (identity.py).

A file is judged before it is sent, by the rule a start judges it by (records.py
`verdict`): one no server loads is dropped (truncated: the server aborts on it, a
GGML_ASSERT in llama_state_seq_load_file, and every restart would die on it again), one
whole but not what its record says is put aside, one that cannot be read is kept. A file
the server refuses (it answered that it cannot restore it: another build, more tokens than
its context) is dropped and counted, and the slot starts empty. Any other answer (a 503
while it loads a model, a 5xx) says nothing of the file, nor does no answer (down,
restarting, hung, a timeout on a busy server): the file is kept for the server's next
start. But a server that goes away (its connection refused, reset or closed) during the
same file's restore twice within `STRIKE_WINDOW_S` is taken to be brought down by it, and
the file is dropped (`Strikes`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import aiohttp
import structlog

from backends.client import BackendClient, BackendDown, BadResponse
from backends.info import BackendInfo
from proxy.disk.catalog import Catalog
from proxy.disk.files import SlotFiles, server_error
from proxy.disk.identity import Identities
from proxy.disk.records import Saved
from proxy.disk.save import saves

# A restore reads its file whole into the server's KV, in the server's loop: allow the loop
# this long to take the task, and the file's size at a hard disk's speed. Past that the
# server is hung (stopped, a wedged loop), and a request goes on without the restore: the
# server takes its tasks in order, so the restore, if it ever runs, still comes first.
RESTORE_BASE_S = 5.0
RESTORE_BYTES_PER_S = 100 * (1 << 20)
# Two restores of one file that the server went away during, this close together: the
# file brings it down (a server restarted at once, crash-looping at the supervisor's
# longest backoff, loading a large model). Further apart, they are two unrelated deaths.
STRIKE_WINDOW_S = 900.0
# llama-server's answer to a file it cannot restore (server-context.cpp, its slot restore
# task: 400 "Unable to restore slot: ..."); its other 400s are of the request (the slot id)
_REFUSED_STATUS, _REFUSED = 400, "Unable to restore slot"


class Strikes:
    """The restores of each file (by its entry's id) that the server went away during:
    the second within ``window_s`` of the one before is the file's doing."""

    def __init__(self, window_s: float = STRIKE_WINDOW_S) -> None:
        self.window_s = window_s
        self._last: dict[int, float] = {}  # entry -> the last restore it went away during

    def strike(self, entry_id: int, got: object, now: float) -> bool:
        """A restore of ``entry_id`` answered ``got`` at ``now``: is it the second the
        server went away during within ``window_s``? A timeout is no strike (a busy or
        hung server), nor a refused connection (the restore never reached the server)."""
        if not isinstance(got, BackendDown) or got.timed_out or got.refused:
            return False
        last = self._last.get(entry_id)
        # (older strikes count no more: forgotten, those of files dropped since too)
        self._last = {i: t for i, t in self._last.items() if now - t <= self.window_s}
        self._last[entry_id] = now
        return last is not None and now - last <= self.window_s

    def clear(self, entry_id: int) -> None:
        """``entry_id`` was restored, or dropped: its strikes count no more."""
        self._last.pop(entry_id, None)


class Restorer:
    """The restores of ``catalog``'s files (of ``files``'s directory) into the backends
    that run their model (``identities``), through ``session``; ``counted`` hears
    restored, restore_failed, restore_interrupted and foreign."""

    def __init__(self, files: SlotFiles, catalog: Catalog, identities: Identities,
                 session: aiohttp.ClientSession, counted: Callable[[str], None]) -> None:
        self.files, self.catalog, self.identities = files, catalog, identities
        self.session, self.counted = session, counted
        self.log = structlog.get_logger()
        self.strikes = Strikes()

    def _client(self, info: BackendInfo, timeout: float) -> BackendClient:
        return BackendClient(self.session, info.url, info.api_key, timeout=timeout)

    async def _restore(self, info: BackendInfo, slot: int, e: Saved) -> bool | None:
        """Restore ``e`` into ``info``'s ``slot``: True; False: not restored (refused, or
        not sent: the module's docstring says what becomes of ``e``); None: the server
        did not restore it, nor say anything of the file (down, hung, not ready)."""
        judged = self.files.judge(e)
        if judged is not None:
            self._unusable(info, slot, e, *judged)
            return False
        timeout = RESTORE_BASE_S + e.size / RESTORE_BYTES_PER_S
        got = await self._client(info, timeout).slot_file(slot, "restore", e.file)
        if isinstance(got, int) and got >= len(e.tokens) // 4:
            self.strikes.clear(e.id)
            self.counted("restored")
            return True
        if isinstance(got, int) or refused(got):
            self._failed(info, slot, e, restore_trouble(got, len(e.tokens) // 4, False))
            return False
        kept = not self.strikes.strike(e.id, got, time.monotonic())
        self._failed(info, slot, e, restore_trouble(got, len(e.tokens) // 4, kept), kept)
        return None

    def _unusable(self, info: BackendInfo, slot: int, e: Saved, kind: str, why: str) -> None:
        """``e``'s file judged not to be sent (`SlotFiles.judge`): ``kind`` "remove" (no
        server loads it), "quarantine" (not what ``e`` says), "keep" (cannot be read)."""
        fix = {"remove": "none for this file (dropped: no server could load it); if it "
                         "recurs, check the disk (full? files copied in part?)",
               "quarantine": "see what the file is, in the quarantine (it counts toward "
                             "kv_disk.max_gib)",
               "keep": f"give the user kvroute runs read access to {self.files.path}"}[kind]
        self._failed(info, slot, e, (why, fix), kept=kind == "keep",
                     aside=kind == "quarantine")

    def _failed(self, info: BackendInfo, slot: int, e: Saved, trouble: tuple[str, str],
                kept: bool = False, aside: bool = False) -> None:
        """A restore of ``e`` that failed: logged, counted, and ``e`` dropped unless
        ``kept`` (``aside``: its file put in the quarantine)."""
        self.files.failed("restore", *trouble, backend=info.name, slot=slot, file=e.file)
        self.counted("restore_interrupted" if kept else "restore_failed")
        if not kept:
            self.strikes.clear(e.id)
            self.catalog.drop(e.id, f"restore failed: {trouble[0]}", True, aside)

    async def restore_into(self, info: BackendInfo, slot: int, file: str) -> bool:
        """Restore ``file`` into ``info``'s ``slot`` (a request is about to be sent there,
        predicted to reuse it): True. False: not restored, and the request is a prefill
        as far as anyone knows (the server clears the slot on a refusal; after no answer
        what it holds is unknown; a file gone meanwhile, judged unfit to send or of
        another model was not sent, and the slot holds what it held: reused, if at all,
        beyond prediction).
        """
        e = self.catalog.named(file)
        model = None if e is None else await self.identities.model_of(info)
        if e is None or e.model != model:
            # dropped since the decision (budget, a refusal), or of another model than the
            # one the server runs now (an external one restarted with another, unseen)
            if e is not None and model is not None:
                self.counted("foreign")
            self.log.info("slot.restore_skipped", backend=info.name, slot=slot, file=file)
            return False
        done = await self._restore(info, slot, e)
        if e.id not in self.catalog.saved:
            await self.catalog.commit()
        return bool(done)

    async def restore(self, info: BackendInfo, routed: bool = False
                      ) -> list[tuple[int, bytes]]:
        """Restore ``info``'s saved slots into it, the model it runs known (a new
        process: its slots are empty); the (slot, tokens) that came back. The server
        gone or hung: the rest wait for its next start. ``routed``: an external server,
        routed already, that may not be a new process at all (kvroute restarted, a
        health probe missed): only a slot idle and empty both on the server and in the
        router gets its file (one in use holds what is newer, and a busy one would have
        the server defer the restore past its request), and the router is told of each
        as it comes back."""
        model = self.identities.models.get(info.name)
        out: list[tuple[int, bytes]] = []
        if model is None or not saves(info):  # (never with adapters: see saves)
            return out
        slots = {e.slot for e in self.catalog.saved.values()
                 if e.backend == info.name and e.model == model}
        for slot in sorted(s for s in slots if s < info.n_slots):
            entry = self.catalog.latest(info.name, slot, model)
            assert entry is not None
            if routed and not await self._vacant(info, slot):
                continue
            done = await self._restore(info, slot, entry)
            if done is None:
                break
            if done:
                out.append((slot, entry.tokens))
                if routed and (r := self.catalog.router_of(info.name)) is not None:
                    r.seed(info.name, slot, entry.tokens)  # (refused: a request took it)
        if out:
            self.log.info("slot.restored", backend=info.name,
                          slots=[(s, len(t) // 4) for s, t in out])
        await self.catalog.commit()
        return out

    async def _vacant(self, info: BackendInfo, slot: int) -> bool:
        """Is ``info``'s ``slot`` idle and empty, on the server (`/slots`: a slot that
        never ran a task reports no prompt) and in the router (nothing routed there)?
        The router is asked last, just before the restore is sent (`/slots` waits for
        the batch under way): a request it gave that slot meanwhile would reach the
        server first and be overwritten by the restore, its next turn predicted to
        reuse what the slot no longer holds. One it gives the slot from then on
        reaches the server after the restore, which it then runs first, and is
        predicted a prefill (a restore is not known until done)."""
        got = await self._client(info, RESTORE_BASE_S).slots()
        state = next((s for s in got if s.id == slot), None) \
            if isinstance(got, list) else None
        if state is None or state.is_processing or state.n_prompt_tokens:
            return False
        r = self.catalog.router_of(info.name)
        return r is not None and r.vacant(info.name, slot)



def refused(got: object) -> bool:
    """Did the server answer that it cannot restore the file?"""
    return isinstance(got, BadResponse) and got.status == _REFUSED_STATUS and \
        server_error(got).startswith(_REFUSED)


def restore_trouble(got: object, want: int, kept: bool) -> tuple[str, str]:
    """Why a restore of a file of ``want`` tokens that answered ``got`` failed, and the
    fix; ``kept``: the file is kept for the server's next start."""
    if isinstance(got, BackendDown):
        return (f"no answer: {got.reason}", "none: the file waits for the server's next "
                "start" if kept else "see the server's log: it went away during this "
                "file's restore twice (the file is dropped)")
    if isinstance(got, BadResponse):
        return (f"server: {server_error(got)}", "none: the file waits for the server's "
                "next start; see the server's log" if kept else "none for this file "
                "(dropped); if every restore fails, run one llama-server build and model "
                "per directory")
    return (f"the server restored {got} tokens, its record says {want}", "none for this "
            "file (dropped)")
