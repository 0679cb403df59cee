"""Managed backends: one llama-server each, started, watched and restarted here.

One asyncio task per backend:

    starting --/health 200, /props read--> ready --exit or 5 failed probes--> down
        ^                                                                     |
        +------------------ backoff (0.5 s, doubling, max 30 s) -------------+

A backend that dies 3 times within 120 s is in a crash loop (backends/crash_loop.py): its
restarts wait longer (30 s, doubling, max 300 s), and a restart is `held` out of routing
until it stays up 120 s, which ends the loop. (All of these: `supervision:` knobs.)

`ManagedBackend` runs that cycle over its components: its `Launcher`, a `HealthCheck`
(ready, alive: backends/health.py), its `Restarts` (backoff, crash loop:
backends/crash_loop.py) and its `Standing` (state, subscribers: backends/standing.py). A
restarted server has an empty cache: the subscribers hear it go down and come back ready.

`Launcher` starts a new process at each (re)start, on a new free port (a new port avoids
racing a dying process's socket) with a new random API key (it keeps clients from
bypassing the proxy; the server takes it from its environment, never argv), all of them
appending to the backend's one log; `end()` stops what is left of the current one and
says how it died, as the crash loop counts deaths.
"""

from __future__ import annotations

import asyncio
import secrets
import shlex
import time
from pathlib import Path

import aiohttp
import structlog

from backends.config import ManagedBackendConfig, SupervisionConfig
from backends.crash_loop import Death, Restarts
from backends.devices import list_devices, problem
from backends.health import HealthCheck
from backends.info import BackendInfo
from backends.memory import gguf_kv_bytes_per_token
from backends.process import LlamaServerProcess, ServerSpec, free_port
from backends.standing import Listeners, Standing

log = structlog.get_logger("backends.supervisor")  # (the supervisor's log)

DEFAULT_KV_BYTES_PER_TOKEN = 131072  # when a GGUF's metadata does not tell
NO_BINARY = "llama-server not found (fix: run `python -m backends prepare`, or set llama_server)"


class Launcher:
    """One managed backend's processes, one at a time."""

    def __init__(self, cfg: ManagedBackendConfig, host: str, log_path: Path,
                 slot_save_path: Path | None = None) -> None:
        """``host``: where its servers listen; ``slot_save_path``: the kv_disk tier's."""
        self._cfg = cfg
        self._host = host
        self.log_path = log_path
        self._slot_save_path = slot_save_path
        self._proc: LlamaServerProcess | None = None

    def next(self, binary: Path) -> LlamaServerProcess:
        """The next process, now the current one: call its spawn()."""
        cfg = self._cfg
        spec = ServerSpec(
            binary=binary, model=cfg.model, port=free_port(self._host), host=self._host,
            slots=cfg.slots, ctx_per_slot=cfg.ctx_per_slot, threads=cfg.threads,
            api_key=secrets.token_urlsafe(24), cache_ram_mib=cfg.cache_ram_mib,
            alias=cfg.alias, extra_args=cfg.extra_args, env=cfg.env,
            slot_save_path=self._slot_save_path, devices=cfg.devices, mmproj=cfg.mmproj,
            lora=cfg.lora,
        )
        self._proc = LlamaServerProcess(spec, self.log_path)
        return self._proc

    def pid(self) -> int | None:
        """The current process's, while it runs."""
        proc = self._proc
        return proc.pid if proc is not None and proc.alive() else None

    async def end(self, reason: str, grace: float) -> Death:
        """Stop the current process (whatever is left of it): how it died. ``reason``:
        why the supervisor ends it."""
        proc = self._proc
        assert proc is not None, "end() without a process"
        by_itself = proc.exited()
        returncode = await proc.stop(grace)
        self._proc = None
        return Death(time.time(), reason, returncode, by_itself,
                     tuple(proc.log_tail().strip("\n").splitlines()),
                     str(proc.spec.model), tuple(proc.spec.argv()), str(proc.log_path))

    async def stop(self, grace: float) -> None:
        """Stop the current process, if any (its whole process group)."""
        proc = self._proc
        if proc is not None:
            await proc.stop(grace)
            self._proc = None


