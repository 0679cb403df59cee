"""Slots saved to disk, restored into a backend that restarts.

llama-server writes a slot's KV to a file in its `--slot-save-path` and reads it back into
a slot (`POST /slots/{id}?action=save|restore`). A backend that crashes loses its slots;
its sessions' next turns would each pay a full prefill. So a slot that stays idle for
`save_after_idle_s` after a turn (the agent is thinking, or the user reading) is saved,
and when the backend comes back (the supervisor restarts it, or kvroute itself restarts)
every saved slot is restored into the same slot before requests are routed there, and
the router is told what each holds.

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
import hashlib
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
    backend: str
    slot: int
    tokens: bytes  # int32 token bytes the slot was known to hold when saved
    saved_at: float

    @property
    def file(self) -> str:
        name = hashlib.sha256(self.backend.encode()).hexdigest()[:16]
        return f"{_PREFIX}{name}-{self.slot}.bin"


class SlotStore:
    def __init__(self, cfg: KvDiskConfig, session: aiohttp.ClientSession, router: Router,
                 counted: Callable[[str], None]) -> None:
        self.cfg, self.session, self.router, self.counted = cfg, session, router, counted
        self.log = structlog.get_logger()
        self.saved: dict[tuple[str, int], Saved] = self._load()
        self._pending: dict[tuple[str, int], asyncio.Task[None]] = {}

    # ------------------------------------------------------------------ saving
    def note(self, info: BackendInfo, slot: int) -> None:
        """A turn ended in ``info``'s ``slot``: save it once it has stayed idle."""
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
        known = self.saved.get((info.name, slot))
        if known is not None and known.tokens == tokens:
            return  # (nothing new since the last save)
        entry = Saved(info.name, slot, tokens, time.time())
        client = BackendClient(self.session, info.url, info.api_key, timeout=120)
        got = await client.slot_file(slot, "save", entry.file)
        # the slot must still hold what was saved: a turn that started meanwhile on it
        # would make the record wrong
        if not isinstance(got, int) or got < len(tokens) // 4 \
                or self.router.held(info.name, slot) != tokens:
            self.counted("save_failed")
            self._drop((info.name, slot))
            return
        with contextlib.suppress(OSError):
            (self.cfg.path / entry.file).chmod(0o600)
        self.saved[(info.name, slot)] = entry
        self.counted("saved")
        self._enforce_budget()
        self._write()
        self.log.info("slot.saved", backend=info.name, slot=slot, tokens=len(tokens) // 4)

    # --------------------------------------------------------------- restoring
    def has(self, backend: str) -> bool:
        return any(b == backend for b, _ in self.saved)

    async def restore(self, info: BackendInfo) -> list[tuple[int, bytes]]:
        """Restore ``info``'s saved slots into it (a new process: its slots are empty);
        the (slot, tokens) that came back."""
        client = BackendClient(self.session, info.url, info.api_key, timeout=120)
        out = []
        for (backend, slot), entry in sorted(self.saved.items()):
            if backend != info.name or slot >= info.n_slots:
                continue
            got = await client.slot_file(slot, "restore", entry.file)
            if isinstance(got, int) and got >= len(entry.tokens) // 4:
                out.append((slot, entry.tokens))
                self.counted("restored")
            else:
                self.log.warning("slot.restore_failed", backend=backend, slot=slot,
                                 error=str(got))
                self.counted("restore_failed")
                self._drop((backend, slot))
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
    def _drop(self, key: tuple[str, int]) -> None:
        entry = self.saved.pop(key, None)
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
            self._drop((oldest.backend, oldest.slot))

    def _write(self) -> None:
        doc = [{"backend": e.backend, "slot": e.slot, "saved_at": e.saved_at,
                "tokens": base64.b64encode(e.tokens).decode()} for e in self.saved.values()]
        tmp = self.cfg.path / (INDEX + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, self.cfg.path / INDEX)

    def _load(self) -> dict[tuple[str, int], Saved]:
        """The index a previous run left (entries whose file is gone are dropped, files
        no entry names are deleted)."""
        out: dict[tuple[str, int], Saved] = {}
        try:
            doc = json.loads((self.cfg.path / INDEX).read_text())
            for d in doc if isinstance(doc, list) else ():
                e = Saved(str(d["backend"]), int(d["slot"]), base64.b64decode(d["tokens"]),
                          float(d["saved_at"]))
                if (self.cfg.path / e.file).is_file() and len(e.tokens) % 4 == 0:
                    out[(e.backend, e.slot)] = e
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
