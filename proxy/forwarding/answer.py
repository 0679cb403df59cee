"""An upstream answer as the client gets it: its SSE events read whole, each fed to the
`Outcome` (cache feedback) and translated by the `Relay` (another API's shape, or
passed through as it came); a whole body likewise.

proxy/forwarding/send.py sends the request and writes these to the client.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Any

import orjson

from proxy.errors import ErrorFormat, UpstreamError
from proxy.forwarding.assemble import Assembler
from proxy.forwarding.transport import ConnectionDropped
from proxy.forwarding.upstream import Response
from proxy.reporting.outcome import Outcome

JSON = dict[str, Any]


class Relay:
    """How upstream answers reach the client. The default relays them unchanged.

    Subclasses translate: return a new JSON body / a list of SSE event bytes, or None to
    relay the upstream's bytes as they are.
    """

    error_format: ErrorFormat = ErrorFormat.OPENAI
    # True when `event` writes the client's stream in another API's shape: an upstream
    # event it cannot read is then dropped, not relayed raw into that stream
    translates_events: bool = False

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


AS_IS = Relay()  # answers relayed as the backend sent them


# One SSE event from a backend: llama-server's are a few KB (a token, a tool call's
# argument delta, the final timings); a bound keeps a broken backend's endless line from
# growing the proxy's memory without end.
MAX_EVENT_BYTES = 16 << 20


def first_choice(obj: JSON) -> tuple[JSON, JSON]:
    """A chat answer's first choice and its message ({} for either it does not have)."""
    choices = obj.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else {}
    choice = choice if isinstance(choice, dict) else {}
    msg = choice.get("message")
    return choice, msg if isinstance(msg, dict) else {}


def is_usage_only(obj: JSON) -> bool:
    return "usage" in obj and not obj.get("choices")


def absorb_body(data: bytes, outcome: Outcome, relay: Relay) -> bytes | None:
    """The client's bytes for a JSON answer `data`; None if `data` is not JSON."""
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    outcome.absorb(obj, final=True)
    outcome.complete = True
    if isinstance(obj, dict):
        translated = relay.body(obj)
        if translated is not None:
            return orjson.dumps(translated)
    return data


async def assembled(events: AsyncIterator[list[bytes]], outcome: Outcome,
                    assemble: Assembler, name: str) -> JSON:
    """The whole stream, fed to `assemble` and `outcome`: the assembled answer. An error
    event becomes the error answer llama-server would have sent instead (its `code` as
    the status, set in `outcome`)."""
    async for lines in events:
        data = b"".join(ln[5:].strip() for ln in lines if ln.startswith(b"data:"))
        if not data or data == b"[DONE]":
            continue
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            continue
        if not isinstance(obj, dict):
            continue
        if "error" in obj:
            err = obj["error"]
            code = err.get("code") if isinstance(err, dict) else None
            outcome.status = code if isinstance(code, int) and 400 <= code < 600 else 500
            return obj
        outcome.absorb(obj)
        assemble.add(obj)
    body = assemble.body()
    if body is None:
        raise UpstreamError(f"backend {name} ended its stream before the answer did")
    outcome.complete = True
    return body


def answer_bytes(obj: JSON, outcome: Outcome, relay: Relay) -> bytes:
    """The bytes the client gets for an assembled answer (or error) `obj`."""
    raw = orjson.dumps(obj)
    if outcome.status >= 400:
        return relay.error(outcome.status, raw) or raw
    translated = relay.body(obj)
    return raw if translated is None else orjson.dumps(translated)


async def sse_events(upstream: Response) -> AsyncIterator[list[bytes]]:
    """The upstream's SSE events, each as its lines, "\n" kept (a blank line ends an
    event). An event over MAX_EVENT_BYTES is a broken backend (ConnectionDropped)."""
    event: list[bytes] = []
    size = 0  # bytes of `event` and `tail`
    tail = bytearray()  # an unfinished line: grown in place, not rejoined per chunk
    async for chunk in upstream.chunks():
        size += len(chunk)
        if size > MAX_EVENT_BYTES:
            raise ConnectionDropped(f"an event of the stream is over {MAX_EVENT_BYTES} bytes")
        if b"\n" not in chunk:
            tail += chunk
            continue
        if tail:
            tail += chunk
            lines = bytes(tail).split(b"\n")
        else:
            lines = chunk.split(b"\n")
        tail = bytearray(lines.pop())  # the part after the last "\n"
        for line in lines:
            if line.strip():
                event.append(line + b"\n")
            elif event:
                yield event
                event = []
        size = len(tail) + sum(map(len, event))
    if tail.strip():
        event.append(bytes(tail))
    if event:
        yield event


async def first_output(events: AsyncIterator[list[bytes]], outcome: Outcome, relay: Relay,
                       strip_usage: bool) -> list[bytes]:
    """Read events until one gives the client something ([] at the end of the stream)."""
    async for ev in events:
        out = list(translate_event(ev, outcome, relay, strip_usage))
        if out:
            return out
    return []


def translate_event(lines: list[bytes], outcome: Outcome, relay: Relay,
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
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        obj = None
    if not isinstance(obj, dict):
        return () if relay.translates_events else (raw + b"\n",)
    if "error" in obj:
        outcome.complete = False
        outcome.errored = True
    outcome.absorb(obj)
    if obj.get("stop") is True:  # llama-native streams end with stop:true, no [DONE]
        outcome.complete = True
    if strip_usage and is_usage_only(obj):
        return ()
    translated = relay.event(obj)
    return (raw + b"\n",) if translated is None else translated
