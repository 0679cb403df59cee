"""Backends not started here: external servers, only probed (a llama-server, or a server
of the OpenAI API), and those an agent runs on another host, as its answers say
(backends/remote.py), named "<agent>/<backend>", never started or probed here.

A mixin of :class:`~backends.supervisor.Supervisor`. A down external backend is a state,
never an error.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import aiohttp
import structlog

from backends.client import BackendClient, BadResponse, Health, Props
from backends.config import EXTERNAL_KV_BYTES, LLAMA, OPENAI, ExternalBackendConfig, FleetSpec
from backends.dialect import dialect_of
from backends.info import Backend, BackendInfo, MiB
from backends.memory import gguf_kv_bytes_per_token, server_memory
from backends.remote import Reported

log = structlog.get_logger("backends.supervisor")  # (the supervisor's log)


class ExternalBackends:
    """Probes of external backends and agents' reports (over the Supervisor's state)."""

    config: FleetSpec
    _session: aiohttp.ClientSession | None
    _stopping: bool
    _backends: dict[str, Backend]
    _set: Callable[..., None]  # (Supervisor)
    _notify: Callable[[str, BackendInfo | None], None]  # (Supervisor)
    _write_state: Callable[[], None]  # (Supervisor)

    async def _external_kv_bytes(self, cfg: ExternalBackendConfig) -> int:
        """The configured size, else that of the GGUF the proxy tokenizes with."""
        if cfg.kv_bytes_per_token is not None:
            return cfg.kv_bytes_per_token
        gguf = self.config.gguf_of(cfg.name)
        kv = None if gguf is None else await asyncio.to_thread(gguf_kv_bytes_per_token, gguf)
        return kv or EXTERNAL_KV_BYTES

    async def _probe_openai(self, b: Backend, client: BackendClient) -> str | None:
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

    async def _run_external(self, b: Backend) -> None:
        cfg = b.cfg
        assert isinstance(cfg, ExternalBackendConfig) and self._session is not None
        client = BackendClient(self._session, cfg.url, cfg.api_key, timeout=5.0)
        b.url = cfg.url
        while not self._stopping:
            error: str | None = None
            if not dialect_of(cfg.kind).has_health:  # up while it lists its models
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

    def remote(self, report: Reported) -> None:
        """What an agent says of one of its backends now."""
        name = report.cfg.name
        b = self._backends.get(name)
        if b is None:
            b = self._backends[name] = Backend(report.cfg, agent=report.agent)
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
