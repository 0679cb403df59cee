"""Send one request to a backend and relay its answer, reading cache feedback on the way.

`send()` is the reusable core: it takes an already-chosen `Target`, the client's body
(raw bytes + parsed), and a `Relay` (proxy/forwarding/answer.py, with the reading of
the answer's events) that decides how upstream answers reach the client.
The default `Relay` passes OpenAI / llama.cpp bytes through untouched (event by event,
no buffering); another API (Anthropic `/v1/messages`) subclasses it to translate
the body and each stream event, while the feedback (`Outcome`) is always read from the
upstream's own format.

Errors: before anything reaches the client, failures raise `UpstreamError` /
`UpstreamTimeout` (the caller may retry elsewhere: nothing was sent). Once a stream has
started, a failure ends it with an error event in the client's API format.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import aiohttp
from aiohttp import web

from backends.info import BackendInfo
from proxy.errors import (
    RESPONSE_STARTED,
    UpstreamError,
    UpstreamTimeout,
    sse_error_event,
)
from proxy.forwarding.answer import (
    AS_IS,
    Relay,
    absorb_body,
    answer_bytes,
    assembled,
    first_output,
    sse_events,
    translate_event,
)
from proxy.forwarding.assemble import Assembler
from proxy.forwarding.health import BackendHealth
from proxy.forwarding.transport import TransportError
from proxy.forwarding.upstream import Response, Upstream
from proxy.observability.logging import get_logger
from proxy.reporting.outcome import Outcome

# Client errors writing to a peer that went away; the upstream request is then dropped
# (leaving `async with` closes its connection, which makes llama-server cancel the task).
_CLIENT_GONE = (ConnectionResetError, ConnectionError, aiohttp.ClientConnectionResetError)


@dataclass(frozen=True)
class Target:
    """Where one request goes."""

    info: BackendInfo
    slot: int | None = None               # id_slot to pin; None lets the server choose
    predicted_cached: int | None = None   # for the X-Kvroute-Predicted-Cached header
    tier: str | None = None               # where that reuse comes from: slot | ram | none

    def headers(self) -> dict[str, str]:
        h = {"X-Kvroute-Backend": self.info.name}
        if self.slot is not None:
            h["X-Kvroute-Slot"] = str(self.slot)
        if self.predicted_cached is not None:
            h["X-Kvroute-Predicted-Cached"] = str(self.predicted_cached)
        if self.tier is not None:
            h["X-Kvroute-Tier"] = self.tier
        return h


class ExchangeEvents(Protocol):
    """What the caller of `send` hears of its exchange, in this order: `sent` once the
    request is written, `settle` once the answer's head is in and before anything is
    written to the client (it returns the target the response headers are made from: its
    prediction may have changed), `data` as the answer's bytes arrive (before they are
    read), `first_token` with the first generated text."""

    def sent(self) -> None: ...

    async def settle(self, target: Target) -> Target: ...

    def data(self) -> None: ...

    def first_token(self) -> None: ...


@dataclass(frozen=True)
class Exchange:
    """One upstream exchange: what is sent where, and how its answer reaches the client.

    `strip_usage` drops the usage-only stream chunk the proxy asked for on the client's
    behalf. With `assemble`, the upstream stream (asked for by the caller) becomes one
    non-streamed answer (proxy/forwarding/assemble.py). `outcome` is filled as the answer
    comes."""

    client: Upstream
    request: web.Request
    target: Target
    path: str
    payload: bytes
    outcome: Outcome
    relay: Relay = AS_IS
    strip_usage: bool = False
    method: str = "POST"
    health: BackendHealth | None = None
    first_byte_timeout: float | None = None
    assemble: Assembler | None = None


def backend_headers(info: BackendInfo) -> dict[str, str]:
    """Headers the backend gets: its own key, never the client's."""
    h = {"Content-Type": "application/json"}
    if info.api_key:
        h["Authorization"] = f"Bearer {info.api_key}"
    return h


async def send(ex: Exchange, events: ExchangeEvents | None = None) -> web.StreamResponse:
    """Send `ex.payload` to `ex.target` at `ex.path` and answer `ex.request` with what
    comes back, telling `events` (if any: an unrouted call has none) as it goes.

    Until the client has received its first byte (a whole body, or a stream's first
    event), failures raise `UpstreamError` / `UpstreamTimeout`: the caller may retry
    elsewhere. That phase is bounded by `first_byte_timeout` and cut short when `health`
    trips the backend (a hung backend).
    """
    outcome = ex.outcome
    if events is not None:
        outcome.on_first_token = events.first_token
    outcome.started = time.perf_counter()
    head = await _answer_head(ex, events)
    upstream = head.upstream
    if head.stream is not None:  # relayed event by event
        name = ex.target.info.name
        with ex.health.relaying(name, upstream) if ex.health else contextlib.nullcontext():
            return await _relay_stream(ex, head)
    upstream.release()
    outcome.finished_at = time.perf_counter()
    data, ctype = _final_body(ex, head)
    resp = web.Response(status=outcome.status, body=data, headers=head.target.headers(),
                        content_type=ctype.split(";")[0].strip())
    # Written here, not by aiohttp after the handler returns: the client has its answer
    # before the caller's feedback work (tree update, output tokens, log line, metrics)
    # runs, which takes that work off the request's latency.
    ex.request[RESPONSE_STARTED] = resp
    with contextlib.suppress(*_CLIENT_GONE):
        await resp.prepare(ex.request)
        await resp.write_eof()
    return resp


