"""OpenAI Responses API: `POST /v1/responses` (and `/responses`), `.../input_tokens`.

A drop-in base URL for Codex CLI and the OpenAI SDKs' `client.responses`. Each request
is converted with `responses_to_chat` (llama-server's own Responses -> chat conversion,
ported), so the routing tokens are exactly what the backend caches, and sent to the
backend's `/v1/chat/completions` with the router's `id_slot`; `ResponsesRelay` turns the
answer back into what the server's `/v1/responses` answers.

Why not forward to the backend's own `/v1/responses`: it does honour `id_slot` (the
converted body keeps every other field), but what it answers cannot be read back by the
feedback path: a non-streamed answer has no `timings` and names its usage
`input_tokens` / `input_tokens_details` (no prefill time, no generated-token count, so
the slot's held output is unknown and the next turn is predicted short), and a stream
ends without `data: [DONE]`, which is how the relay knows an answer is whole. Its
events also lack `output_index` / `sequence_number`, without which the OpenAI SDK's
`responses.stream()` helper fails. Converting keeps the chat path's feedback whole and
gives clients the complete protocol.

State: `previous_response_id` and `conversation` name responses kept server-side;
llama-server keeps none and neither does kvroute, so both are refused (the server
refuses the first and would ignore the second), never dropped. Session hint for the
router: `X-Session-Id`, else `user`, else `prompt_cache_key` (Codex sends its
conversation id there).
"""

from __future__ import annotations

from aiohttp import web

from backends.dialect import CHAT_PATH
from proxy.errors import BadRequest, NotFound
from proxy.forwarding.answer import JSON
from proxy.forwarding.payload import encoded
from proxy.prompt.chat_request import PromptError
from proxy.prompt.media import media_kinds
from proxy.responses.convert import responses_to_chat
from proxy.responses.relay import ResponsesRelay
from proxy.server.handlers import counted, pool_for, prompt_for, read_json, unrouted
from proxy.server.validate import bound_generation, check_fields

_STATELESS = ("kvroute keeps no responses (nor does llama-server): send the whole "
              "conversation in 'input'")


def add_routes(app: web.Application) -> None:
    for base in ("/v1/responses", "/responses"):
        app.router.add_post(base, responses)
        app.router.add_post(base + "/input_tokens", input_tokens)
        # GET /v1/responses/{id}, DELETE, /cancel, /input_items: stored responses
        app.router.add_route("*", base + "/{rest:.+}", not_stored)


# ------------------------------------------------------------------------ parsing
def validate(body: JSON) -> None:
    """The checks whose failure the backend would report less clearly (or not at all)."""
    prev = body.get("previous_response_id")
    if prev is not None and not isinstance(prev, str):
        raise BadRequest("'previous_response_id' must be a string", code="invalid_type")
    if prev:
        # the server's own message, and what to do instead
        raise BadRequest(f"llama.cpp does not support 'previous_response_id'. "
                         f"({_STATELESS})", code="unsupported_parameter")
    if body.get("conversation") is not None:
        raise BadRequest(f"'conversation' is not supported: {_STATELESS}",
                         code="unsupported_parameter")
    n = body.get("max_output_tokens")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool)
                          or not -1 <= n < 2**31):
        raise BadRequest("'max_output_tokens' must be an integer (-1: no limit)",
                         code="invalid_type")


def chat_body(body: JSON) -> JSON:
    """The chat-completions body sent upstream (what `/v1/responses` would run)."""
    validate(body)
    try:
        chat = responses_to_chat(body)
    except PromptError as e:
        raise BadRequest(str(e)) from None
    # the ranges the chat endpoint checks (max_tokens, top_k, temperature, ...): out of
    # range, the server truncates them to 32 bits or worse
    check_fields(chat)
    key = chat.get("prompt_cache_key")
    if not isinstance(chat.get("user"), str) and isinstance(key, str) and key:
        chat["user"] = key  # OpenAI's end-user field: the Forwarder's session hint
    if chat.get("stream") is True:
        # the usage chunk -> response.completed (a Responses `stream_options` means
        # something else: the server does not read it)
        chat["stream_options"] = {"include_usage": True}
    return chat


# ---------------------------------------------------------------------- endpoints
async def responses(request: web.Request) -> web.StreamResponse:
    raw, body = await read_json(request)
    chat = chat_body(body)
    pool = pool_for(request, body)
    bound_generation(request, pool, chat)  # (max_output_tokens is its max_tokens)
    prompt = pool.tok.prompt
    plan = None if prompt is None else (lambda: prompt.plan_chat(chat))
    tokens = await prompt_for(pool, raw, chat, plan)
    payload = encoded(chat)
    relay = ResponsesRelay(body["model"] if isinstance(body.get("model"), str) else "")
    if tokens is None:  # no backend can give the ids, none refused the request
        return await unrouted(request, pool, CHAT_PATH, payload, relay, media_kinds(chat))
    return await pool.fw.routed(
        request, endpoint="responses", path=CHAT_PATH, raw=payload,
        body=chat, tokens=tokens, relay=relay)


async def input_tokens(request: web.Request) -> web.StreamResponse:
    raw, body = await read_json(request)
    chat = chat_body(body)
    pool = pool_for(request, body)
    got = await counted(request, pool, raw, chat, "/v1/responses/input_tokens")
    if isinstance(got, web.StreamResponse):
        return got
    return web.json_response({"input_tokens": got, "object": "response.input_tokens"})


async def not_stored(request: web.Request) -> web.Response:
    raise NotFound(f"{request.path[:100]}: {_STATELESS}")
