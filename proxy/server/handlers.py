"""Thin endpoints: parse and validate, get the exact tokens, hand over to the Forwarder.

Anthropic `/v1/messages` and OpenAI `/v1/responses` plug in the same way as chat
completions: translate the body to a chat-completions body, `tokens_for(...,
prompt.plan_chat(...))` on it, then `forwarder.routed(..., path="/v1/chat/completions",
relay=<a Relay translating back>)`.
"""

from __future__ import annotations

import asyncio
import json
from array import array
from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from backends.config import ManagedBackendConfig
from backends.dialect import CHAT_PATH, PASSTHROUGH_GET, PASSTHROUGH_POST
from proxy.errors import BadRequest, NotFound, PayloadTooLarge, RequestTimeout
from proxy.forwarding.answer import AS_IS, JSON, Relay
from proxy.forwarding.asked import PendingPrompt
from proxy.observability.metrics import CONTENT_TYPE
from proxy.prompt.chat_request import PromptError
from proxy.prompt.infill import (
    InfillUnmodelled,
    common_shape,
    fim_missing,
    infill_ids,
    server_shape,
)
from proxy.prompt.media import cut_short, ends_with_media, media_kinds
from proxy.prompt.tokenizer import Plan
from proxy.server.backend_metrics import scrape
from proxy.server.backend_tokens import NO_TOKENIZER, NoBackendIds
from proxy.server.keys import (
    ADMISSION,
    CONFIG,
    DISK,
    METRICS,
    POOLS,
    REPLICAS,
    SESSION,
    SETTINGS,
    SUPERVISOR,
)
from proxy.server.pools import Pool
from proxy.server.validate import bounded_raw, check_fields, check_forwarded, check_messages


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/completion", completion)
    app.router.add_post("/completions", completion)
    app.router.add_post("/infill", infill)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/models", models)
    app.router.add_get("/v1/models/{name:.+}", model)
    app.router.add_get("/models/{name:.+}", model)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/kvroute/status", status)
    for path in PASSTHROUGH_POST:
        app.router.add_post(path, passthrough)
    for path in PASSTHROUGH_GET:
        app.router.add_get(path, passthrough)


# ------------------------------------------------------------------------ parsing
async def read_body(request: web.Request) -> bytes:
    """The whole body: 413 when it is (or is announced) too large, 408 when it does not
    arrive within `body_timeout_s`, 400 when it cannot be decoded."""
    s = request.app[SETTINGS]
    # NOTE: aiohttp checks the size only while reading: a client announcing 10 GB and
    # sending one byte would be waited for
    if request.content_length is not None and request.content_length > s.max_body_bytes:
        raise PayloadTooLarge(f"request body of {request.content_length} bytes is over the "
                              f"limit of {s.max_body_bytes} bytes", close=True)
    try:
        if request.content.is_eof():  # all in already (most bodies): no timer to arm
            return await request.read()  # over the size -> HTTPRequestEntityTooLarge -> 413
        async with asyncio.timeout(s.body_timeout_s):
            return await request.read()
    except TimeoutError:
        raise RequestTimeout(f"request body not received within {s.body_timeout_s:g} s",
                             close=True) from None
    except RequestPayloadError as e:  # a broken gzip/deflate body, a cut chunked one
        # NOTE: marked ended, or aiohttp reads on after the answer, meets the error again
        # and logs it as unhandled
        request.content.feed_eof()
        raise BadRequest(f"request body could not be read: {e}", close=True) from None


