"""Thin endpoints: parse and validate, get the exact tokens, hand over to the Forwarder.

Anthropic `/v1/messages` (issue 5) plugs in the same way as chat completions: translate
the body to a chat-completions body, `prompt.chat_tokens()` on it, then
`forwarder.routed(..., path="/v1/chat/completions", relay=<a Relay translating back>)`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from aiohttp import web

from proxy.app import (
    BACKENDS,
    CONFIG,
    CURSOR,
    FORWARDER,
    METRICS,
    PROMPT,
    ROUTER,
    SUPERVISOR,
    TOKENIZING,
)
from proxy.errors import BadRequest, NoBackendAvailable
from proxy.feedback import Outcome
from proxy.forward import JSON, Target, send, upstream_payload
from proxy.metrics import CONTENT_TYPE
from proxy.prompt import PromptError

if TYPE_CHECKING:
    from backends.supervisor import BackendInfo

# llama-server paths forwarded as they are to any healthy backend.
PASSTHROUGH_POST = ("/tokenize", "/detokenize", "/apply-template", "/v1/embeddings",
                    "/embeddings")
PASSTHROUGH_GET = ("/props",)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/completion", completion)
    app.router.add_post("/completions", completion)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/kvroute/status", status)
    for path in PASSTHROUGH_POST:
        app.router.add_post(path, passthrough)
    for path in PASSTHROUGH_GET:
        app.router.add_get(path, passthrough)


# ------------------------------------------------------------------------ parsing
async def read_json(request: web.Request) -> tuple[bytes, JSON]:
    """The raw body and its JSON object; 400 for anything else, 413 when too large."""
    raw = await request.read()  # over client_max_size -> HTTPRequestEntityTooLarge -> 413
    if not raw:
        raise BadRequest("request body is empty: expected a JSON object")
    try:
        body = json.loads(raw)
    except UnicodeDecodeError:
        raise BadRequest("request body is not valid UTF-8") from None
    except ValueError as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise BadRequest("'stream' must be a boolean", code="invalid_type")
    return raw, body


async def tokens_for(request: web.Request, raw: bytes,
                     build: Callable[[], Sequence[int]]) -> Sequence[int]:
    """Exact prompt tokens; PromptError (bad messages, ids out of range) -> 400."""
    try:
        return await request.app[TOKENIZING].run(len(raw), build)
    except PromptError as e:
        raise BadRequest(str(e)) from None


# ---------------------------------------------------------------------- endpoints
async def chat_completions(request: web.Request) -> web.StreamResponse:
    raw, body = await read_json(request)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array", code="invalid_messages")
    prompt = request.app[PROMPT]
    if prompt is None:
        return await unrouted(request, "/v1/chat/completions", raw)
    tokens = await tokens_for(request, raw, lambda: prompt.chat_tokens(body))
    return await request.app[FORWARDER].routed(
        request, endpoint="chat", path="/v1/chat/completions", raw=raw, body=body,
        tokens=tokens)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, "/v1/completions", "completions")


async def completion(request: web.Request) -> web.StreamResponse:
    return await _completion(request, "/completion", "completion")


async def _completion(request: web.Request, path: str, endpoint: str) -> web.StreamResponse:
    raw, body = await read_json(request)
    if "prompt" not in body:
        raise BadRequest("'prompt' is required", code="missing_prompt")
    prompt = request.app[PROMPT]
    if prompt is None:
        return await unrouted(request, path, raw)
    tokens = await tokens_for(request, raw, lambda: prompt.completion_tokens(body["prompt"]))
    return await request.app[FORWARDER].routed(
        request, endpoint=endpoint, path=path, raw=raw, body=body, tokens=tokens)


def pick_ready(app: web.Application) -> BackendInfo:
    """Next ready backend, round robin (calls that carry no prefix to route by)."""
    ready = list(app[BACKENDS].values())
    if not ready:
        raise NoBackendAvailable("no healthy backend", retry_after=1)
    cursor = app[CURSOR]
    cursor[0] += 1
    return ready[cursor[0] % len(ready)]


async def unrouted(request: web.Request, path: str, raw: bytes) -> web.StreamResponse:
    """Forward to the next ready backend without prefix routing (no tokenizer)."""
    info = pick_ready(request.app)
    outcome = Outcome(started=time.perf_counter())
    return await send(request.app[FORWARDER].session, request, Target(info), path,
                      upstream_payload(raw, {}, {}), outcome)


async def passthrough(request: web.Request) -> web.StreamResponse:
    raw = await request.read() if request.method == "POST" else b""
    info = pick_ready(request.app)
    return await request.app[FORWARDER].passthrough(request, request.path, info, raw)


async def models(request: web.Request) -> web.Response:
    seen: dict[str, dict[str, Any]] = {}
    for info in request.app[BACKENDS].values():
        seen.setdefault(info.model, {"id": info.model, "object": "model",
                                     "owned_by": "kvroute", "created": 0})
    return web.json_response({"object": "list", "data": list(seen.values())})


async def health(request: web.Request) -> web.Response:
    n = len(request.app[BACKENDS])
    if n:
        return web.json_response({"status": "ok", "backends_ready": n})
    return web.json_response({"status": "unavailable", "backends_ready": 0}, status=503)


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS].render(),
                        headers={"Content-Type": CONTENT_TYPE})


async def status(request: web.Request) -> web.Response:
    app = request.app
    prompt = app[PROMPT]
    return web.json_response({
        "policy": app[CONFIG].proxy.policy,
        "tokenizer": None if prompt is None else "local",
        "backends": app[SUPERVISOR].statuses(),
        "router": app[ROUTER].snapshot(),
    }, dumps=lambda o: json.dumps(o, default=str))
