"""The operators' live status page: `GET /` (and `/kvroute/`), its script and style
(package files under static/: no build step, nothing fetched from anywhere else), and
`GET /kvroute/events`, the server-sent events it updates from: a snapshot every second
(what /kvroute/status says, each slot's session, reuse and TTFT per 10 s) and each
routing decision as its request ends.

Every path here is an admin path (proxy/app.py's auth). A browser cannot put a bearer
key on an EventSource, so the page's 401 asks for HTTP Basic credentials (any user name,
a key as the password), which the browser then sends with the page's own requests. What
is sent holds ids, counts and names, never prompt text; the script puts all of it into
the page as text (textContent), never as markup.
"""

from __future__ import annotations

import base64
import binascii
import time
from functools import cache
from pathlib import Path
from typing import Any

from aiohttp import web

from proxy.errors import RESPONSE_STARTED, NotFound
from proxy.routing.router import Router
from proxy.server.event_streams import EventStreams
from proxy.server.handlers import status_body
from proxy.server.keys import POOLS, RECENT, STATUS_STREAMS

_STATIC = Path(__file__).with_name("static")
_TYPES = {"status.html": "text/html", "status.js": "text/javascript", "status.css": "text/css"}
PAGE_PATHS = frozenset({"/", "/kvroute/", "/kvroute/events", "/kvroute/static/status.js",
                        "/kvroute/static/status.css"})
# The page runs only its own script and style, talks only to kvroute, and is never framed.
_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "connect-src 'self'; img-src 'self'; frame-ancestors 'none'; "
                               "base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
_SESSION_CHARS = 64  # of a session id on the page: enough to tell sessions apart


def add_routes(app: web.Application) -> None:
    app[STATUS_STREAMS] = EventStreams()
    app.router.add_get("/", page)
    app.router.add_get("/kvroute/", page)
    app.router.add_get("/kvroute/events", events, allow_head=False)  # (a HEAD would stream)
    app.router.add_get("/kvroute/static/{name}", static)
    app.on_shutdown.append(_close_streams)


def basic_password(authorization: str) -> str | None:
    """The password of an `Authorization: Basic` header (None: not one)."""
    if authorization[:6].lower() != "basic ":
        return None
    try:
        decoded = base64.b64decode(authorization[6:].strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    return decoded.decode("utf-8", "surrogateescape").partition(":")[2]


def ask_for_key() -> web.Response:
    """The page's 401: the browser asks its user for a key (as a Basic password)."""
    return web.Response(status=401, text="kvroute status: an API key is needed (as the "
                        "password; any user name)\n",
                        headers={"WWW-Authenticate": 'Basic realm="kvroute", charset="UTF-8"',
                                 **_HEADERS})


@cache
def _file(name: str) -> bytes:
    return (_STATIC / name).read_bytes()


def _serve(name: str) -> web.Response:
    return web.Response(body=_file(name), headers={"Content-Type": _TYPES[name], **_HEADERS})


async def page(request: web.Request) -> web.Response:
    return _serve("status.html")


async def static(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name not in _TYPES or name == "status.html":
        raise NotFound(f"no such file: {name[:100]!r}")
    return _serve(name)


async def events(request: web.Request) -> web.StreamResponse:
    app = request.app
    streams = app[STATUS_STREAMS]
    stream = streams.join()
    try:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "X-Accel-Buffering": "no", **_HEADERS})
        request[RESPONSE_STARTED] = resp
        await resp.prepare(request)
        # (no await between this and the first snapshot, whose ring of decisions then
        # ends where the pushed ones begin)
        unsubscribe = app[RECENT].subscribe(stream.push)
        try:
            await streams.pump(request, resp, stream, lambda first: snapshot(app, first))
        finally:
            unsubscribe()
    finally:
        streams.leave(stream)
    return resp


def snapshot(app: web.Application, with_decisions: bool) -> dict[str, Any]:
    """/kvroute/status with each slot's session, and reuse and TTFT over the last
    minutes; ``with_decisions``: the ring of recent decisions too (a stream's first)."""
    body: dict[str, Any] = status_body(app)
    del body["router"]  # (the first pool's, again)
    for shown, pool in zip(body["pools"], app[POOLS], strict=True):
        sessions = _slot_sessions(pool.router)
        for name, backend in shown["router"]["backends"].items():
            for slot in backend["slots"]:
                slot["session"] = sessions.get(name, {}).get(slot["id"])
    body["series"] = app[RECENT].series()
    body["time"] = round(time.time(), 3)
    if with_decisions:
        body["decisions"] = app[RECENT].decisions()
    return body


def _slot_sessions(router: Router) -> dict[str, dict[int, str]]:
    """backend -> slot -> the session id of the request last placed there, cut short."""
    return {name: {slot: session[:_SESSION_CHARS] for slot, session in slots.items()}
            for name, slots in router.slot_sessions().items()}


async def _close_streams(app: web.Application) -> None:
    app[STATUS_STREAMS].close()