async def read_json(request: web.Request) -> tuple[bytes, JSON]:
    """The raw body and its JSON object; 400 for anything else, 413 when too large."""
    raw = await read_body(request)
    if not raw:
        raise BadRequest("request body is empty: expected a JSON object")
    try:
        # orjson: 3x faster than json on a 200 KB conversation (~0.12 vs 0.37 ms), and
        # strict like llama-server's parser (no NaN/Infinity, no lone surrogates, depth
        # limit; integers past 64 bits become floats, as there).
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        msg = str(e)
        if "UTF-8" in msg:
            raise BadRequest("request body is not valid UTF-8") from None
        if "depth limit" in msg:
            raise BadRequest("request body is nested too deeply") from None
        near = raw[e.pos:e.pos + 24].decode("utf-8", "replace")
        raise BadRequest(f"request body is not valid JSON: {msg}, at {near!r}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise BadRequest("'stream' must be a boolean", code="invalid_type")
    return raw, body


def pool_for(request: web.Request, body: JSON) -> Pool:
    """The model pool the body's `model` names (see `Pools.for_model`; with one pool,
    `strict_models` makes a name it does not serve a 404 too)."""
    return request.app[POOLS].for_model(body.get("model"), request.app[SETTINGS].strict_models)


async def tokens_for(pool: Pool, raw: bytes, body: JSON,
                     plan: Callable[[], Plan] | None) -> array:
    """Exact prompt ids of a chat body (`plan`: `PromptBuilder.plan_chat`, None without a
    local tokenizer): see `Tokenizing.chat`."""
    got = await pool.tok.chat(len(raw), body, plan)
    assert not isinstance(got, PendingPrompt)
    return got


async def prompt_for(pool: Pool, raw: bytes, body: JSON,
                     plan: Callable[[], Plan] | None, *, parsed: bool = False
                     ) -> array | PendingPrompt | None:
    """`tokens_for`, or the head of the prompt to route on while the rest is tokenized
    (Tokenizing.prompt_ids); None when no backend can give the ids and none refused the
    request (then it is served unrouted). ``parsed``: ``body`` is ``raw`` parsed, so a
    backend asked for the ids gets ``raw`` as it is."""
    try:
        return await pool.tok.chat(len(raw), body, plan, head=True,
                                   raw=raw if parsed else None)
    except NoBackendIds:
        return None


async def counted(request: web.Request, pool: Pool, raw: bytes, chat: JSON, path: str,
                  relay: Relay = AS_IS) -> int | web.StreamResponse:
    """The prompt tokens of ``chat`` (a count_tokens body ``raw`` converted), or the
    backend's own answer to ``raw`` at ``path`` where kvroute cannot count them: without
    ids from any tokenizer, or with media of a count not known here (the server counts
    each image's positions; the ids stop before it)."""
    prompt = pool.tok.prompt
    plan = None if prompt is None else (lambda: prompt.plan_chat(chat))
    try:
        tokens = await tokens_for(pool, raw, chat, plan)
    except NoBackendIds:
        tokens = None
    media = media_kinds(chat)
    # (where no backend counts at that path, OpenAI-API servers: the ids kvroute has)
    if tokens is None or (cut_short(chat, tokens)
                          and pool.fw.serving(path, media) != frozenset()):
        return await unrouted(request, pool, path, raw, relay, media)
    return len(tokens)


# ---------------------------------------------------------------------- endpoints
async def chat_completions(request: web.Request) -> web.StreamResponse:
    raw, body = await read_json(request)
    check_messages(body, request.app[SETTINGS].max_messages)
    check_fields(body)
    pool = pool_for(request, body)
    raw = bounded_raw(request, pool, raw, body)
    prompt = pool.tok.prompt
    plan = None if prompt is None else (lambda: prompt.plan_chat(body))
    tokens = await prompt_for(pool, raw, body, plan, parsed=True)
    if tokens is None:
        return await unrouted(request, pool, CHAT_PATH, raw, media=media_kinds(body))
    return await pool.fw.routed(
        request, endpoint="chat", path=CHAT_PATH, raw=raw, body=body,
        tokens=tokens)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, "/v1/completions", "completions")


async def completion(request: web.Request) -> web.StreamResponse:
    return await _completion(request, "/completion", "completion")


