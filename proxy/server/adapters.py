"""`/lora-adapters` through kvroute: the global LoRA scales of a pool's llama-servers.

A llama-server runs a request that names no adapters under its global scales. kvroute
serves a pool of servers of one model as one server, so `POST /lora-adapters` sets the
scales on every llama-server of the pool (``?model=`` picks the pool; none: the first)
and answers as they do once all have; the router then knows which set each slot's
requests run under (proxy/routing/cache/lora.py). `GET /lora-adapters` is one server's
answer (they agree unless set behind kvroute's back). A server that restarts starts
again at the scales its command line gives.

Scales set behind kvroute's back (a POST to a server itself, or through another
replica) and a restart are found by asking each server with adapters for its scales
every `WATCH_EVERY_S` (`watch`): until then, kvroute names the scales it knew.
"""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
from aiohttp import web
from structlog import get_logger

from backends.client import Adapters, BackendClient, BadResponse
from proxy.errors import BadRequest, NoBackendAvailable, UpstreamError
from proxy.routing.cache.lora import requested, scales
from proxy.server.handlers import read_body
from proxy.server.keys import POOLS, SESSION, SETTINGS
from proxy.server.pools import Pool

WATCH_EVERY_S = 5.0
_ASK_TIMEOUT_S = 30.0  # (answered by the server's loop: after the batch under way)


async def watch(pool: Pool, session: aiohttp.ClientSession,
                every_s: float = WATCH_EVERY_S) -> None:
    """Keep the router's scales of ``pool``'s servers with adapters as they say (runs
    until cancelled)."""
    while True:
        await asyncio.sleep(every_s)
        infos = [b for b in pool.backends.values() if b.lora]
        got = await asyncio.gather(*(BackendClient(session, b.url, b.api_key, timeout=(
            _ASK_TIMEOUT_S)).adapters() for b in infos))
        for b, now in zip(infos, got, strict=True):
            if isinstance(now, Adapters) and pool.backends.get(b.name) is b \
                    and now.scales != pool.router.adapters(b.name):
                get_logger().info("backend.adapters_changed", backend=b.name,
                                  scales=now.scales)
                pool.router.set_adapters(b.name, now.scales)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/lora-adapters", set_adapters)


async def set_adapters(request: web.Request) -> web.Response:
    raw = await read_body(request)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise BadRequest("request body is not valid JSON") from None
    if not isinstance(body, list):  # (the server's own words)
        raise BadRequest("Request body must be an array")
    pool = request.app[POOLS].for_model(request.query.get("model"),
                                        request.app[SETTINGS].strict_models)
    targets = [b for b in pool.backends.values() if b.dialect.serves("/lora-adapters")]
    if not targets:
        raise NoBackendAvailable("no llama-server of this model is up to take the scales",
                                 retry_after=1)
    session = request.app[SESSION]
    got = await asyncio.gather(*(
        BackendClient(session, b.url, b.api_key).set_adapters(raw) for b in targets))
    failed, refused = [], []
    for b, answer in zip(targets, got, strict=True):
        if isinstance(answer, dict):
            # the set it now runs unnamed requests under: ids left out at 0
            pool.router.set_adapters(b.name, scales(requested({"lora": body}) or (),
                                                    len(b.lora)))
        elif isinstance(answer, BadResponse) and answer.status == 400:
            refused.append(_message(answer.body))
        else:
            failed.append(f"{b.name}: status {answer.status}"
                          if isinstance(answer, BadResponse) else f"{b.name}: no answer")
    if len(refused) == len(targets):
        raise BadRequest(refused[0])  # (each server refuses it alike)
    failed += [f"refused: {why}" for why in refused[:1]]
    if failed:
        # NOTE: names, never URLs: a client must not learn the backends' addresses
        raise UpstreamError("the scales were not set on every server (" + "; ".join(failed)
                            + "); fix: send them again once those are up")
    return web.json_response(got[0])


def _message(body: str) -> str:
    """The message of a llama-server error answer (else the answer's start)."""
    try:
        err = orjson.loads(body).get("error")
        return str(err["message"])
    except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError):
        return body[:200]
