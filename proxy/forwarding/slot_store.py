"""The disk tier: slots saved to files, restored into any backend of the host.

llama-server writes a slot's KV to a file in its `--slot-save-path` and reads it back into
any slot of any server of the same model and build (`POST /slots/{id}?action=save|
restore`). A slot that stays idle for `save_after_idle_s` after a turn (the agent is
thinking, the user reading) is saved; a later save of the same conversation replaces the
file, another conversation in that slot gets a file of its own. The router holds every
file's tokens in its tree: a request whose prefix a file holds better than the slot it
is given (the conversation's backend is busy or gone, its slot reused since) has that
file restored into the slot first (`Decision.restore`). And when a backend comes back
(the supervisor restarts it, or kvroute itself restarts) each of its slots gets its last
saved content back before requests are routed there.

What a file holds is recorded beside it (`index.json`: backend, slot, the token ids the
router knew the slot to hold), so a restore is predicted exactly. File names are
kvroute's own (no client input reaches a path); files are 0600 in a 0700 directory; the
budget (`max_gib`) drops the oldest saves; a file that fails to restore (truncated,
another model or build) is dropped and counted, and the slot starts empty.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import structlog

from backends.client import BackendClient
from backends.config import KvDiskConfig
from backends.supervisor import BackendInfo
from proxy.routing.router import Router

INDEX = "index.json"
_PREFIX = "kvroute-"


@dataclass
class Saved:
    id: int
    backend: str  # where it was saved from (restored there after a restart)
    slot: int
    tokens: bytes  # int32 token bytes the slot was known to hold when saved
    saved_at: float

    @property
    def file(self) -> str:
        return f"{_PREFIX}{self.id}.bin"


class SlotStore:
    def __init__(self, cfg: KvDiskConfig, session: aiohttp.ClientSession, router: Router,
                 counted: Callable[[str], None]) -> None:
        self.cfg, self.session, self.router, self.counted = cfg, session, router, counted
        self.log = structlog.get_logger()
        self.saved: dict[int, Saved] = self._load()
        self._next = max(self.saved, default=0) + 1
        for e in self.saved.values():  # any backend of the host may restore them
            router.disk_add(e.id, e.file, e.tokens)
        self._pending: dict[tuple[str, int], asyncio.Task[None]] = {}

    # ------------------------------------------------------------------ saving
    def note(self, info: BackendInfo, slot: int) -> None:
        """A turn ended in ``info``'s ``slot``: save it once it has stayed idle. Not on a
        sliding-window or hybrid model: the server restores a slot without its context
        checkpoints, so only a continuation could use it (docs/checkpoints.md)."""
        if info.memory.name != "dense":
            return
        key = (info.name, slot)
        old = self._pending.pop(key, None)
        if old is not None:
            old.cancel()
        task = asyncio.create_task(self._save_when_idle(info, slot))
        self._pending[key] = task
        task.add_done_callback(lambda t: self._pending.pop(key, None)
                               if self._pending.get(key) is t else None)

    async def _save_when_idle(self, info: BackendInfo, slot: int) -> None:
        await asyncio.sleep(self.cfg.save_after_idle_s)
        tokens = self.router.held(info.name, slot)
        if tokens is None or len(tokens) // 4 < self.cfg.min_tokens:
            return
        known = self._latest(info.name, slot)
        if known is not None and known.tokens == tokens:
            return  # (nothing new since the last save)
        entry = Saved(self._next, info.name, slot, tokens, time.time())
        self._next += 1
        client = BackendClient(self.session, info.url, info.api_key, timeout=120)
        got = await client.slot_file(slot, "save", entry.file)
        # the slot must still hold what was saved: a turn that started meanwhile on it
        # would make the record wrong
        if not isinstance(got, int) or got < len(tokens) // 4 \
                or self.router.held(info.name, slot) != tokens:
            self.counted("save_failed")
            self._drop(entry.id)
            return
        with contextlib.suppress(OSError):
            (self.cfg.path / entry.file).chmod(0o600)
        if known is not None and tokens.startswith(known.tokens):
            self._drop(known.id)  # the same conversation, further on
        self.saved[entry.id] = entry
        self.router.disk_add(entry.id, entry.file, tokens)
        self.counted("saved")
        self._enforce_budget()
        self._write()
        self.log.info("slot.saved", backend=info.name, slot=slot, tokens=len(tokens) // 4)

    # --------------------------------------------------------------- restoring
    def has(self, backend: str) -> bool:
        return any(e.backend == backend for e in self.saved.values())

    def _latest(self, backend: str, slot: int) -> Saved | None:
        mine = [e for e in self.saved.values() if (e.backend, e.slot) == (backend, slot)]
        return max(mine, key=lambda e: e.saved_at, default=None)

    async def restore_into(self, info: BackendInfo, slot: int, file: str) -> bool:
        """Restore ``file`` into ``info``'s ``slot`` (a request is about to be sent there,
        predicted to reuse it)."""
        client = BackendClient(self.session, info.url, info.api_key, timeout=120)
        got = await client.slot_file(slot, "restore", file)
        ok = isinstance(got, int)
        self.counted("restored" if ok else "restore_failed")
        if not ok:
            self.log.warning("slot.restore_failed", backend=info.name, slot=slot,
                             file=file, error=str(got))
        return ok

    async def restore(self, info: BackendInfo) -> list[tuple[int, bytes]]:
        """Restore ``info``'s saved slots into it (a new process: its slots are empty);
        the (slot, tokens) that came back."""
        client = BackendClient(self.session, info.url, info.api_key, timeout=120)
        out = []
        slots = {e.slot for e in self.saved.values() if e.backend == info.name}
        for slot in sorted(s for s in slots if s < info.n_slots):
            entry = self._latest(info.name, slot)
            assert entry is not None
            got = await client.slot_file(slot, "restore", entry.file)
            if isinstance(got, int) and got >= len(entry.tokens) // 4:
                out.append((slot, entry.tokens))
                self.counted("restored")
            else:
                self.log.warning("slot.restore_failed", backend=info.name, slot=slot,
                                 error=str(got))
                self.counted("restore_failed")
                self._drop(entry.id)
        if out:
            self.log.info("slot.restored", backend=info.name,
                          slots=[(s, len(t) // 4) for s, t in out])
        self._write()
        return out

    async def close(self) -> None:
        for task in list(self._pending.values()):
            task.cancel()
        await asyncio.gather(*self._pending.values(), return_exceptions=True)

    # ------------------------------------------------------------------ the files
    def _drop(self, entry_id: int) -> None:
        entry = self.saved.pop(entry_id, None)
        self.router.disk_drop(entry_id)
        if entry is not None:
            with contextlib.suppress(OSError):
                (self.cfg.path / entry.file).unlink()

    def _enforce_budget(self) -> None:
        budget = self.cfg.max_gib * (1 << 30)
        by_age = sorted(self.saved.values(), key=lambda e: e.saved_at)
        total = sum(_size(self.cfg.path / e.file) for e in by_age)
        while by_age and total > budget:
            oldest = by_age.pop(0)
            total -= _size(self.cfg.path / oldest.file)
            self._drop(oldest.id)

    def _write(self) -> None:
        doc = [{"id": e.id, "backend": e.backend, "slot": e.slot, "saved_at": e.saved_at,
                "tokens": base64.b64encode(e.tokens).decode()} for e in self.saved.values()]
        tmp = self.cfg.path / (INDEX + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, self.cfg.path / INDEX)

    def _load(self) -> dict[int, Saved]:
        """The index a previous run left (entries whose file is gone are dropped, files
        no entry names are deleted)."""
        out: dict[int, Saved] = {}
        try:
            doc = json.loads((self.cfg.path / INDEX).read_text())
            for d in doc if isinstance(doc, list) else ():
                e = Saved(int(d["id"]), str(d["backend"]), int(d["slot"]),
                          base64.b64decode(d["tokens"]), float(d["saved_at"]))
                if (self.cfg.path / e.file).is_file() and len(e.tokens) % 4 == 0:
                    out[e.id] = e
        except (OSError, ValueError, KeyError, TypeError):
            pass  # none yet, or unreadable: start empty
        named = {e.file for e in out.values()}
        with contextlib.suppress(OSError):
            for f in Path(self.cfg.path).glob(f"{_PREFIX}*.bin"):
                if f.name not in named:
                    f.unlink()
        return out


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