async def _completion(request: web.Request, path: str, endpoint: str) -> web.StreamResponse:
    raw, body = await read_json(request)
    if "prompt" not in body:
        raise BadRequest("'prompt' is required", code="missing_prompt")
    check_fields(body, chat=False)
    pool = pool_for(request, body)
    raw = bounded_raw(request, pool, raw, body)
    markers = {b.media_marker for b in pool.backends.values()}
    if ends_with_media(body["prompt"], markers):
        raise BadRequest("the prompt ends with media, which llama-server aborts on (fix: "
                         "put text after the last media marker)")
    tok = pool.tok
    prompt = tok.prompt
    if prompt is None:
        if not isinstance(body["prompt"], str) or tok.remote is None:
            # (several prompts, or media: the server's own ids)
            return await unrouted(request, pool, path, raw, media=media_kinds(body))
        tokens = await tok.remote.completion(body["prompt"], NO_TOKENIZER)
    else:
        try:
            tokens = await tok.run(len(raw), lambda: prompt.completion_ids(body["prompt"],
                                                                           markers))
        except PromptError as e:
            raise BadRequest(str(e)) from None
    return await pool.fw.routed(
        request, endpoint=endpoint, path=path, raw=raw, body=body, tokens=tokens)


async def infill(request: web.Request) -> web.StreamResponse:
    """`/infill` (llama.vim, llama.vscode): routed by the prompt the server builds from
    the body and its FIM tokens (proxy/prompt/infill.py). Without a local vocabulary, or
    with one that has no FIM tokens, a backend answers it as it would (its own 501)."""
    raw, body = await read_json(request)
    check_fields(body, chat=False)
    pool = pool_for(request, body)
    raw = bounded_raw(request, pool, raw, body)
    prompt = pool.tok.prompt
    if prompt is None or fim_missing(prompt.tokenizer):
        return await unrouted(request, pool, "/infill", raw)
    args = {b.name: b.extra_args for b in request.app[CONFIG].backends
            if isinstance(b, ManagedBackendConfig)}
    shape = common_shape(server_shape(b.memory.n_batch, b.slot_ctx, args.get(b.name, ()))
                         for b in pool.backends.values() if b.dialect.serves("/infill"))
    try:
        tokens = await pool.tok.run(len(raw), lambda: infill_ids(prompt.tokenizer, body, shape))
    except InfillUnmodelled:
        return await unrouted(request, pool, "/infill", raw)
    except PromptError as e:
        raise BadRequest(str(e)) from None
    return await pool.fw.routed(
        request, endpoint="infill", path="/infill", raw=raw, body=body, tokens=tokens)


async def unrouted(request: web.Request, pool: Pool, path: str, raw: bytes,
                   relay: Relay = AS_IS, media: frozenset[str] = frozenset()
                   ) -> web.StreamResponse:
    """Forward to the next ready backend without prefix routing (no prompt ids), one
    that takes ``media`` if any does."""
    return await pool.fw.passthrough(request, path, pool.pick_ready(path, media), raw,
                                     relay=relay, pick=lambda: pool.pick_ready(path, media))


async def passthrough(request: web.Request) -> web.StreamResponse:
    # NOTE: only the fixed paths registered in add_routes get here, so the upstream path
    # is one of ours, never a client-chosen (absolute) URL.
    raw = b""
    pool = request.app[POOLS].first
    media: frozenset[str] = frozenset()
    if request.method == "POST":
        raw, body = await read_json(request)
        pool = pool_for(request, body)
        prompt = pool.tok.prompt
        check_forwarded(request.path, body, None if prompt is None else prompt.tokenizer.n_vocab)
        media = media_kinds(body)  # (/apply-template of a chat with images)
    # NOTE: HEAD (aiohttp routes it to GET handlers) goes upstream as GET: aiohttp writes
    # no body to a HEAD request, and the upstream client cannot frame a HEAD answer
    method = "GET" if request.method == "HEAD" else request.method
    return await pool.fw.passthrough(request, request.path, pool.pick_ready("", media), raw,
                                     pick=lambda: pool.pick_ready("", media), method=method)


def _model_objects(request: web.Request) -> list[dict[str, Any]]:
    """The served models, in the shape of the API the client speaks (Anthropic's SDK
    sends `anthropic-version`)."""
    names = dict.fromkeys(name for pool in request.app[POOLS] if pool.health.breakers
                          for name in sorted(pool.names()))
    if "anthropic-version" in request.headers:
        return [{"type": "model", "id": m, "display_name": m,
                 "created_at": "1970-01-01T00:00:00Z"} for m in names]
    return [{"id": m, "object": "model", "owned_by": "kvroute", "created": 0} for m in names]


