"""Whether a managed llama-server is up.

Ready (`HealthCheck.ready`): its /health answers 200 within `startup_timeout_s`, and its
/props tell its slots and model: the backend as the proxy needs it. Alive
(`HealthCheck.watch`): its process runs (polled every 0.2 s: no SIGCHLD handler to fight
over) and its /health, probed every `health_interval_s`, has not failed
`UNHEALTHY_PROBES` times in a row (`Liveness` counts).
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

import aiohttp

from backends.client import Adapters, BackendClient, Health, Props
from backends.config import ManagedBackendConfig, SupervisionConfig
from backends.info import BackendInfo, MiB
from backends.memory import server_memory
from backends.process import Failed, LlamaServerProcess

UNHEALTHY_PROBES = 5  # consecutive failed /health probes before a restart
EXIT_POLL_S = 0.2  # how often a process is checked for having exited
PROBE_TIMEOUT_S = 5.0


class Liveness:
    """Failed probes in a row: unwell at ``limit`` (a good probe starts the count over)."""

    def __init__(self, limit: int = UNHEALTHY_PROBES) -> None:
        self._limit = limit
        self._failures = 0

    @property
    def failures(self) -> int:
        return self._failures

    def probed(self, ok: bool) -> bool:
        """Count one probe: True when it makes the server unwell."""
        self._failures = 0 if ok else self._failures + 1
        return self._failures >= self._limit


class Exits(Protocol):
    """A process, as far as watching it goes."""

    def exited(self) -> bool: ...


class HealthCheck:
    """Readiness and liveness probes of the managed servers of one pool."""

    def __init__(self, session: aiohttp.ClientSession, supervision: SupervisionConfig) -> None:
        self._session = session
        self._startup_timeout_s = supervision.startup_timeout_s
        self._interval_s = supervision.health_interval_s

    async def ready(self, proc: LlamaServerProcess, cfg: ManagedBackendConfig,
                    kv_bytes_per_token: int) -> BackendInfo | str:
        """Wait for /health, read /props: the backend as the proxy needs it, or why not.
        ``kv_bytes_per_token``: what its GGUF says (unless its memory tells better)."""
        spec = proc.spec
        res = await proc.wait_ready(self._session, self._startup_timeout_s)
        if isinstance(res, Failed):
            return f"{res.reason}; last log lines:\n{res.log_tail}"
        client = BackendClient(self._session, spec.url, spec.api_key)
        props = await client.props()
        if not isinstance(props, Props):
            return f"/props failed: {props}"
        adapters = await client.adapters()
        if not isinstance(adapters, Adapters):
            return f"/lora-adapters failed: {adapters}"
        memory = await asyncio.to_thread(server_memory, cfg.model, spec.argv(),
                                         props.slot_ctx, props.total_slots)
        return BackendInfo(
            name=cfg.name, url=spec.url, api_key=spec.api_key, n_slots=props.total_slots,
            slot_ctx=props.slot_ctx, ram_cache_bytes=cfg.cache_ram_mib * MiB,
            # (of the layers whose cache grows with the context: a sliding one's does not)
            kv_bytes_per_token=memory.kv_bytes_per_token or kv_bytes_per_token,
            model=props.model_alias, managed=True, memory=memory,
            modalities=props.modalities, lora=adapters.scales, alora=adapters.alora,
            media_marker=props.media_marker,
        )

    async def watch(self, proc: Exits, info: BackendInfo,
                    for_s: float | None = None) -> str | None:
        """Why a server that is up stopped being usable (None: it lasted ``for_s``)."""
        client = BackendClient(self._session, info.url, info.api_key, timeout=PROBE_TIMEOUT_S)
        live = Liveness()
        next_probe = time.monotonic() + self._interval_s
        end = None if for_s is None else time.monotonic() + for_s
        while end is None or time.monotonic() < end:
            await asyncio.sleep(EXIT_POLL_S)
            if proc.exited():
                return "llama-server exited"
            if time.monotonic() < next_probe:
                continue
            next_probe = time.monotonic() + self._interval_s
            h = await client.health()
            if live.probed(isinstance(h, Health) and h.ok):
                return f"/health failed {live.failures} times in a row ({h})"
        return None