class ManagedBackend:
    """One llama-server started here: its lifecycle, from start() until stop()."""

    def __init__(self, cfg: ManagedBackendConfig, listeners: Listeners, launcher: Launcher,
                 supervision: SupervisionConfig) -> None:
        self.cfg = cfg
        self.standing = Standing(cfg.name, listeners)
        self._launcher = launcher
        self._sup = supervision
        self._restarts = Restarts(supervision)
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    def start(self, session: aiohttp.ClientSession, binary: Path | None) -> None:
        """Run it (``binary``: llama-server; None: not found, it fails)."""
        assert self._task is None, "start() called twice"
        health = HealthCheck(session, self._sup)
        self._task = asyncio.create_task(self._run(health, binary),
                                         name=f"kvroute-backend-{self.cfg.name}")

    async def stop(self) -> None:
        """End its task, then its process (the whole process group)."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._launcher.stop(self._sup.stop_grace_s)

    def pid(self) -> int | None:
        return self._launcher.pid()

    def why_down(self) -> tuple[str, float | None] | None:
        """In a crash loop: what died and the fix, and when it may serve again (time.time();
        None: not known). None: not in one."""
        if not self._restarts.looping:
            return None
        return self._restarts.summary(self.cfg.name), self._restarts.until

    def status(self) -> dict[str, object]:
        return self.standing.status(self.cfg, pid=self.pid(), restarts=self._restarts.count,
                                    log_path=self._launcher.log_path,
                                    crash_loop=self._restarts.report())

    async def _run(self, health: HealthCheck, binary: Path | None) -> None:
        if binary is not None and self.cfg.devices:
            listed = await asyncio.to_thread(list_devices, binary)
            if (why := problem(self.cfg.devices, listed)) is not None:
                self._fail(why)
                return
        kv = await asyncio.to_thread(gguf_kv_bytes_per_token, self.cfg.model)
        while not self._stopping:
            proc = self._spawn(binary)
            if proc is None:
                return
            got = await health.ready(proc, self.cfg, kv or DEFAULT_KV_BYTES_PER_TOKEN)
            if isinstance(got, BackendInfo) and self._restarts.looping:
                got = await self._hold(health, proc, got)
            if isinstance(got, BackendInfo):
                log.info("backend.ready", backend=got.name, url=got.url, pid=proc.pid,
                         slots=got.n_slots, n_ctx=got.slot_ctx)
                self.standing.up(got)
                self.standing.settle()
                t_ready = time.monotonic()
                got = await health.watch(proc, got) or "stopped"
                self._restarts.ran(time.monotonic() - t_ready)
            if self._stopping:
                return
            await self._restart_after(got)

    def _spawn(self, binary: Path | None) -> LlamaServerProcess | None:
        """A new process on a new port with a new key (None: it cannot be started)."""
        if binary is None:
            self._fail(NO_BINARY)
            return None
        proc = self._launcher.next(binary)
        self.standing.moved(proc.spec.url)
        self.standing.set("starting")
        try:
            proc.spawn()
        except OSError as e:
            self._fail(f"cannot start {binary}: {e}")
            return None
        return proc

    def _fail(self, error: str) -> None:
        self.standing.set("failed", error)
        self.standing.settle()

    async def _hold(self, health: HealthCheck, proc: LlamaServerProcess,
                    info: BackendInfo) -> BackendInfo | str:
        """A restart in a crash loop: kept out of routing until it stays up the loop's
        window (then the loop is over), or why it did not."""
        window = self._restarts.hold(time.time())
        self.standing.set("held")
        self.standing.settle()
        error = await health.watch(proc, info, for_s=window)
        if error is not None:
            return error
        self._restarts.held(time.time())
        log.info("backend.crash_loop_over", backend=info.name, url=info.url, up_s=window)
        return info

    async def _restart_after(self, error: str) -> None:
        """Take the backend that died down, count the death, wait until the next start."""
        self.standing.down()
        death = await self._launcher.end(error, self._sup.stop_grace_s)
        restart = self._restarts.died(death)
        if restart.loop_began:
            self._log_crash_loop(death, restart.deaths, restart.wait_s)
        ended = f" ({death.what()})" if death.by_itself else ""
        self.standing.set("down", f"{error}{ended}; restarting in {restart.wait_s:.1f} s; "
                          f"see {death.log}")
        self.standing.settle()
        await asyncio.sleep(restart.wait_s)

    def _log_crash_loop(self, death: Death, deaths: int, next_restart_s: float) -> None:
        log.error("backend.crash_loop", backend=self.cfg.name, died=death.what(),
                  deaths=deaths, window_s=self._sup.crash_loop_window_s, fix=death.fix(),
                  model=death.model, command=shlex.join(death.argv), log=death.log,
                  log_tail=list(death.log_tail[-10:]), next_restart_s=next_restart_s)
