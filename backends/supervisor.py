"""All configured backends: start, watch, restart, stop.

Managed backend lifecycle (one asyncio task each):

    starting --/health 200, /props read--> ready --exit or 5 failed probes--> down
        ^                                                                     |
        +------------------ backoff (0.5 s, doubling, max 30 s) -------------+

Each (re)start picks a new free loopback port and a new random API key (the key keeps
clients from bypassing the proxy; a new port avoids racing a dying process's socket).
A restarted server has an empty cache, and subscribers hear cb(name, None) when it goes
down and cb(name, info) when it is ready again, so the router can forget what it held.

External backends are only probed; a down external backend is a state, never an error.
Backends an agent runs on another host come and go as its answers say (backends/remote.py):
named "<agent>/<backend>", never started or probed here.
`log_dir/backends.json` mirrors the states (no keys) so `kvroute doctor` can find the
running servers.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, TypeVar

import aiohttp
import structlog

from backends.binary import find_llama_server
from backends.client import BackendClient, BadResponse, Health, Props
from backends.config import (
    EXTERNAL_KV_BYTES,
    LLAMA,
    OPENAI,
    ExternalBackendConfig,
    FleetSpec,
    ManagedBackendConfig,
)
from backends.memory import DENSE, MemoryKind, gguf_kv_bytes_per_token, server_memory
from backends.process import Failed, LlamaServerProcess, ServerSpec, free_port
from backends.remote import AgentWatch, Reported

log = structlog.get_logger(__name__)

MiB = 1 << 20
DEFAULT_KV_BYTES_PER_TOKEN = 131072  # when a GGUF's metadata does not tell
UNHEALTHY_PROBES = 5  # consecutive failed /health probes before a restart


@dataclass(frozen=True)
class BackendInfo:
    """A ready backend, as the proxy needs it."""

    name: str
    url: str  # "http://127.0.0.1:PORT" (external: as configured)
    # key the proxy must send (Authorization: Bearer); kept out of repr: never logged
    api_key: str | None = field(repr=False)
    n_slots: int  # from /props total_slots
    slot_ctx: int  # from /props default_generation_settings.n_ctx
    ram_cache_bytes: int  # --cache-ram in bytes (0 if off/unknown)
    kv_bytes_per_token: int  # from GGUF metadata (managed) or the config (external)
    model: str  # model id/alias as /v1/models reports it
    managed: bool
    memory: MemoryKind = DENSE  # what the server can cut its cache back to
    kind: str = LLAMA  # OPENAI: speaks the OpenAI API only (no id_slot, /slots, /props)


C = TypeVar("C", bound=FleetSpec)
Subscriber = Callable[[str, BackendInfo | None], None]


@dataclass
class _Backend:
    """Mutable runtime state of one backend (owned by its task)."""

    cfg: ManagedBackendConfig | ExternalBackendConfig
    state: str = "stopped"  # starting | ready | down | failed | stopped
    info: BackendInfo | None = None
    process: LlamaServerProcess | None = None
    url: str | None = None
    restarts: int = 0
    last_error: str | None = None
    ready_since: float | None = None  # time.time() of the last transition to ready
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # first ready/failed
    task: asyncio.Task[None] | None = None
    agent: str | None = None  # the agent that runs it on another host (None: ours)

    @property
    def managed(self) -> bool:
        return isinstance(self.cfg, ManagedBackendConfig)


class Supervisor(Generic[C]):
    def __init__(self, config: C, host: str = "127.0.0.1") -> None:
        """``host``: where managed llama-servers listen (an agent's: an address that
        routers on other hosts reach)."""
        self.config = config
        self.host = host
        self._agents: list[asyncio.Task[None]] = []
        self._backends = {b.name: _Backend(b) for b in config.backends}
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
            })
        return out

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

    def _set(self, b: _Backend, state: str, error: str | None = None) -> None:
        b.state = state
        if error is not None:
            b.last_error = error
        log.info("backend.state", backend=b.cfg.name, state=state, url=b.url, error=error)
        self._write_state()

    def _write_state(self) -> None:
        """Mirror states for `kvroute doctor` (no API keys: the file is world-readable)."""
        data = {"kvroute_pid": os.getpid(), "updated": time.time(), "backends": [
            {k: s[k] for k in ("name", "managed", "state", "url", "pid", "restarts", "log")}
            for s in self.statuses()]}
        tmp = self.state_file.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(data, indent=1))
            os.replace(tmp, self.state_file)
        except OSError:
            pass  # best effort: doctor only

    async def _run_managed(self, b: _Backend) -> None:
        cfg = b.cfg
        assert isinstance(cfg, ManagedBackendConfig) and self._session is not None
        sup = self.config.supervision
        backoff = sup.restart_backoff_s
        kv = await asyncio.to_thread(gguf_kv_bytes_per_token, cfg.model)
        while not self._stopping:
            if self._binary is None:
                self._set(b, "failed", "llama-server not found "
                          "(fix: run `python -m backends prepare`, or set llama_server)")
                b.settled.set()
                return
            spec = ServerSpec(
                binary=self._binary, model=cfg.model, port=free_port(self.host),
                host=self.host, slots=cfg.slots,
                ctx_per_slot=cfg.ctx_per_slot, threads=cfg.threads,
                api_key=secrets.token_urlsafe(24), cache_ram_mib=cfg.cache_ram_mib,
                alias=cfg.alias, extra_args=cfg.extra_args, env=cfg.env,
                slot_save_path=self.config.kv_disk.path if self.config.kv_disk else None,
            )
            proc = LlamaServerProcess(spec, self._log_path(cfg.name))
            b.process, b.url = proc, spec.url
            self._set(b, "starting")
            try:
                proc.spawn()
            except OSError as e:
                self._set(b, "failed", f"cannot start {spec.binary}: {e}")
                b.settled.set()
                return
            error = await self._bring_up(b, proc, spec, kv or DEFAULT_KV_BYTES_PER_TOKEN)
            if error is None:
                t_ready = time.monotonic()
                error = await self._watch(b, proc)
                if time.monotonic() - t_ready > 60:
                    backoff = sup.restart_backoff_s  # it ran fine for a while: not a crash loop
            if self._stopping:
                return
            if b.info is not None:
                b.info = None
                self._notify(cfg.name, None)
            rc = await proc.stop(sup.stop_grace_s)
            b.process = None
            b.restarts += 1
            self._set(b, "down", f"{error} (exit code {rc}); restarting in {backoff:.1f} s; "
                      f"see {proc.log_path}")
            b.settled.set()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, sup.restart_backoff_max_s)

    async def _bring_up(self, b: _Backend, proc: LlamaServerProcess, spec: ServerSpec,
                        kv: int) -> str | None:
        """Wait for /health, read /props; publish the BackendInfo. Returns an error or None."""
        assert self._session is not None
        res = await proc.wait_ready(self._session, self.config.supervision.startup_timeout_s)
        if isinstance(res, Failed):
            return f"{res.reason}; last log lines:\n{res.log_tail}"
        props = await BackendClient(self._session, spec.url, spec.api_key).props()
        if not isinstance(props, Props):
            return f"/props failed: {props}"
        cfg = b.cfg
        assert isinstance(cfg, ManagedBackendConfig)
        memory = await asyncio.to_thread(server_memory, cfg.model, spec.argv(),
                                         props.slot_ctx, props.total_slots)
        b.info = BackendInfo(
            name=cfg.name, url=spec.url, api_key=spec.api_key, n_slots=props.total_slots,
            slot_ctx=props.slot_ctx, ram_cache_bytes=cfg.cache_ram_mib * MiB,
            # (of the layers whose cache grows with the context: a sliding one's does not)
            kv_bytes_per_token=memory.kv_bytes_per_token or kv, model=props.model_alias,
            managed=True, memory=memory,
        )
        b.ready_since = time.time()
        self._set(b, "ready")
        log.info("backend.ready", backend=cfg.name, url=spec.url, pid=proc.pid,
                 seconds=round(res.seconds, 2), slots=props.total_slots, n_ctx=props.slot_ctx)
        self._notify(cfg.name, b.info)
        b.settled.set()
        return None

    async def _watch(self, b: _Backend, proc: LlamaServerProcess) -> str:
        """Return why a ready backend stopped being usable."""
        assert self._session is not None and b.info is not None
        client = BackendClient(self._session, b.info.url, b.info.api_key, timeout=5.0)
        interval = self.config.supervision.health_interval_s
        failures, next_probe = 0, time.monotonic() + interval
        while True:
            # exits are caught within 0.2 s by polling (no SIGCHLD handler to fight over)
            await asyncio.sleep(0.2)
            if proc.exited():
                return "llama-server exited"
            if time.monotonic() < next_probe:
                continue
            next_probe = time.monotonic() + interval
            h = await client.health()
            failures = 0 if isinstance(h, Health) and h.ok else failures + 1
            if failures >= UNHEALTHY_PROBES:
                return f"/health failed {failures} times in a row ({h})"

    async def _external_kv_bytes(self, cfg: ExternalBackendConfig) -> int:
        """The configured size, else that of the GGUF the proxy tokenizes with."""
        if cfg.kv_bytes_per_token is not None:
            return cfg.kv_bytes_per_token
        gguf = self.config.gguf_of(cfg.name)
        kv = None if gguf is None else await asyncio.to_thread(gguf_kv_bytes_per_token, gguf)
        return kv or EXTERNAL_KV_BYTES

    async def _probe_openai(self, b: _Backend, client: BackendClient) -> str | None:
        """A server of the OpenAI API is up while its /v1/models answers (it serves the
        first model listed); the error, or None."""
        cfg = b.cfg
        assert isinstance(cfg, ExternalBackendConfig)
        models = await client.models()
        if not isinstance(models, list):
            key = isinstance(models, BadResponse) and models.status in (401, 403)
            hint = "check api_key" if key else "is the url the server's root?"
            return f"/v1/models: {models} (fix: {hint})"
        if b.info is None:
            b.info = BackendInfo(
                name=cfg.name, url=cfg.url, api_key=cfg.api_key, n_slots=cfg.sequences,
                slot_ctx=cfg.ctx, ram_cache_bytes=0,
                kv_bytes_per_token=await self._external_kv_bytes(cfg), model=models[0],
                managed=False, kind=OPENAI)
            b.ready_since = time.time()
            self._set(b, "ready")
            self._notify(cfg.name, b.info)
        return None

    async def _run_external(self, b: _Backend) -> None:
        cfg = b.cfg
        assert isinstance(cfg, ExternalBackendConfig) and self._session is not None
        client = BackendClient(self._session, cfg.url, cfg.api_key, timeout=5.0)
        b.url = cfg.url
        while not self._stopping:
            error: str | None = None
            if cfg.kind == OPENAI:
                error = await self._probe_openai(b, client)
            elif not (isinstance(h := await client.health(), Health) and h.ok):
                error = f"/health: {h}"
            elif b.info is None:
                props = await client.props()
                if isinstance(props, Props):
                    b.info = BackendInfo(
                        name=cfg.name, url=cfg.url, api_key=cfg.api_key,
                        n_slots=props.total_slots, slot_ctx=props.slot_ctx,
                        ram_cache_bytes=cfg.cache_ram_mib * MiB,
                        kv_bytes_per_token=await self._external_kv_bytes(cfg),
                        model=props.model_alias, managed=False,
                        memory=await asyncio.to_thread(server_memory,
                                                       self.config.gguf_of(cfg.name),
                                                       (), props.slot_ctx, props.total_slots),
                    )
                    b.ready_since = time.time()
                    self._set(b, "ready")
                    self._notify(cfg.name, b.info)
                else:
                    # (a 401 when the key is wrong; a 200 of another shape: not a server)
                    key = isinstance(props, BadResponse) and props.status in (401, 403)
                    hint = "check api_key" if key else "is it a llama-server?"
                    error = f"/props: {props} (fix: {hint})"
            if error is not None:
                if b.info is not None:
                    b.info = None
                    self._notify(cfg.name, None)
                if b.state != "down" or b.last_error != error:
                    self._set(b, "down", error)
            b.settled.set()
            await asyncio.sleep(self.config.supervision.health_interval_s)

    # -- backends an agent runs (backends/remote.py) -------------------------------------

    def remote(self, report: Reported) -> None:
        """What an agent says of one of its backends now."""
        name = report.cfg.name
        b = self._backends.get(name)
        if b is None:
            b = self._backends[name] = _Backend(report.cfg, agent=report.agent)
        elif b.agent != report.agent:  # a configured backend of that name: it stays
            log.warning("agent.name_taken", backend=name, agent=report.agent)
            return
        b.cfg, b.url, b.restarts = report.cfg, report.cfg.url or b.url, report.restarts
        info = _remote_info(report) if report.ready else None
        if info is not None and info == b.info:
            return
        if b.info is not None:  # (another url or key: the agent restarted it)
            b.info = None
            self._notify(name, None)
        if info is None:
            if b.state != report.state or b.last_error != report.error:
                self._set(b, report.state, report.error)
            return
        b.info, b.ready_since = info, time.time()
        self._set(b, "ready")
        self._notify(name, info)

    def remote_down(self, name: str, error: str) -> None:
        """Its agent does not answer: down until it says otherwise."""
        b = self._backends.get(name)
        if b is None:
            return
        if b.info is not None:
            b.info = None
            self._notify(name, None)
        if b.state != "down" or b.last_error != error:
            self._set(b, "down", error)

    def forget(self, name: str) -> None:
        """Its agent no longer lists it."""
        b = self._backends.pop(name, None)
        if b is None:
            return
        log.info("backend.gone", backend=name, agent=b.agent)
        if b.info is not None:
            b.info = None
            self._notify(name, None)
        self._write_state()


def _remote_info(r: Reported) -> BackendInfo:
    return BackendInfo(
        name=r.cfg.name, url=r.cfg.url, api_key=r.cfg.api_key, n_slots=r.n_slots,
        slot_ctx=r.slot_ctx, ram_cache_bytes=r.ram_cache_bytes,
        kv_bytes_per_token=r.kv_bytes_per_token, model=r.model, managed=False,
        memory=r.memory, kind=LLAMA)
