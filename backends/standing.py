"""Where each backend stands, and who hears of it.

`Standing` is one backend's state (starting | held | ready | down | failed | stopped),
its last error, its URL and, while it is ready, its `BackendInfo`. The component that
supervises the backend changes it through its methods only: each change of state is
logged and mirrored to `backends.json`; each change of whether it is ready is told to the
subscribers (a backend ready again is a new process: an empty cache).

`Listeners` are the pool's: its subscribers, and `log_dir/backends.json`, which mirrors the
states (no keys) so `kvroute doctor` can find the running servers.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from backends.config import LLAMA, BackendConfig, ExternalBackendConfig, ManagedBackendConfig
from backends.info import BackendInfo

log = structlog.get_logger("backends.supervisor")  # (the supervisor's log)

Subscriber = Callable[[str, BackendInfo | None], None]
Statuses = Callable[[], list[dict[str, object]]]
# what backends.json keeps of each status (no API keys: the file is world-readable)
MIRRORED = ("name", "managed", "state", "url", "pid", "restarts", "log", "last_error",
            "crash_loop")


class Listeners:
    """The subscribers to a pool's backends, and the file that mirrors their states."""

    def __init__(self, state_file: Path, statuses: Statuses) -> None:
        """``statuses``: every backend's status, as the file mirrors it."""
        self.state_file = state_file
        self._statuses = statuses
        self._subscribers: list[Subscriber] = []

    def subscribe(self, cb: Subscriber) -> None:
        self._subscribers.append(cb)

    def notify(self, name: str, info: BackendInfo | None) -> None:
        for cb in list(self._subscribers):
            try:
                cb(name, info)
            except Exception:  # a subscriber's bug must not take supervision down
                log.exception("supervisor.subscriber_failed", backend=name)
        self.write()

    def write(self) -> None:
        """Mirror the states for `kvroute doctor` (best effort: doctor only)."""
        data = {"kvroute_pid": os.getpid(), "updated": time.time(),
                "backends": [{k: s[k] for k in MIRRORED} for s in self._statuses()]}
        tmp = self.state_file.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(data, indent=1))
            os.replace(tmp, self.state_file)
        except OSError:
            pass

    def remove(self) -> None:
        self.state_file.unlink(missing_ok=True)


class Standing:
    """One backend's state, as its status shows it and the subscribers hear of it."""

    def __init__(self, name: str, listeners: Listeners) -> None:
        self.name = name
        self._listeners = listeners
        self._state = "stopped"
        self._last_error: str | None = None
        self._url: str | None = None
        self._info: BackendInfo | None = None
        self._ready_since: float | None = None  # time.time() of the last change to ready
        self._settled = asyncio.Event()

    @property
    def state(self) -> str:
        return self._state

    @property
    def last_error(self) -> str | None:
        return self._last_error

    @property
    def url(self) -> str | None:
        return self._url

    @property
    def info(self) -> BackendInfo | None:
        """The backend as the proxy needs it, while it is ready (else None)."""
        return self._info

    async def settled(self) -> None:
        """Once it was first ready, held, down or failed (the pool's start() waits)."""
        await self._settled.wait()

    def set(self, state: str, error: str | None = None) -> None:
        """Now ``state`` (an error, when given, is its last)."""
        self._state = state
        if error is not None:
            self._last_error = error
        log.info("backend.state", backend=self.name, state=state, url=self._url, error=error)
        self._listeners.write()

    def become(self, state: str, error: str | None) -> None:
        """set(), unless it already is so, with that error."""
        if self._state != state or self._last_error != error:
            self.set(state, error)

    def moved(self, url: str | None) -> None:
        """It is reached at ``url`` now."""
        self._url = url

    def settle(self) -> None:
        """It was ready, held, down or failed: settled()."""
        self._settled.set()

    def up(self, info: BackendInfo) -> None:
        """Ready: the subscribers route to it."""
        self._info, self._ready_since = info, time.time()
        self.set("ready")
        self._listeners.notify(self.name, info)

    def down(self) -> None:
        """Not ready (any more): the subscribers hear it once."""
        if self._info is not None:
            self._info = None
            self._listeners.notify(self.name, None)

    def stopped(self) -> None:
        """The pool stopped (not logged: the pool's stop is)."""
        self.down()
        self._state = "stopped"

    def status(self, cfg: BackendConfig, *, agent: str | None = None, pid: int | None = None,
               restarts: int = 0, log_path: Path | None = None,
               crash_loop: dict[str, object] | None = None) -> dict[str, object]:
        """Its status (/kvroute/status, backends.json), with what the supervising
        component adds: the agent that runs it, its process, restarts, log and crash loop."""
        info = self._info
        return {
            "name": cfg.name,
            "managed": isinstance(cfg, ManagedBackendConfig),
            "kind": cfg.kind if isinstance(cfg, ExternalBackendConfig) else LLAMA,
            "state": self._state,
            "agent": agent,
            "healthy": info is not None,
            "url": self._url,
            "pid": pid,
            "restarts": restarts,
            "last_error": self._last_error,
            "ready_since": self._ready_since,
            "log": str(log_path) if log_path is not None else None,
            "n_slots": info.n_slots if info else None,
            "slot_ctx": info.slot_ctx if info else None,
            "model": info.model if info else None,
            # dense, swa or hybrid: the last two reuse a prefix only up to a context
            # checkpoint, and get no disk tier (a restored slot has no checkpoints)
            "memory": info.memory.name if info else None,
            # media it takes (vision, audio, video), as its /props says: what its
            # projector serves
            "modalities": sorted(info.modalities) if info else None,
            "devices": list(cfg.devices) if isinstance(cfg, ManagedBackendConfig) else None,
            # the projector it serves media with (an external one's is not known here)
            "mmproj": str(cfg.mmproj) if isinstance(cfg, ManagedBackendConfig)
            and cfg.mmproj is not None else None,
            # its LoRA adapters, by id (0, 1, ...: what a request's `lora` field names)
            "lora": [str(p) for p in cfg.lora] if isinstance(cfg, ManagedBackendConfig)
            else None,
            # what died, its log's tail, its command line and the likely fix
            "crash_loop": crash_loop,
        }
