"""Managed backends: one llama-server each, started, watched and restarted here.

A mixin of :class:`~backends.supervisor.Supervisor`. One asyncio task per backend:

    starting --/health 200, /props read--> ready --exit or 5 failed probes--> down
        ^                                                                     |
        +------------------ backoff (0.5 s, doubling, max 30 s) -------------+

Each (re)start picks a new free loopback port and a new random API key (the key keeps
clients from bypassing the proxy; a new port avoids racing a dying process's socket).
A restarted server has an empty cache: the supervisor's subscribers hear it go down and
come back ready.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import structlog

from backends.client import BackendClient, Health, Props
from backends.config import FleetSpec, ManagedBackendConfig
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

    async def _bring_up(self, b: Backend, proc: LlamaServerProcess, spec: ServerSpec,
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

    async def _watch(self, b: Backend, proc: LlamaServerProcess) -> str:
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
