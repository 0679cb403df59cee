"""Checks of OpenAI / llama.cpp request fields the proxy makes before anything goes out.

llama-server reads most fields leniently (a wrong type silently becomes the default)
and answers some malformed ones with a 500; out-of-range integers are undefined
behaviour in C++. So the proxy rejects them first, with a 400 naming the field, in the
client's API format. Only the fields' *types and ranges* are checked here; what the
messages mean is PromptBuilder's job (it mirrors the server's own parsing).

Cheap by design: one dict lookup per known field present in the body.

`bounded_raw` also bounds the generation a body asks for (`proxy.max_tokens_cap`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from aiohttp import web

from proxy.errors import BadRequest
from proxy.forwarding.payload import encoded
from proxy.server.keys import SETTINGS

if TYPE_CHECKING:
    from proxy.server.pools import Pool

_I32 = 2**31 - 1

# field -> (kind, lo, hi). kind: "int", "num", "bool", "str", "obj", "list", "stop".
_FIELDS: dict[str, tuple[str, float, float]] = {
    "max_tokens": ("int", -1, _I32), "max_completion_tokens": ("int", -1, _I32),
    "n_predict": ("int", -1, _I32), "n": ("int", 1, 128), "seed": ("int", -_I32, 2**32),
    "top_k": ("int", -_I32, _I32), "n_probs": ("int", 0, 1024),
    "n_keep": ("int", -1, _I32), "n_discard": ("int", 0, _I32),
    "min_keep": ("int", 0, _I32), "repeat_last_n": ("int", -1, _I32),
    "top_logprobs": ("int", 0, 1024), "n_indent": ("int", 0, _I32),
    "temperature": ("num", -1e6, 1e6), "top_p": ("num", -1e6, 1e6),
    "min_p": ("num", -1e6, 1e6), "typical_p": ("num", -1e6, 1e6),
    "frequency_penalty": ("num", -1e6, 1e6), "presence_penalty": ("num", -1e6, 1e6),
    "repeat_penalty": ("num", -1e6, 1e6), "dynatemp_range": ("num", -1e6, 1e6),
    "xtc_probability": ("num", -1e6, 1e6), "xtc_threshold": ("num", -1e6, 1e6),
    "stream": ("bool", 0, 0), "cache_prompt": ("bool", 0, 0),
    "ignore_eos": ("bool", 0, 0), "logprobs": ("bool", 0, 0),
    "parallel_tool_calls": ("bool", 0, 0), "timings_per_token": ("bool", 0, 0),
    "return_tokens": ("bool", 0, 0), "add_generation_prompt": ("bool", 0, 0),
    "model": ("str", 0, 0), "user": ("str", 0, 0), "grammar": ("str", 0, 0),
    "stream_options": ("obj", 0, 0), "response_format": ("obj", 0, 0),
    "chat_template_kwargs": ("obj", 0, 0), "json_schema": ("obj", 0, 0),
    "tools": ("list", 0, 0), "stop": ("stop", 0, 0),
}
_REASONING = ("none", "auto", "deepseek", "deepseek-legacy")  # common_reasoning_format_from_name
_KINDS = {"str": str, "obj": dict, "list": list}
_NAMES = {"int": "an integer", "num": "a number", "bool": "a boolean", "str": "a string",
          "obj": "an object", "list": "an array", "stop": "a string or an array of strings"}


# Completions (OpenAI legacy, llama.cpp native): `logprobs` is how many top tokens to
# report (an alias of n_probs), where chat has a boolean and `top_logprobs`.
_COMPLETION_FIELDS = {**_FIELDS, "logprobs": ("int", 0, 1024)}


def check_fields(body: Mapping[str, Any], *, chat: bool = True) -> None:
    """BadRequest (400, code invalid_type / invalid_value) for the first bad field of a chat
    (`chat`) or completion body."""
    fields = _FIELDS if chat else _COMPLETION_FIELDS
    for key in fields.keys() & body.keys():
        value = body[key]
        if value is None:
            continue  # null = default, as llama-server reads it
        kind, lo, hi = fields[key]
        if not _type_ok(kind, value):
            raise BadRequest(f"'{key}' must be {_NAMES[kind]}", code="invalid_type")
        if kind in ("int", "num") and not (lo <= value <= hi and math.isfinite(value)):
            raise BadRequest(f"'{key}' is out of range: expected {lo:g}..{hi:g}",
                             code="invalid_value")
    if chat and "reasoning_format" in body and body["reasoning_format"] not in _REASONING:
        # the server throws on any other value, null included (a 500)
        raise BadRequest(f"'reasoning_format' must be one of {', '.join(_REASONING)}",
                         code="invalid_value")
    slot = body.get("id_slot")
    if slot is not None and not (_type_ok("int", slot) and -1 <= slot <= _I32):
        raise BadRequest("'id_slot' must be an integer >= -1", code="invalid_type")


def _type_ok(kind: str, value: object) -> bool:
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "num":
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "stop":
        return isinstance(value, str) or (
            isinstance(value, list) and all(isinstance(s, str) for s in value))
    return isinstance(value, _KINDS[kind])


def check_messages(body: Mapping[str, Any], max_messages: int) -> list[Any]:
    """The `messages` array, non-empty and not longer than `max_messages`."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array", code="invalid_messages")
    if len(messages) > max_messages:
        raise BadRequest(f"'messages' has {len(messages)} entries, more than the "
                         f"{max_messages} allowed", code="too_many_messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRequest(f"messages[{i}] must be an object", code="invalid_messages")
        role = m.get("role")
        if not isinstance(role, str):
            raise BadRequest(f"messages[{i}].role must be a string", code="invalid_messages")
    return messages


def check_forwarded(path: str, body: Mapping[str, Any], n_vocab: int | None) -> None:
    """The fields of a forwarded llama-server call (/tokenize, /detokenize) that the server
    reads without checking: a wrong type or a token id past the vocabulary is its 500."""
    if path == "/tokenize" and "content" in body:
        c = body["content"]
        if not (isinstance(c, str) or (isinstance(c, list) and all(
                isinstance(x, str) or _type_ok("int", x) for x in c))):
            raise BadRequest("'content' must be a string or an array of strings and token "
                             "ids", code="invalid_type")
    elif path == "/detokenize" and "tokens" in body:
        t = body["tokens"]
        if not (isinstance(t, list) and all(_type_ok("int", x) for x in t)):
            raise BadRequest("'tokens' must be an array of token ids", code="invalid_type")
        if n_vocab is not None and not all(0 <= x < n_vocab for x in t):
            raise BadRequest(f"'tokens' holds an id out of range [0, {n_vocab})",
                             code="invalid_value")


# The generation's length as llama-server reads it: the first of these set (not null).
LENGTH_KEYS = ("n_predict", "max_completion_tokens", "max_tokens")
# llama.cpp's native generating endpoints: their bodies name the length `n_predict`
_NATIVE_PATHS = frozenset({"/completion", "/completions", "/infill"})


def capped_lengths(body: Mapping[str, Any], cap: int | None, slot_ctx: int | None,
                   *, key: str = "max_tokens") -> dict[str, int]:
    """The length fields of ``body`` to rewrite: each above the bound (``cap``, else
    ``slot_ctx``) becomes the bound, and a negative one becomes ``cap``; with ``cap``,
    a body that gives no length (each field absent or null) gets ``cap`` as ``key``.

    llama-server reads -1, an absent field and a null one alike: "no limit given", so
    its ``-n``, and without one the generation runs until the slot's context is full
    (server-context.cpp, "stopped due to running out of context capacity", with context
    shift off, its default). So the cap applies to all three. Without ``cap`` they stay
    as they are: the backend's ``-n`` and the slot's context bound them."""
    bound = cap if cap is not None else slot_ctx
    out = {}
    given = False
    for name in LENGTH_KEYS:
        v = body.get(name)
        if v is None:
            continue  # null reads as absent
        given = True
        if not isinstance(v, int) or isinstance(v, bool):
            continue  # a wrong type: check_fields' 400
        if bound is not None and (v > bound or (v < 0 and cap is not None)):
            out[name] = bound
    if not given and cap is not None:
        out[key] = cap
    return out


def bound_generation(request: web.Request, pool: Pool, body: dict[str, Any]) -> bool:
    """Rewrite ``body``'s length fields in place (see `capped_lengths`) for ``pool``'s
    backends; True when one changed. A limit added goes in the field the endpoint's
    own API names it by: `n_predict` on llama.cpp's native ones, else `max_tokens`."""
    key = "n_predict" if request.path in _NATIVE_PATHS else "max_tokens"
    fields = capped_lengths(body, request.app[SETTINGS].max_tokens_cap,
                            pool.fw.max_context(), key=key)
    body.update(fields)
    return bool(fields)


def bounded_raw(request: web.Request, pool: Pool, raw: bytes, body: dict[str, Any]) -> bytes:
    """`bound_generation` for a body forwarded as the client sent it: ``raw``, or the
    rewritten body's bytes."""
    return encoded(body) if bound_generation(request, pool, body) else raw
