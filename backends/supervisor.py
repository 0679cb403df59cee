"""All configured backends, as one pool: start, stop, their states and who hears of them.

Each backend has a task of its own: a managed one's lifecycle is backends/managed.py, an
external one's probe and an agent's reports backends/external.py. Subscribers hear
cb(name, None) when a backend goes down and cb(name, info) when it is ready again (a
restarted server has an empty cache), so the router can forget what it held.
`log_dir/backends.json` mirrors the states (no keys) so `kvroute doctor` can find the
running servers.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Generic, TypeVar

import aiohttp
import structlog

from backends.binary import find_llama_server
from backends.config import LLAMA, ExternalBackendConfig, FleetSpec
from backends.crash_loop import Unavailable
from backends.external import ExternalBackends
from backends.info import Backend, BackendInfo
from backends.managed import ManagedBackends
from backends.remote import AgentWatch

log = structlog.get_logger(__name__)

C = TypeVar("C", bound=FleetSpec)
Subscriber = Callable[[str, BackendInfo | None], None]


class Supervisor(ManagedBackends, ExternalBackends, Generic[C]):
    def __init__(self, config: C, host: str = "127.0.0.1") -> None:
        """``host``: where managed llama-servers listen (an agent's: an address that
        routers on other hosts reach)."""
        self.config = config
        self.host = host
        self._agents: list[asyncio.Task[None]] = []
        self._backends = {b.name: Backend(b) for b in config.backends}
        self._subscribers: list[Subscriber] = []
        self._session: aiohttp.ClientSession | None = None
        self._stopping = False
        self._binary: Path | None = None
        self.state_file = config.log_dir / "backends.json"

    # -- public API ---------------------------------------------------------------------

    async def start(self) -> None:
        """Spawn managed backends, start health loops; return once each is ready or failed."""
        assert self._session is None, "start() called twice"
        self.config.log_dir.mkdir(parents=True, exist_ok=True)
        if self.config.kv_disk is not None:  # the servers write slots there: ours alone
            self.config.kv_disk.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.config.kv_disk.path.chmod(0o700)
        self._session = aiohttp.ClientSession()
        if self.config.managed():
            found = find_llama_server(self.config.llama_server)
            self._binary = found.path if found else None
        for b in self._backends.values():
            run = self._run_managed if b.managed else self._run_external
            b.task = asyncio.create_task(run(b), name=f"kvroute-backend-{b.cfg.name}")
        watches = [AgentWatch(link, self._session, self) for link in self.config.agents]
        self._agents = [asyncio.create_task(w.run(), name=f"kvroute-agent-{w.link.name}")
                        for w in watches]
        timeout = self.config.supervision.startup_timeout_s + 10
        waits = [b.settled.wait() for b in self._backends.values()]
        waits += [w.settled.wait() for w in watches]
        try:
            await asyncio.wait_for(asyncio.gather(*waits), timeout)
        except TimeoutError:
            log.warning("supervisor.start_timeout", seconds=timeout)

    async def stop(self) -> None:
        """Stop every child (whole process groups), no orphans. Idempotent."""
        self._stopping = True
        tasks = [*self._agents, *(b.task for b in self._backends.values() if b.task)]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        grace = self.config.supervision.stop_grace_s
        procs = [b.process for b in self._backends.values() if b.process is not None]
        await asyncio.gather(*(p.stop(grace) for p in procs), return_exceptions=True)
        for b in self._backends.values():
            if b.info is not None:
                b.info = None
                self._notify(b.cfg.name, None)
            b.state, b.process = "stopped", None
        if self._session is not None:
            await self._session.close()
            self._session = None
        self.state_file.unlink(missing_ok=True)

    def ready(self) -> list[BackendInfo]:
        return [b.info for b in self._backends.values() if b.info is not None]

    def statuses(self) -> list[dict[str, object]]:
        out: list[dict[str, object]] = []
        for b in self._backends.values():
            info = b.info
            out.append({
                "name": b.cfg.name,
                "managed": b.managed,
                "kind": b.cfg.kind if isinstance(b.cfg, ExternalBackendConfig) else LLAMA,
                "state": b.state,
                "agent": b.agent,
                "healthy": info is not None,
                "url": b.url,
                "pid": self.pid(b.cfg.name),
                "restarts": b.restarts,
                "last_error": b.last_error,
                "ready_since": b.ready_since,
                "log": str(self._log_path(b.cfg.name)) if b.managed else None,
                "n_slots": info.n_slots if info else None,
                "slot_ctx": info.slot_ctx if info else None,
                "model": info.model if info else None,
                # dense, swa or hybrid: the last two reuse a prefix only up to a context
                # checkpoint, and get no disk tier (a restored slot has no checkpoints)
                "memory": info.memory.name if info else None,
                # what died, its log's tail, its command line and the likely fix
                "crash_loop": b.crashes.report() if b.crashes else None,
            })
        return out

    def why_down(self, names: Iterable[str]) -> Unavailable | None:
        """Which of these backends are in a crash loop, what died and the fix, and when
        one may serve again (None: none is in one)."""
        loops = [(n, c) for n in names
                 if (b := self._backends.get(n)) and (c := b.crashes) and c.looping]
        if not loops:
            return None
        now = time.time()
        waits = [c.until - now for _, c in loops if c.until is not None]
        return Unavailable("; ".join(c.summary(n) for n, c in loops),
                           max(1.0, min(waits, default=1.0)))

    def subscribe(self, cb: Subscriber) -> None:
        """cb(name, info) when a backend becomes ready (a fresh process: empty cache),
        cb(name, None) when it goes down."""
        self._subscribers.append(cb)

    def pid(self, name: str) -> int | None:
        b = self._backends.get(name)
        if b is None or b.process is None or not b.process.alive():
            return None
        return b.process.pid

    def get(self, name: str) -> BackendInfo | None:
        b = self._backends.get(name)
        return b.info if b else None

    # -- internals ------------------------------------------------------------------------

    def _log_path(self, name: str) -> Path:
        return self.config.log_dir / f"{name}.log"

    def _notify(self, name: str, info: BackendInfo | None) -> None:
        for cb in list(self._subscribers):
            try:
                cb(name, info)
            except Exception:  # a subscriber's bug must not take supervision down
                log.exception("supervisor.subscriber_failed", backend=name)
        self._write_state()

    def _set(self, b: Backend, state: str, error: str | None = None) -> None:
        b.state = state
        if error is not None:
            b.last_error = error
        log.info("backend.state", backend=b.cfg.name, state=state, url=b.url, error=error)
        self._write_state()

    def _write_state(self) -> None:
        """Mirror states for `kvroute doctor` (no API keys: the file is world-readable)."""
        data = {"kvroute_pid": os.getpid(), "updated": time.time(), "backends": [
            {k: s[k] for k in ("name", "managed", "state", "url", "pid", "restarts", "log",
                               "last_error", "crash_loop")}
            for s in self.statuses()]}
        tmp = self.state_file.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(data, indent=1))
            os.replace(tmp, self.state_file)
        except OSError:
            pass  # best effort: doctor only
