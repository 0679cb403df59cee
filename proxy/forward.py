"""Send one request to a backend and relay its answer, reading cache feedback on the way.

`send()` is the reusable core: it takes an already-chosen `Target`, the client's body
(raw bytes + parsed), and a `Relay` that decides how upstream answers reach the client.
The default `Relay` passes OpenAI / llama.cpp bytes through untouched (event by event,
no buffering); another API (Anthropic `/v1/messages`, issue 5) subclasses it to translate
the body and each stream event, while the feedback (`Outcome`) is always read from the
upstream's own format.

Errors: before anything reaches the client, failures raise `UpstreamError` /
`UpstreamTimeout` (the caller may retry elsewhere: nothing was sent). Once a stream has
started, a failure ends it with an error event in the client's API format.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from backends.supervisor import BackendInfo
from proxy.errors import (
    BadRequest,
    ErrorFormat,
    NoBackendAvailable,
    ProxyError,
    UpstreamError,
    UpstreamTimeout,
    sse_error_event,
)
from proxy.feedback import Outcome, Recorder, held_output
from proxy.router import NoBackend, Router

JSON = dict[str, Any]

# Client errors writing to a peer that went away; the upstream request is then dropped
# (leaving `async with` closes its connection, which makes llama-server cancel the task).
_CLIENT_GONE = (ConnectionResetError, ConnectionError, aiohttp.ClientConnectionResetError)


@dataclass(frozen=True)
class Target:
    """Where one request goes."""

    info: BackendInfo
    slot: int | None = None               # id_slot to pin; None lets the server choose
    predicted_cached: int | None = None   # for the X-Kvroute-Predicted-Cached header

    def headers(self) -> dict[str, str]:
        h = {"X-Kvroute-Backend": self.info.name}
        if self.slot is not None:
            h["X-Kvroute-Slot"] = str(self.slot)
        if self.predicted_cached is not None:
            h["X-Kvroute-Predicted-Cached"] = str(self.predicted_cached)
        return h


class Relay:
    """How upstream answers reach the client. The default relays them unchanged.

    Subclasses translate: return a new JSON body / a list of SSE event bytes, or None to
    relay the upstream's bytes as they are.
    """

    error_format: ErrorFormat = ErrorFormat.OPENAI

    def body(self, obj: JSON) -> JSON | None:
        """A complete (non-streaming) 2xx upstream body."""
        return None

    def event(self, obj: JSON) -> list[bytes] | None:
        """One upstream SSE `data:` object."""
        return None

    def done(self) -> list[bytes] | None:
        """The upstream's `data: [DONE]`."""
        return None

    def error(self, status: int, body: bytes) -> bytes | None:
        """An upstream error body (status >= 400)."""
        return None


PASSTHROUGH = Relay()


def upstream_payload(raw: bytes, body: JSON, extra: JSON) -> bytes:
    """The client's body with `extra` fields set (cache_prompt is never touched).

    When none of `extra`'s keys is in the body, the fields are spliced in front of the raw
    bytes: re-serialising a 30k-token conversation costs ~1 ms, splicing a memcpy.
    """
    if not extra:
        return raw
    if body and extra.keys().isdisjoint(body):
        start = raw.index(b"{") + 1
        fields = json.dumps(extra, separators=(",", ":"))[1:-1].encode()
        return raw[:start] + fields + b"," + raw[start:]
    merged = dict(body)
    for key, val in extra.items():
        if isinstance(val, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **val}
        else:
            merged[key] = val
    return json.dumps(merged, separators=(",", ":")).encode()


def backend_headers(info: BackendInfo) -> dict[str, str]:
    """Headers the backend gets: its own key, never the client's."""
    h = {"Content-Type": "application/json"}
    if info.api_key:
        h["Authorization"] = f"Bearer {info.api_key}"
    return h


def _is_usage_only(obj: JSON) -> bool:
    return "usage" in obj and not obj.get("choices")


