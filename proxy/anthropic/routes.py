"""Anthropic Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

A drop-in base URL for Claude Code and the Anthropic SDKs. Each request is converted
with `anthropic_to_chat` (llama-server's own Anthropic -> chat conversion, ported), so
the routing tokens are exactly what the backend caches, and sent to the backend's
`/v1/chat/completions` with the router's `id_slot`; `AnthropicRelay` turns the answer
back into Anthropic's format. Why not forward to the backend's `/v1/messages`: the
server ignores `id_slot` there and reports no `timings`; measured in BENCHMARKS.md,
"Anthropic API".

Requests are checked as Anthropic's API checks them (proxy/anthropic/validate.py): the
server's converter takes anything, `max_tokens` included (it defaults to 4096).
Accepted and ignored like the server does: `?beta=true`, `anthropic-version`,
`anthropic-beta`, `cache_control`. Client keys (`x-api-key` or `Authorization: Bearer`)
are checked by the app's auth middleware. Session hint for the router:
`X-Claude-Code-Session-Id`, else `metadata.user_id`.
"""

from __future__ import annotations

from aiohttp import web

from backends.dialect import CHAT_PATH
from proxy.anthropic.convert import anthropic_to_chat
from proxy.anthropic.relay import AnthropicErrors, AnthropicRelay
from proxy.anthropic.validate import validate
from proxy.errors import BadRequest
from proxy.forwarding.answer import JSON
from proxy.forwarding.payload import encoded
from proxy.prompt.chat_request import PromptError
from proxy.prompt.media import media_kinds
from proxy.server.handlers import counted, pool_for, prompt_for, read_json, unrouted
from proxy.server.validate import bound_generation, check_fields


def add_routes(app: web.Application) -> None:
    # Anthropic's error envelope for every error under /v1/messages (the errors module's
    # documented extension point; see errors.format_for_path).
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)


# ------------------------------------------------------------------------ parsing
def chat_body(body: JSON) -> JSON:
    """The chat-completions body sent upstream (what `/v1/messages` would run)."""
    try:
        chat = anthropic_to_chat(body)
    except PromptError as e:
        raise BadRequest(str(e)) from None
    # the ranges the chat endpoint checks (max_tokens, top_k, temperature, ...): out of
    # range, the server truncates them to 32 bits or worse
    check_fields(chat)
    # llama-server's converter keeps metadata.user_id under a private key nothing reads
    user = chat.pop("__metadata_user_id", None)
    if isinstance(user, str):
        chat["user"] = user  # OpenAI's end-user field: the Forwarder's session hint
    if chat.get("stream") is True:
        # usage chunk -> message_delta; timings on every chunk -> message_start knows the
        # prompt's reuse before the first token is relayed.
        chat["stream_options"] = {"include_usage": True}
        chat["timings_per_token"] = True
    return chat


# ---------------------------------------------------------------------- endpoints
async def messages(request: web.Request) -> web.StreamResponse:
    raw, body = await read_json(request)
    validate(body)
    chat = chat_body(body)
    pool = pool_for(request, body)
    bound_generation(request, pool, chat)
    prompt = pool.tok.prompt
    model = body.get("model") if isinstance(body.get("model"), str) else ""
    plan = None if prompt is None else (lambda: prompt.plan_chat(chat))
    tokens = await prompt_for(pool, raw, chat, plan)
    payload = encoded(chat)
    relay = AnthropicRelay(model, body.get("stop_sequences") or ())
    if tokens is None:  # no backend can give the ids, none refused the request
        return await unrouted(request, pool, CHAT_PATH, payload, relay, media_kinds(chat))
    return await pool.fw.routed(
        request, endpoint="messages", path=CHAT_PATH, raw=payload, body=chat,
        tokens=tokens, relay=relay)


async def count_tokens(request: web.Request) -> web.StreamResponse:
    raw, body = await read_json(request)
    validate(body, count=True)
    pool = pool_for(request, body)
    got = await counted(request, pool, raw, chat_body(body), "/v1/messages/count_tokens",
                        AnthropicErrors())
    if isinstance(got, web.StreamResponse):
        return got
    return web.json_response({"input_tokens": got})