class _Head(NamedTuple):
    """An answer as far as `send` reads it before writing to the client."""

    upstream: Response
    target: Target  # as settled: the response headers are made from it
    ctype: str
    data: bytes  # a whole body (assembled: the translated answer)
    stream: AsyncIterator[list[bytes]] | None  # the rest of a stream relayed as it comes
    first: list[bytes]  # ... and its first output, read already
    assembled: bool


async def _answer_head(ex: Exchange, events: ExchangeEvents | None) -> _Head:
    """Send the request and read the answer up to what the client is first written."""
    target, outcome, health = ex.target, ex.outcome, ex.health
    name = target.info.name
    sent = None
    if events is not None:
        def sent(r: Response) -> None:
            r.on_data = events.data  # (the answer's parts arrive after this)
            events.sent()
    upstream: Response | None = None
    try:
        async with asyncio.timeout(ex.first_byte_timeout) as ttfb:
            with health.waiting(name, ttfb) if health else contextlib.nullcontext():
                upstream = await ex.client.request(ex.method, target.info.url, ex.path,
                                                   ex.payload, backend_headers(target.info),
                                                   sent=sent)
                if events is not None:
                    target = await events.settle(target)
                outcome.status = upstream.status
                ctype = upstream.headers.get("content-type", "application/json").lower()
                if upstream.status >= 400 or not ctype.startswith("text/event-stream"):
                    return _Head(upstream, target, ctype, await upstream.read(), None, [],
                                 False)
                stream = sse_events(upstream)
                if ex.assemble is None:
                    first = await first_output(stream, outcome, ex.relay, ex.strip_usage)
                    return _Head(upstream, target, ctype, b"", stream, first, False)
                data = answer_bytes(await assembled(stream, outcome, ex.assemble, name),
                                    outcome, ex.relay)
                return _Head(upstream, target, "application/json", data, None, [], True)
    except TimeoutError as e:
        _close(upstream)
        raise UpstreamTimeout(f"backend {name} did not answer in time") from e
    except TransportError as e:
        _close(upstream)
        raise UpstreamError(f"backend {name} unreachable: {type(e).__name__}") from e
    except BaseException:
        _close(upstream)  # cancelled (client left): dropping the connection stops the task
        raise


def _final_body(ex: Exchange, head: _Head) -> tuple[bytes, str]:
    """The body (and its content type) a whole answer is given to the client with."""
    data, ctype, relay = head.data, head.ctype, ex.relay
    if head.assembled:
        return data, ctype  # already read, fed to `outcome` and translated
    if head.upstream.status >= 400:
        translated = relay.error(head.upstream.status, data)
        return (data, ctype) if translated is None else (translated, "application/json")
    if ctype.startswith("application/json") or relay.translates_events:
        # (also a backend that ignored "stream"; a translated answer must be JSON)
        absorbed = absorb_body(data, ex.outcome, relay)
        if absorbed is None:  # a broken (external) backend: retried elsewhere
            raise UpstreamError(f"backend {ex.target.info.name} answered with a body "
                                "that is not JSON")
        return absorbed, "application/json"
    return data, ctype


def _close(upstream: Response | None) -> None:
    if upstream is not None:
        upstream.close()


async def _relay_stream(ex: Exchange, head: _Head) -> web.StreamResponse:
    request, upstream, target, outcome, relay = (
        ex.request, head.upstream, head.target, ex.outcome, ex.relay)
    health = ex.health
    resp = web.StreamResponse(status=upstream.status, headers={
        **target.headers(), "Content-Type": "text/event-stream",
        "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    request[RESPONSE_STARTED] = resp
    try:
        await resp.prepare(request)
        await _relay_events(resp, ex, head)
    except _CLIENT_GONE:
        upstream.close()
        return resp  # the client left; outcome.complete stays False -> abort
    except (TimeoutError, TransportError) as e:
        upstream.close()
        err = (UpstreamTimeout if isinstance(e, TimeoutError) else UpstreamError)(
            f"backend {target.info.name} failed mid-stream: {type(e).__name__}")
        if health is not None:
            health.failed(target.info.name, err.message)
        outcome.complete = False
        try:
            await resp.write(sse_error_event(err, relay.error_format))
        except _CLIENT_GONE:
            return resp
    except Exception:
        # a bug, or an answer we cannot read (an external backend's): the headers are
        # gone, so the stream ends with an error event rather than leaving the client
        # waiting on an open connection
        get_logger().exception("relay_failed", backend=target.info.name)
        upstream.close()
        outcome.complete = False
        try:
            await resp.write(sse_error_event(
                UpstreamError(f"backend {target.info.name}: answer not relayable"),
                relay.error_format))
        except _CLIENT_GONE:
            return resp
    except BaseException:
        upstream.close()  # cancelled: the client went away (handler cancellation)
        raise
    upstream.release()
    outcome.finished_at = time.perf_counter()
    with contextlib.suppress(_CLIENT_GONE):
        await resp.write_eof()
    return resp


async def _relay_events(resp: web.StreamResponse, ex: Exchange, head: _Head) -> None:
    """Write the stream's events to the client as each comes whole; a stream that ends
    before its answer does ends with an error event."""
    outcome, relay, events = ex.outcome, ex.relay, head.stream
    assert events is not None
    for chunk in head.first:
        await resp.write(chunk)
    async for ev in events:
        if outcome.complete:
            continue  # past the end ([DONE] again, stray events): read, not relayed
        for chunk in translate_event(ev, outcome, relay, ex.strip_usage):
            await resp.write(chunk)
    if not outcome.complete and not outcome.errored:
        # ended without its end: the client must not take it for a whole answer
        name = head.target.info.name
        err = UpstreamError(f"backend {name} ended its stream before the answer did")
        if ex.health is not None:
            ex.health.failed(name, err.message)
        await resp.write(sse_error_event(err, relay.error_format))