async def send(session: aiohttp.ClientSession, request: web.Request, target: Target,
               path: str, payload: bytes, outcome: Outcome, *, relay: Relay = PASSTHROUGH,
               strip_usage: bool = False, method: str = "POST") -> web.StreamResponse:
    """Send `payload` to `target` at `path` and answer `request` with what comes back.

    `strip_usage` drops the usage-only stream chunk the proxy asked for on the client's
    behalf. Fills `outcome` (status, feedback, text, `complete`).
    """
    url = target.info.url + path
    outcome.started = time.perf_counter()
    try:
        upstream = await session.request(method, url, data=payload,
                                         headers=backend_headers(target.info))
    except TimeoutError as e:
        raise UpstreamTimeout(f"backend {target.info.name} did not answer in time") from e
    except aiohttp.ClientError as e:
        raise UpstreamError(f"backend {target.info.name} unreachable: {type(e).__name__}") from e
    async with upstream:
        outcome.status = upstream.status
        ctype = upstream.headers.get("Content-Type", "application/json")
        if upstream.status < 400 and ctype.startswith("text/event-stream"):
            return await _relay_stream(request, upstream, target, outcome, relay, strip_usage)
        try:
            data = await upstream.read()
        except TimeoutError as e:
            raise UpstreamTimeout(f"backend {target.info.name} timed out answering") from e
        except aiohttp.ClientError as e:
            raise UpstreamError(f"backend {target.info.name} broke the connection: "
                                f"{type(e).__name__}") from e
    outcome.finished_at = time.perf_counter()
    if upstream.status >= 400:
        data = relay.error(upstream.status, data) or data
    elif ctype.startswith("application/json"):
        data = _absorb_body(data, outcome, relay)
    return web.Response(status=upstream.status, body=data, headers=target.headers(),
                        content_type=ctype.split(";")[0].strip())


def _absorb_body(data: bytes, outcome: Outcome, relay: Relay) -> bytes:
    try:
        obj = json.loads(data)
    except ValueError:
        return data
    outcome.absorb(obj, final=True)
    outcome.complete = True
    if isinstance(obj, dict):
        translated = relay.body(obj)
        if translated is not None:
            return json.dumps(translated, separators=(",", ":")).encode()
    return data


async def _relay_stream(request: web.Request, upstream: aiohttp.ClientResponse,
                        target: Target, outcome: Outcome, relay: Relay,
                        strip_usage: bool) -> web.StreamResponse:
    resp = web.StreamResponse(status=upstream.status, headers={
        **target.headers(), "Content-Type": "text/event-stream",
        "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    event: list[bytes] = []
    try:
        async for line in upstream.content:
            if line.strip():
                event.append(line)
                continue
            # A blank line ends an SSE event: forward it whole, as soon as it is complete.
            if event:
                out = _translate_event(event, outcome, relay, strip_usage)
                event = []
                for chunk in out:
                    await resp.write(chunk)
        if event:
            for chunk in _translate_event(event, outcome, relay, strip_usage):
                await resp.write(chunk)
    except _CLIENT_GONE:
        return resp  # the client left; outcome.complete stays False -> abort
    except (TimeoutError, aiohttp.ClientError) as e:
        err = (UpstreamTimeout if isinstance(e, TimeoutError) else UpstreamError)(
            f"backend {target.info.name} failed mid-stream: {type(e).__name__}")
        outcome.complete = False
        try:
            await resp.write(sse_error_event(err, relay.error_format))
        except _CLIENT_GONE:
            return resp
    outcome.finished_at = time.perf_counter()
    with contextlib.suppress(_CLIENT_GONE):
        await resp.write_eof()
    return resp


def _translate_event(lines: list[bytes], outcome: Outcome, relay: Relay,
                     strip_usage: bool) -> Iterable[bytes]:
    """Feed one SSE event to `outcome` and return the bytes the client gets for it."""
    raw = b"".join(lines)
    data = b"".join(ln[5:].strip() for ln in lines if ln.startswith(b"data:"))
    if not data:
        return (raw + b"\n",)
    if data == b"[DONE]":
        outcome.complete = True
        return relay.done() or (raw + b"\n",)
    try:
        obj = json.loads(data)
    except ValueError:
        return (raw + b"\n",)
    if not isinstance(obj, dict):
        return (raw + b"\n",)
    if "error" in obj:
        outcome.complete = False
    outcome.absorb(obj)
    if obj.get("stop") is True:  # llama-native streams end with stop:true, no [DONE]
        outcome.complete = True
    if strip_usage and _is_usage_only(obj):
        return ()
    translated = relay.event(obj)
    return (raw + b"\n",) if translated is None else translated


# ---------------------------------------------------------------- the routed pipeline
# Endpoints whose streams report usage only when asked (`stream_options.include_usage`).
_USAGE_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})


