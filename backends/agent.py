"""`kvroute agent`: the llama-servers of one host, started and supervised here, served to
the routers of other hosts (backends/remote.py is the routers' side).

The agent runs the Supervisor of its managed backends, listening on the agent's address
rather than loopback: each llama-server gets its own random key at every start, so a
client that is not a router cannot use it, and a router learns the key from the agent.
Two routes:

    GET /backends  (Authorization: Bearer <agent key>)  each backend: its name, state and
                   restarts; when ready, its URL at the advertised address, its key, and
                   what a router routes by (slots, context, RAM cache, KV bytes per token,
                   memory kind, the model it serves)
    GET /health    open: whether the agent runs, how many backends are ready

The agent's key is compared in constant time; a wrong or missing one is a 401 that says
nothing of the backends. The key is never logged (nor are the backends').
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

import structlog
from aiohttp import web

from backends.config import AgentConfig
from backends.info import BackendInfo
from backends.supervisor import Supervisor

log = structlog.get_logger(__name__)

CONFIG = web.AppKey("config", AgentConfig)
SUPERVISOR = web.AppKey("supervisor", Supervisor)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_OPEN_PATHS = frozenset({"/health"})


def advertised(url: str, host: str) -> str:
    """``url`` (where this host reaches a llama-server) as other hosts reach it."""
    port = urlsplit(url).port
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


def _ready(info: BackendInfo, host: str) -> dict[str, object]:
    return {"url": advertised(info.url, host), "api_key": info.api_key,
            "n_slots": info.n_slots, "slot_ctx": info.slot_ctx,
            "ram_cache_bytes": info.ram_cache_bytes,
            "kv_bytes_per_token": info.kv_bytes_per_token, "model": info.model,
            "memory": dataclasses.asdict(info.memory), "modalities": sorted(info.modalities),
            "lora": list(info.lora), "alora": [list(t) for t in info.alora],
            "media_marker": info.media_marker}


def report(config: AgentConfig, supervisor: Supervisor[AgentConfig]) -> list[dict[str, object]]:
    """What GET /backends answers: every configured backend, ready or not."""
    out: list[dict[str, object]] = []
    for status in supervisor.statuses():
        name = str(status["name"])
        entry: dict[str, object] = {"name": name, "state": status["state"],
                                    "restarts": status["restarts"],
                                    "error": status["last_error"]}
        info = supervisor.get(name)
        if info is not None and status["state"] == "ready":
            entry.update(_ready(info, config.agent.advertise))
        else:
            entry["state"] = "starting" if status["state"] == "ready" else status["state"]
        out.append(entry)
    return out


def _unauthorized() -> web.Response:
    return web.json_response({"error": {"message": "missing or invalid agent key",
                                        "type": "authentication_error", "code": 401}},
                             status=401, headers={"WWW-Authenticate": "Bearer"})


@web.middleware
async def _auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.path in _OPEN_PATHS:
        return await handler(request)
    auth = request.headers.get("Authorization", "")
    given = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
    key = request.app[CONFIG].agent.key
    # constant time, and bytes: header bytes that are not UTF-8 come back as sent
    if not hmac.compare_digest(given.encode("utf-8", "surrogateescape"), key.encode()):
        return _unauthorized()
    return await handler(request)


async def _backends(request: web.Request) -> web.Response:
    app = request.app
    return web.json_response({"backends": report(app[CONFIG], app[SUPERVISOR])})


async def _health(request: web.Request) -> web.Response:
    n = len(request.app[SUPERVISOR].ready())
    return web.json_response({"status": "ok", "backends_ready": n,
                              "backends": len(request.app[CONFIG].backends)})


def create_agent_app(config: AgentConfig, supervisor: Supervisor[AgentConfig]
                     ) -> web.Application:
    """The agent's routes; ``supervisor`` is started and stopped by the caller."""
    app = web.Application(middlewares=[_auth], client_max_size=1 << 16)
    app[CONFIG], app[SUPERVISOR] = config, supervisor
    app.router.add_get("/backends", _backends)
    app.router.add_get("/health", _health)
    return app


async def run_agent(config: AgentConfig, stop: asyncio.Event) -> int:
    """Serve until ``stop`` is set, then stop every llama-server. 0, or 2 when the
    agent's port cannot be bound."""
    supervisor = Supervisor(config, host=config.agent.host)
    runner = web.AppRunner(create_agent_app(config, supervisor), access_log=None)
    await runner.setup()
    try:
        try:
            await web.TCPSite(runner, config.agent.host, config.agent.port).start()
        except OSError as e:
            log.error("agent.cannot_listen", host=config.agent.host, port=config.agent.port,
                      error=e.strerror)
            return 2
        # listening first: a router polling now hears "starting" rather than nothing
        starting = asyncio.create_task(supervisor.start())
        waiting = asyncio.create_task(stop.wait())
        await asyncio.wait({starting, waiting}, return_when=asyncio.FIRST_COMPLETED)
        if not stop.is_set():
            log.info("agent.listening", url=f"http://{config.agent.host}:{config.agent.port}",
                     advertise=config.agent.advertise, ready=len(supervisor.ready()),
                     backends=len(config.backends))
            await stop.wait()
        starting.cancel()
        waiting.cancel()
        return 0
    finally:
        await runner.cleanup()
        await supervisor.stop()
