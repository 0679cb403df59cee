"""Prompt ids from a backend itself: exact by construction, one round trip more.

kvroute renders and tokenizes prompts locally (proxy/prompt/), which is fast and exact for
the templates it mirrors. Where it cannot be (no GGUF to tokenize with, a request its
renderer refuses, a backend whose template renders differently), the backend answers the
question: `/apply-template` builds the prompt its chat endpoint would build, `/tokenize`
(with the specials parsed and BOS added, as the server tokenizes prompts) gives its ids.
`/apply-template` parses the request exactly as the chat endpoint does, so a refusal
there (llama-server's error body, 400 or 500) is the chat endpoint's answer: the client
gets its status and words. Any other failure (the backend down, loading, without the
path, or not a llama-server) says nothing against the request: `NoBackendIds`.

`check` compares the two ways on a few conversation shapes when a backend becomes ready;
a difference switches the model to backend ids for good (and says where they differ).
"""

from __future__ import annotations

import json
import re
from array import array
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from backends.client import BackendClient, BackendDown, BadResponse, Tokens
from backends.info import BackendInfo
from proxy.errors import BadRequest, NoBackendAvailable, ProxyError
from proxy.observability.logging import get_logger
from proxy.prompt.builder import PromptBuilder
from proxy.prompt.chat_request import PromptError
from proxy.prompt.media import SERVER_MARKER_HEAD, media_kinds

# Why a request's ids came from a backend (the metric's label).
NO_TOKENIZER = "no_tokenizer"  # no local GGUF (external backends only)
RENDER_FAILED = "render_failed"  # the local renderer refused what the backend renders
INEXACT = "inexact"  # the local template renders differently from the backend's
CONTINUATION = "continuation"  # ... only where it continues a final assistant message