def _wants_usage(body: JSON) -> bool:
    opts = body.get("stream_options")
    return isinstance(opts, dict) and opts.get("include_usage") is True


def session_hint(request: web.Request, body: JSON) -> str | None:
    """A conversation/session id the client volunteers (ties broken per session)."""
    for name in ("X-Claude-Code-Session-Id", "X-Session-Id"):
        value = request.headers.get(name)
        if value:
            return value[:200]
    user = body.get("user")
    return user[:200] if isinstance(user, str) and user else None


class Forwarder:
    """decide -> send with id_slot -> feedback: one routed request, start to finish."""

    def __init__(self, session: aiohttp.ClientSession, router: Router,
                 backends: Mapping[str, BackendInfo], recorder: Recorder,
                 tokenize_output: Callable[[str], Sequence[int]]) -> None:
        self.session = session
        self.router = router
        self.backends = backends        # live view, kept current by the app
        self.recorder = recorder
        self._tokenize_output = tokenize_output

    async def routed(self, request: web.Request, *, endpoint: str, path: str, raw: bytes,
                     body: JSON, tokens: Sequence[int], relay: Relay = PASSTHROUGH
                     ) -> web.StreamResponse:
        """Route `tokens`, send `body` to `path` on the chosen backend, learn from it.

        The slot claim made by `decide` is released however this ends: `complete` on a
        normal answer, `abort` on errors, cancellation and client disconnects.
        """
        started = time.perf_counter()
        decision = self.router.decide(tokens, session=session_hint(request, body),
                                      now=time.monotonic())
        if isinstance(decision, NoBackend):
            raise _no_backend_error(decision)
        info = self.backends.get(decision.backend)
        if info is None:  # removed between the event and now
            self.router.abort(decision)
            raise NoBackendAvailable("backend went away", retry_after=1)
        extra: JSON = {}
        if decision.slot is not None:
            extra["id_slot"] = decision.slot
        strip_usage = False
        if body.get("stream") is True and path in _USAGE_PATHS and not _wants_usage(body):
            extra["stream_options"] = {"include_usage": True}
            strip_usage = True
        if path == "/completion" and "return_tokens" not in body:
            extra["return_tokens"] = True  # exact generated ids: the slot holds these
        payload = upstream_payload(raw, body, extra)
        target = Target(info, decision.slot, decision.predicted_cached)
        outcome = Outcome(started=started)
        finished = False
        self.recorder.begin(info.name)
        try:
            resp = await send(self.session, request, target, path, payload, outcome,
                              relay=relay, strip_usage=strip_usage)
            if outcome.complete and outcome.status < 400:
                self.router.complete(
                    decision, output_tokens=held_output(outcome, self._tokenize_output),
                    reported_cached=outcome.reported_cached,
                    prompt_ms=outcome.prompt_ms, prompt_n=outcome.prompt_n,
                    reported_slot=outcome.reported_slot, now=time.monotonic())
                finished = True
            return resp
        finally:
            if not finished:
                self.router.abort(decision)
            self.recorder.end(endpoint, decision, outcome, started,
                              stream=body.get("stream") is True)

    async def passthrough(self, request: web.Request, path: str, info: BackendInfo,
                          raw: bytes) -> web.StreamResponse:
        """Forward an unrouted call (/tokenize, /props, ...) to `info` as it is."""
        outcome = Outcome(started=time.perf_counter())
        return await send(self.session, request, Target(info), path, raw, outcome,
                          method=request.method)


def _no_backend_error(nb: NoBackend) -> ProxyError:
    # NOTE: the router reports "too long for every backend" as a NoBackend reason; that
    # is the client's fault (400), the rest is ours (503, retry soon).
    if "exceeds" in nb.reason:
        return BadRequest(nb.reason, code="context_length_exceeded")
    return NoBackendAvailable(nb.reason, retry_after=1)
