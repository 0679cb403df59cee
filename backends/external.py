"""Backends not started here: external servers, only probed (a llama-server, or a server
of the OpenAI API), and those an agent runs on another host, as its answers say
(backends/remote.py), named "<agent>/<backend>", never started or probed here.

A down external backend is a state, never an error.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import structlog

from backends.client import Adapters, BackendClient, BadResponse, Health, Props
from backends.config import EXTERNAL_KV_BYTES, LLAMA, OPENAI, ExternalBackendConfig
from backends.dialect import dialect_of
from backends.info import BackendInfo, MiB
from backends.memory import gguf_kv_bytes_per_token, server_memory
from backends.remote import Reported
from backends.standing import Listeners, Standing

log = structlog.get_logger("backends.supervisor")  # (the supervisor's log)

PROBE_TIMEOUT_S = 5.0


class ExternalBackend:
    """An external server, probed every ``interval_s`` from start() until stop(): ready
    while it answers, down (and not routed) while it does not."""

    def __init__(self, cfg: ExternalBackendConfig, listeners: Listeners, gguf: Path | None,
                 interval_s: float) -> None:
        """``gguf``: the model it serves, as far as the configuration says."""
        self.cfg = cfg
        self.standing = Standing(cfg.name, listeners)
        self._gguf = gguf
        self._interval_s = interval_s
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    def start(self, session: aiohttp.ClientSession) -> None:
        assert self._task is None, "start() called twice"
        client = BackendClient(session, self.cfg.url, self.cfg.api_key, timeout=PROBE_TIMEOUT_S)
        self._task = asyncio.create_task(self._run(client),
                                         name=f"kvroute-backend-{self.cfg.name}")

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def status(self) -> dict[str, object]:
        return self.standing.status(self.cfg)

    async def _run(self, client: BackendClient) -> None:
        self.standing.moved(self.cfg.url)
        while not self._stopping:
            if not dialect_of(self.cfg.kind).has_health:  # up while it lists its models
                error = await self._probe_openai(client)
            else:
                error = await self._probe_llama(client)
            if error is not None:
                self.standing.down()
                self.standing.become("down", error)
            self.standing.settle()
            await asyncio.sleep(self._interval_s)

    async def _probe_llama(self, client: BackendClient) -> str | None:
        """A llama-server is up while its /health answers 200; its /props are read once
        it is (the error, or None)."""
        if not (isinstance(h := await client.health(), Health) and h.ok):
            return f"/health: {h}"
        if self.standing.info is not None:
            return None
        props = await client.props()
        if not isinstance(props, Props):
            # (a 401 when the key is wrong; a 200 of another shape: not a server)
            key = isinstance(props, BadResponse) and props.status in (401, 403)
            hint = "check api_key" if key else "is it a llama-server?"
            return f"/props: {props} (fix: {hint})"
        adapters = await client.adapters()
        if not isinstance(adapters, Adapters):
            # (asked of the server's loop: a long prefill under way may outlast the probe)
            log.warning("backend.adapters_unknown", backend=self.cfg.name, error=str(adapters),
                        effect="requests naming LoRA adapters are predicted as if it had none")
            adapters = Adapters()
        cfg = self.cfg
        kv = await self._kv_bytes()
        memory = await asyncio.to_thread(server_memory, self._gguf, (), props.slot_ctx,
                                         props.total_slots)
        self.standing.up(BackendInfo(
            name=cfg.name, url=cfg.url, api_key=cfg.api_key, n_slots=props.total_slots,
            slot_ctx=props.slot_ctx, ram_cache_bytes=cfg.cache_ram_mib * MiB,
            kv_bytes_per_token=kv, model=props.model_alias, managed=False, memory=memory,
            modalities=props.modalities, lora=adapters.scales, alora=adapters.alora,
            media_marker=props.media_marker))
        return None

    async def _probe_openai(self, client: BackendClient) -> str | None:
        """A server of the OpenAI API is up while its /v1/models answers (it serves the
        first model listed); the error, or None."""
        models = await client.models()
        if not isinstance(models, list):
            key = isinstance(models, BadResponse) and models.status in (401, 403)
            hint = "check api_key" if key else "is the url the server's root?"
            return f"/v1/models: {models} (fix: {hint})"
        if self.standing.info is None:
            cfg = self.cfg
            self.standing.up(BackendInfo(
                name=cfg.name, url=cfg.url, api_key=cfg.api_key, n_slots=cfg.sequences,
                slot_ctx=cfg.ctx, ram_cache_bytes=0, kv_bytes_per_token=await self._kv_bytes(),
                model=models[0], managed=False, kind=OPENAI))
        return None

    async def _kv_bytes(self) -> int:
        """The configured size, else that of the GGUF the proxy tokenizes with."""
        if self.cfg.kv_bytes_per_token is not None:
            return self.cfg.kv_bytes_per_token
        gguf = self._gguf
        kv = None if gguf is None else await asyncio.to_thread(gguf_kv_bytes_per_token, gguf)
        return kv or EXTERNAL_KV_BYTES


class RemoteBackend:
    """A backend an agent runs on another host, as the agent's reports say."""

    def __init__(self, cfg: ExternalBackendConfig, agent: str, listeners: Listeners) -> None:
        self.cfg = cfg
        self.agent = agent
        self.standing = Standing(cfg.name, listeners)
        self._restarts = 0

    def reported(self, report: Reported) -> None:
        """What its agent says of it now."""
        self.cfg, self._restarts = report.cfg, report.restarts
        self.standing.moved(report.cfg.url or self.standing.url)
        info = _remote_info(report) if report.ready else None
        if info is not None and info == self.standing.info:
            return
        self.standing.down()  # (if it was up: another url or key, the agent restarted it)
        if info is None:
            self.standing.become(report.state, report.error)
        else:
            self.standing.up(info)

    def status(self) -> dict[str, object]:
        return self.standing.status(self.cfg, agent=self.agent, restarts=self._restarts)


def _remote_info(r: Reported) -> BackendInfo:
    return BackendInfo(
        name=r.cfg.name, url=r.cfg.url, api_key=r.cfg.api_key, n_slots=r.n_slots,
        slot_ctx=r.slot_ctx, ram_cache_bytes=r.ram_cache_bytes,
        kv_bytes_per_token=r.kv_bytes_per_token, model=r.model, managed=False,
        memory=r.memory, kind=LLAMA, modalities=r.modalities, lora=r.lora, alora=r.alora,
        media_marker=r.media_marker)