# Shapes every chat template is asked to render the same way as the backend.
_TOOL = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}
PROBES: tuple[Mapping[str, Any], ...] = (
    {"messages": [{"role": "user", "content": "Hello there."}]},
    {"messages": [{"role": "system", "content": "You are terse."},
                  {"role": "user", "content": "One."},
                  {"role": "assistant", "content": "Two."},
                  {"role": "user", "content": "Three?"}]},
    {"tools": [_TOOL],
     "messages": [{"role": "user", "content": "Show me a.txt"},
                  {"role": "assistant", "content": "", "tool_calls": [{
                      "id": "call_1", "type": "function", "function": {
                          "name": "read_file", "arguments": "{\"path\": \"a.txt\"}"}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "alpha"},
                  {"role": "user", "content": "Thanks."}]},
)

# A final assistant message is continued (prefill): servers reopen it in ways of their
# own per template (reasoning tags inferred), checked apart from the shapes above.
CONTINUATION_PROBE: Mapping[str, Any] = {"messages": [
    {"role": "user", "content": "Name a season."},
    {"role": "assistant", "content": "Autumn"}]}


def continues(body: Mapping[str, Any]) -> bool:
    """Does the request continue its final assistant message?"""
    messages = body.get("messages")
    return isinstance(messages, list) and bool(messages) and isinstance(messages[-1], dict) \
        and messages[-1].get("role") == "assistant"


class NoBackendIds(NoBackendAvailable):
    """No backend could give a prompt's ids, and none refused the request: nothing is
    known against it (an endpoint can serve it without prefix routing, and the server it
    reaches answers it itself)."""


@dataclass(frozen=True)
class Mismatch:
    """Where local ids first differ from a backend's, on which probe."""

    probe: int
    at: int
    local: int | None
    backend: int | None

    def __str__(self) -> str:
        return (f"probe {self.probe}: token {self.at} is {self.local} here, "
                f"{self.backend} on the backend")


class BackendTokens:
    """Prompt ids asked of a ready backend (``pick`` chooses one that takes the media
    kinds it is given; one retry elsewhere)."""

    def __init__(self, session: aiohttp.ClientSession,
                 pick: Callable[[frozenset[str]], BackendInfo],
                 counted: Callable[[str], None]) -> None:
        self.session = session
        self.pick = pick
        self.counted = counted

    async def chat(self, body: Mapping[str, Any], reason: str,
                   tokenize: Callable[[str], Awaitable[array]] | None = None,
                   raw: bytes | None = None) -> array:
        """Ids of the prompt the backend's chat endpoint builds for ``body`` (``raw``: the
        client's bytes it was parsed from, sent as they are). With a local ``tokenize``
        (the GGUF's vocabulary: exact whatever the template), only the text comes from
        the backend: its history's fragments are then cached here, and a turn costs one
        render on the backend instead of a whole tokenization there."""
        payload = _payload(body) if raw is None else raw
        media = media_kinds(body)

        async def ask(client: BackendClient) -> Tokens | BackendDown | BadResponse:
            prompt = await client.apply_template(payload)
            if not isinstance(prompt, str):
                return prompt
            if media:
                # the server's own marker (random unless LLAMA_MEDIA_MARKER sets it)
                # stands where a media chunk will: its positions are not known here,
                # so the ids stop there (proxy/prompt/media.py)
                prompt = prompt.split(SERVER_MARKER_HEAD, 1)[0]
            if tokenize is not None:
                return Tokens(await tokenize(prompt), None)
            return await client.tokenize(prompt)
        # a backend without a projector refuses to render media parts
        return await self._ask(ask, reason, media)

    async def completion(self, prompt: str | Sequence[Any], reason: str) -> array:
        """Ids of a completion prompt (text, or text and ids mixed) as the backend has them."""
        async def ask(client: BackendClient) -> Tokens | BackendDown | BadResponse:
            return await client.tokenize(prompt)
        return await self._ask(ask, reason)

    async def _ask(self, ask: Callable[[BackendClient], Any], reason: str,
                   media: frozenset[str] = frozenset()) -> array:
        failed: list[str] = []
        for _ in range(2):
            try:
                info = self.pick(media)
            except NoBackendAvailable as e:
                # no llama-server to ask (only servers of the OpenAI API are up): the
                # request is served without prefix routing by one of those
                raise NoBackendIds(f"no backend could give the prompt's ids ({e})",
                                   retry_after=1) from None
            got = await ask(BackendClient(self.session, info.url, info.api_key))
            if isinstance(got, Tokens):
                self.counted(reason)
                return got.ids if isinstance(got.ids, array) else array("i", got.ids)
            if isinstance(got, BadResponse):
                refusal = _refusal(got)
                if refusal is not None:
                    raise refusal  # deterministic: another backend would refuse it too
            get_logger().warning("tokens.backend_failed", backend=info.name, reason=reason,
                                 error=str(got)[:300])
            failed.append(f"{info.name} {_failure(got)}")
        # NOTE: names, never URLs: a client must not learn the backends' addresses
        raise NoBackendIds(f"no backend could give the prompt's ids ({'; '.join(failed)})",
                           retry_after=1)

    async def check(self, prompt: PromptBuilder, info: BackendInfo,
                    probes: Sequence[Mapping[str, Any]] = PROBES) -> Mismatch | None:
        """The first difference between local ids and ``info``'s on the probe shapes
        (None: the same on all, or the backend could not say)."""
        client = BackendClient(self.session, info.url, info.api_key)
        for i, body in enumerate(probes):
            try:
                local = list(prompt.chat_ids(dict(body)))
            except PromptError:
                local = None
            text = await client.apply_template(_payload(body))
            if not isinstance(text, str):
                continue  # the server cannot render this shape either (or is gone)
            theirs = await client.tokenize(text)
            if not isinstance(theirs, Tokens):
                continue
            if local != theirs.ids:
                return _first_difference(i, local or [], theirs.ids)
        return None


def _payload(body: Mapping[str, Any]) -> bytes:
    # orjson: a coding agent's turn is ~100 KB. It refuses an integer past 64 bits and
    # nesting past 254 levels, which the server parses: a tool schema can be that deep.
    try:
        return orjson.dumps(body)
    except TypeError:
        return _deep_dumps(body).encode()


def _deep_dumps(value: Any) -> str:
    """JSON text of ``value`` at any depth: an explicit stack, where json.dumps recurses
    and stops at Python's recursion limit (~1000 levels; orjson.loads accepts 1024)."""
    out: list[str] = []
    todo: list[tuple[bool, Any]] = [(False, value)]  # (literal text?, text or value)
    while todo:
        literal, v = todo.pop()
        if literal:
            out.append(v)
        elif isinstance(v, Mapping):
            parts: list[tuple[bool, Any]] = [(True, "{")]
            for i, (k, x) in enumerate(v.items()):
                parts += [(True, ("," if i else "") + json.dumps(str(k)) + ":"), (False, x)]
            todo += reversed([*parts, (True, "}")])
        elif isinstance(v, list | tuple):
            parts = [(True, "[")]
            for i, x in enumerate(v):
                parts += [(True, ","), (False, x)] if i else [(False, x)]
            todo += reversed([*parts, (True, "]")])
        else:
            out.append(json.dumps(v))
    return "".join(out)


def _first_difference(probe: int, a: Sequence[int], b: Sequence[int]) -> Mismatch:
    at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
              min(len(a), len(b)))
    return Mismatch(probe, at, a[at] if at < len(a) else None, b[at] if at < len(b) else None)


def _refusal(got: BadResponse) -> ProxyError | None:
    """The error the server's chat endpoint answers for a request whose `/apply-template`
    (or `/tokenize`) answered ``got``, when that is llama-server refusing the request
    itself: its error body with 400 or 500, the statuses its handlers' exceptions
    become (ex_wrapper). None for anything else: 401, 404, 503 (loading), another
    server's error page say nothing about the request."""
    if got.status not in (400, 500):
        return None
    found = _error_of(got.body)
    if found is None:
        return None
    message, kind = found
    err = BadRequest(message) if got.status == 400 else ProxyError(message)
    if kind is not None:
        err.type = kind  # (exceed_context_size_error is a 400 too)
    return err


# The start of llama-server's error body (nlohmann's keys are sorted), for a body the
# backend client cut: the message up to the cut.
_CUT_ERROR = re.compile(r'\{"error":\{"code":\d+,"message":"((?:[^"\\]|\\u[0-9a-fA-F]{4}|\\[^u])*)')
_ERROR_TYPE = re.compile(r"[a-z_]{1,64}")


def _error_of(body: str) -> tuple[str, str | None] | None:
    """(message, type) of an OpenAI-style error body, also of one cut short."""
    try:
        err = json.loads(body).get("error")
    except (ValueError, AttributeError):
        cut = _CUT_ERROR.match(body)
        if cut is None:
            return None
        try:  # (whole escapes only: the match stops before one that was cut)
            return str(json.loads(f'"{cut.group(1)}"')) + " ...", None
        except ValueError:
            return None
    if not isinstance(err, dict) or not isinstance(err.get("message"), str):
        return None
    kind = err.get("type")
    return (err["message"][:4000],
            kind if isinstance(kind, str) and _ERROR_TYPE.fullmatch(kind) else None)


def _failure(got: BackendDown | BadResponse) -> str:
    if isinstance(got, BackendDown):
        return "timed out" if got.timed_out else "unreachable"
    return f"answered {got.status}"