async def models(request: web.Request) -> web.Response:
    data = _model_objects(request)
    if "anthropic-version" in request.headers:
        return web.json_response({"data": data, "has_more": False,
                                  "first_id": data[0]["id"] if data else None,
                                  "last_id": data[-1]["id"] if data else None})
    return web.json_response({"object": "list", "data": data})


async def model(request: web.Request) -> web.Response:
    """One served model (`client.models.retrieve(id)`)."""
    name = request.match_info["name"]
    for obj in _model_objects(request):
        if obj["id"] == name:
            return web.json_response(obj)
    raise NotFound(f"model {name[:100]!r} does not exist")


async def health(request: web.Request) -> web.Response:
    ready = {pool.spec.name: len(pool.backends) for pool in request.app[POOLS]}
    n = sum(ready.values())
    body = {"status": "ok" if n else "unavailable", "backends_ready": n}
    if len(ready) > 1:  # (a pool with none is unavailable while the others serve)
        body["pools"] = ready
    return web.json_response(body, status=200 if n else 503)


async def metrics(request: web.Request) -> web.Response:
    app = request.app
    for pool in app[POOLS]:
        app[METRICS].child(app[METRICS].pool_backends, pool.spec.name).set(len(pool.backends))
    if (bus := app.get(REPLICAS)) is not None:
        app[METRICS].replicas_connected.set(1 if bus.connected else 0)
        app[METRICS].replica_peers.set(len(bus.view.peers))
        app[METRICS].replica_inflight.set(bus.view.in_flight)
    own = app[METRICS].render()
    ready = [b for pool in app[POOLS] for b in pool.backends.values()]
    theirs = await scrape(app[SESSION], ready)
    return web.Response(body=own + theirs, headers={"Content-Type": CONTENT_TYPE})


async def status(request: web.Request) -> web.Response:
    return web.json_response(status_body(request.app), dumps=lambda o: json.dumps(o, default=str))


def status_body(app: web.Application) -> dict[str, object]:
    """/kvroute/status: backends, admission, each pool's router, the disk tier."""
    pools = app[POOLS]
    # "healthy": the supervisor's view (the process serves); "routed": the proxy's (not
    # tripped by its breaker: requests go there)
    backends = []
    for s in app[SUPERVISOR].statuses():
        name = str(s["name"])
        pool = pools.of_backend(name)
        backends.append({**s, "pool": pool and pool.spec.name,
                         "routed": pool is not None and name in pool.backends,
                         "proxy": pool and pool.health.state(name),
                         # the LoRA scales its requests without `lora` are sent naming
                         "lora_scales": list(pool.router.adapters(name)) if pool else None,
                         "media_tokens": app[METRICS].media_tokens_of(name)})
    admission = app[ADMISSION]
    return {
        "policy": app[CONFIG].proxy.policy,
        "tokenizer": pools.first.tok.source,
        "backends": backends,
        "admission": {"in_flight": admission.in_flight, "queued": admission.queued,
                      "max_in_flight": admission.max_in_flight,
                      "max_queue": admission.max_queue},
        "router": pools.first.router.snapshot(),
        # each model pool (the one above is the first's)
        "pools": [{"name": p.spec.name, "aliases": p.spec.aliases,
                   "backends": p.spec.backends, "tokenizer": p.tok.source,
                   "router": p.router.snapshot()} for p in pools],
        "kv_disk": _disk_status(app),
        "replicas": None if (bus := app.get(REPLICAS)) is None else {
            "id": bus.replica, "nats": bus.url, "connected": bus.connected,
            "peers": bus.view.peers, "peers_in_flight": bus.view.in_flight},
    }


def _disk_status(app: web.Application) -> dict[str, object] | None:
    """The disk tier: where, its budget, and the conversations it holds (None: off).
    Sliding-window and hybrid backends save nothing there (see /kvroute/status backends'
    `memory`): the server restores a slot without its checkpoints."""
    disk = app.get(DISK)
    return None if disk is None else disk.status()
