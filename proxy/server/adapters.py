"""`/lora-adapters` through kvroute: the global LoRA scales of a pool's llama-servers.

A llama-server runs a request that names no adapters under its global scales. kvroute
serves a pool of servers of one model as one server, so `POST /lora-adapters` sets the
scales on every llama-server of the pool (``?model=`` picks the pool; none: the first)
and answers as they do once all have; the router then knows which set each slot's
requests run under (proxy/routing/cache/lora.py). `GET /lora-adapters` is one server's
answer (they agree unless set behind kvroute's back). A server that restarts starts
again at the scales its command line gives.
"""

from __future__ import annotations

import asyncio

import orjson
from aiohttp import web

from backends.client import BackendClient, BadResponse
from proxy.errors import BadRequest, NoBackendAvailable, UpstreamError
from proxy.routing.cache.lora import requested, scales
from proxy.server.handlers import read_body
from proxy.server.keys import POOLS, SESSION, SETTINGS


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
    failed = []
    for b, answer in zip(targets, got, strict=True):
        if isinstance(answer, BadResponse) and answer.status == 400:
            raise BadRequest(_message(answer.body))  # (each server would refuse it alike)
        if isinstance(answer, dict):
            # the set it now runs unnamed requests under: ids left out at 0
            pool.router.set_adapters(b.name, scales(requested({"lora": body}) or (),
                                                    len(b.lora)))
        else:
            failed.append(f"{b.name}: status {answer.status}"
                          if isinstance(answer, BadResponse) else f"{b.name}: no answer")
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
