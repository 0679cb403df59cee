"""Managed backends: one llama-server each, started, watched and restarted here.

A mixin of :class:`~backends.supervisor.Supervisor`. One asyncio task per backend:

    starting --/health 200, /props read--> ready --exit or 5 failed probes--> down
        ^                                                                     |
        +------------------ backoff (0.5 s, doubling, max 30 s) -------------+

A backend that dies 3 times within 120 s is in a crash loop (backends/crash_loop.py): its
restarts wait longer (30 s, doubling, max 300 s), and a restart is `held` out of routing
until it stays up 120 s, which ends the loop. (All of these: `supervision:` knobs.)

Each (re)start picks a new free loopback port and a new random API key (the key keeps
clients from bypassing the proxy; a new port avoids racing a dying process's socket).
A restarted server has an empty cache: the supervisor's subscribers hear it go down and
come back ready.
"""

from __future__ import annotations

import asyncio
import secrets
import shlex
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import structlog

from backends.client import BackendClient, Health, Props
from backends.config import FleetSpec, ManagedBackendConfig
from backends.crash_loop import CrashLoop, Death
from backends.info import Backend, BackendInfo, MiB
from backends.memory import gguf_kv_bytes_per_token, server_memory
from backends.process import Failed, LlamaServerProcess, ServerSpec, free_port

log = structlog.get_logger("backends.supervisor")  # (the supervisor's log)

DEFAULT_KV_BYTES_PER_TOKEN = 131072  # when a GGUF's metadata does not tell
UNHEALTHY_PROBES = 5  # consecutive failed /health probes before a restart


class ManagedBackends:
    """The lifecycle of the llama-servers started here (over the Supervisor's state)."""

    config: FleetSpec
    host: str
    _session: aiohttp.ClientSession | None
    _stopping: bool
    _binary: Path | None
    _set: Callable[..., None]  # (Supervisor)
    _notify: Callable[[str, BackendInfo | None], None]  # (Supervisor)
    _log_path: Callable[[str], Path]  # (Supervisor)

    async def _run_managed(self, b: Backend) -> None:
        cfg = b.cfg
        assert isinstance(cfg, ManagedBackendConfig) and self._session is not None
        sup = self.config.supervision
        b.crashes = CrashLoop(sup.crash_loop_deaths, sup.crash_loop_window_s)
        backoff = sup.restart_backoff_s
        kv = await asyncio.to_thread(gguf_kv_bytes_per_token, cfg.model)
        while not self._stopping:
            proc = self._spawn(b, cfg)
            if proc is None:
                return
            got = await self._bring_up(b, proc, kv or DEFAULT_KV_BYTES_PER_TOKEN)
            if isinstance(got, BackendInfo) and b.crashes.looping:
                got = await self._hold(b, proc, got)
                if isinstance(got, BackendInfo):
                    backoff = sup.restart_backoff_s  # the loop is over
            if isinstance(got, BackendInfo):
                self._publish(b, proc, got)
                t_ready = time.monotonic()
                got = await self._watch(proc, got) or "stopped"
                if time.monotonic() - t_ready > 60:
                    backoff = sup.restart_backoff_s  # it ran fine for a while: not a crash loop
            if self._stopping:
                return
            backoff = await self._restart_after(b, proc, got, backoff)

    def _spawn(self, b: Backend, cfg: ManagedBackendConfig) -> LlamaServerProcess | None:
        """A new process on a new port with a new key (None: it cannot be started)."""
        if self._binary is None:
            self._set(b, "failed", "llama-server not found "
                      "(fix: run `python -m backends prepare`, or set llama_server)")
            b.settled.set()
            return None
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
            return None
        return proc

    async def _bring_up(self, b: Backend, proc: LlamaServerProcess,
                        kv: int) -> BackendInfo | str:
        """Wait for /health, read /props: the backend as the proxy needs it, or an error."""
        assert self._session is not None
        spec = proc.spec
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
        return BackendInfo(
            name=cfg.name, url=spec.url, api_key=spec.api_key, n_slots=props.total_slots,
            slot_ctx=props.slot_ctx, ram_cache_bytes=cfg.cache_ram_mib * MiB,
            # (of the layers whose cache grows with the context: a sliding one's does not)
            kv_bytes_per_token=memory.kv_bytes_per_token or kv, model=props.model_alias,
            managed=True, memory=memory,
        )

    def _publish(self, b: Backend, proc: LlamaServerProcess, info: BackendInfo) -> None:
        """Ready: the subscribers route to it."""
        b.info, b.ready_since = info, time.time()
        self._set(b, "ready")
        log.info("backend.ready", backend=info.name, url=info.url, pid=proc.pid,
                 slots=info.n_slots, n_ctx=info.slot_ctx)
        self._notify(info.name, info)
        b.settled.set()

    async def _hold(self, b: Backend, proc: LlamaServerProcess,
                    info: BackendInfo) -> BackendInfo | str:
        """A restart in a crash loop: kept out of routing until it stays up the loop's
        window (then the loop is over), or why it did not."""
        crashes = b.crashes
        assert crashes is not None
        crashes.until = time.time() + crashes.window_s
        self._set(b, "held")
        b.settled.set()
        error = await self._watch(proc, info, for_s=crashes.window_s)
        if error is not None:
            return error
        crashes.held(time.time())
        log.info("backend.crash_loop_over", backend=info.name, url=info.url,
                 up_s=crashes.window_s)
        return info

    async def _restart_after(self, b: Backend, proc: LlamaServerProcess, error: str,
                             backoff: float) -> float:
        """Take a backend that died down, count the death, wait ``backoff``: the next."""
        sup = self.config.supervision
        name = b.cfg.name
        by_itself = proc.exited()
        if b.info is not None:
            b.info = None
            self._notify(name, None)
        rc = await proc.stop(sup.stop_grace_s)
        b.process = None
        b.restarts += 1
        death = Death(time.time(), error, rc, by_itself,
                      tuple(proc.log_tail().strip("\n").splitlines()),
                      str(proc.spec.model), tuple(proc.spec.argv()), str(proc.log_path))
        crashes = b.crashes
        assert crashes is not None
        if crashes.died(death):
            backoff = max(backoff, sup.restart_backoff_max_s)
            log.error("backend.crash_loop", backend=name, died=death.what(),
                      deaths=len(crashes.recent), window_s=crashes.window_s,
                      fix=death.fix(), model=death.model, command=shlex.join(death.argv),
                      log=death.log, log_tail=list(death.log_tail[-10:]),
                      next_restart_s=backoff)
        crashes.until = time.time() + backoff if crashes.looping else None
        ended = f" ({death.what()})" if by_itself else ""
        self._set(b, "down", f"{error}{ended}; restarting in {backoff:.1f} s; "
                  f"see {proc.log_path}")
        b.settled.set()
        await asyncio.sleep(backoff)
        cap = sup.crash_loop_backoff_max_s if crashes.looping else sup.restart_backoff_max_s
        return min(backoff * 2, cap)

    async def _watch(self, proc: LlamaServerProcess, info: BackendInfo,
                     for_s: float | None = None) -> str | None:
        """Why a backend that is up stopped being usable (None: it lasted ``for_s``)."""
        assert self._session is not None
        client = BackendClient(self._session, info.url, info.api_key, timeout=5.0)
        interval = self.config.supervision.health_interval_s
        failures, next_probe = 0, time.monotonic() + interval
        end = None if for_s is None else time.monotonic() + for_s
        while end is None or time.monotonic() < end:
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
        return None
