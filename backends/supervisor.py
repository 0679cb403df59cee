"""All configured backends, as one pool: start, stop, their states and who hears of them.

Each backend is a component of its own, with its own task: a managed one's lifecycle is
backends/managed.py, an external one's probe and an agent's reports backends/external.py;
each keeps its state in a `Standing` (backends/standing.py). Subscribers hear
cb(name, None) when a backend goes down and cb(name, info) when it is ready again (a
restarted server has an empty cache), so the router can forget what it held.
`log_dir/backends.json` mirrors the states (no keys) so `kvroute doctor` can find the
running servers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import Generic, TypeVar

import aiohttp
import structlog

from backends.binary import find_llama_server
from backends.config import BackendConfig, FleetSpec, ManagedBackendConfig
from backends.crash_loop import Unavailable
from backends.external import ExternalBackend, RemoteBackend
from backends.info import BackendInfo
from backends.managed import Launcher, ManagedBackend
from backends.remote import AgentWatch, Reported
from backends.standing import Listeners, Subscriber

log = structlog.get_logger(__name__)

C = TypeVar("C", bound=FleetSpec)
Member = ManagedBackend | ExternalBackend | RemoteBackend


class Supervisor(Generic[C]):
    def __init__(self, config: C, host: str = "127.0.0.1") -> None:
        """``host``: where managed llama-servers listen (an agent's: an address that
        routers on other hosts reach)."""
        self.config = config
        self.host = host
        self.state_file = config.log_dir / "backends.json"
        self._listeners = Listeners(self.state_file, self.statuses)
        self._backends: dict[str, Member] = {b.name: self._member(b) for b in config.backends}
        self._agents: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None

    def _member(self, cfg: BackendConfig) -> ManagedBackend | ExternalBackend:
        sup = self.config.supervision
        if isinstance(cfg, ManagedBackendConfig):
            disk = self.config.kv_disk
            launcher = Launcher(cfg, self.host, self.config.log_dir / f"{cfg.name}.log",
                                disk.path if disk is not None else None)
            return ManagedBackend(cfg, self._listeners, launcher, sup)
        return ExternalBackend(cfg, self._listeners, self.config.gguf_of(cfg.name),
                               sup.health_interval_s)

    # -- public API ---------------------------------------------------------------------

    async def start(self) -> None:
        """Spawn managed backends, start health loops; return once each is ready or failed."""
        assert self._session is None, "start() called twice"
        self.config.log_dir.mkdir(parents=True, exist_ok=True)
        if self.config.kv_disk is not None:  # the servers write slots there: ours alone
            self.config.kv_disk.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.config.kv_disk.path.chmod(0o700)
        session = self._session = aiohttp.ClientSession()
        binary = None
        if self.config.managed():
            found = find_llama_server(self.config.llama_server)
            binary = found.path if found else None
        members = list(self._backends.values())
        for b in members:
            if isinstance(b, ManagedBackend):
                b.start(session, binary)
            elif isinstance(b, ExternalBackend):
                b.start(session)
        watches = [AgentWatch(link, session, self) for link in self.config.agents]
        self._agents = [asyncio.create_task(w.run(), name=f"kvroute-agent-{w.link.name}")
                        for w in watches]
        timeout = self.config.supervision.startup_timeout_s + 10
        waits = [b.standing.settled() for b in members]
        waits += [w.settled.wait() for w in watches]
        try:
            await asyncio.wait_for(asyncio.gather(*waits), timeout)
        except TimeoutError:
            log.warning("supervisor.start_timeout", seconds=timeout)

    async def stop(self) -> None:
        """Stop every child (whole process groups), no orphans. Idempotent."""
        for t in self._agents:
            t.cancel()
        running = [b for b in self._backends.values() if not isinstance(b, RemoteBackend)]
        await asyncio.gather(*self._agents, *(b.stop() for b in running),
                             return_exceptions=True)
        for b in self._backends.values():
            b.standing.stopped()
        if self._session is not None:
            await self._session.close()
            self._session = None
        self._listeners.remove()

    def ready(self) -> list[BackendInfo]:
        return [info for b in self._backends.values() if (info := b.standing.info) is not None]

    def statuses(self) -> list[dict[str, object]]:
        return [b.status() for b in self._backends.values()]

    def why_down(self, names: Iterable[str]) -> Unavailable | None:
        """Which of these backends are in a crash loop, what died and the fix, and when
        one may serve again (None: none is in one)."""
        loops = [why for n in names if isinstance(b := self._backends.get(n), ManagedBackend)
                 and (why := b.why_down()) is not None]
        if not loops:
            return None
        now = time.time()
        waits = [until - now for _, until in loops if until is not None]
        return Unavailable("; ".join(summary for summary, _ in loops),
                           max(1.0, min(waits, default=1.0)))

    def subscribe(self, cb: Subscriber) -> None:
        """cb(name, info) when a backend becomes ready (a fresh process: empty cache),
        cb(name, None) when it goes down."""
        self._listeners.subscribe(cb)

    def pid(self, name: str) -> int | None:
        b = self._backends.get(name)
        return b.pid() if isinstance(b, ManagedBackend) else None

    def get(self, name: str) -> BackendInfo | None:
        b = self._backends.get(name)
        return b.standing.info if b else None

    # -- an agent's backends (backends/remote.py's RemoteFleet) -----------------------------

    def remote(self, report: Reported) -> None:
        """What an agent says of one of its backends now."""
        name = report.cfg.name
        b = self._backends.get(name)
        if b is None:
            b = self._backends[name] = RemoteBackend(report.cfg, report.agent, self._listeners)
        elif not isinstance(b, RemoteBackend) or b.agent != report.agent:
            # a configured backend of that name: it stays
            log.warning("agent.name_taken", backend=name, agent=report.agent)
            return
        b.reported(report)

    def _of_agent(self, agent: str, name: str) -> RemoteBackend | None:
        """``agent``'s backend ``name`` (None: none, or a configured one of that name)."""
        b = self._backends.get(name)
        return b if isinstance(b, RemoteBackend) and b.agent == agent else None

    def remote_down(self, agent: str, name: str, error: str) -> None:
        """Its agent does not answer: down until it says otherwise."""
        b = self._of_agent(agent, name)
        if b is None:
            return
        b.standing.down()
        b.standing.become("down", error)

    def forget(self, agent: str, name: str) -> None:
        """Its agent no longer lists it."""
        b = self._of_agent(agent, name)
        if b is None:
            return
        del self._backends[name]
        log.info("backend.gone", backend=name, agent=agent)
        b.standing.down()
        self._listeners.write()
