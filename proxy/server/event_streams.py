"""The status page's server-sent event streams: how many may be open, what each has yet
to send, and their end when the app closes.

A stream's memory is bounded whatever its client does: decisions wait in a deque of a
fixed length (the oldest go first: the page has them from its next snapshot's ring on a
reconnect), snapshots are built only when the stream is ready to send one, and a write
the client does not read within ``write_timeout_s`` ends the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable

import orjson
from aiohttp import web

from proxy.errors import Overloaded
from proxy.observability.recent import Entry

Snapshot = Callable[[bool], dict[str, object]]  # (with the ring of decisions) -> JSON


class Stream:
    """One open event stream: the decisions it has yet to send, and its wake-up."""

    def __init__(self, pending: int) -> None:
        self.pending: deque[Entry] = deque(maxlen=pending)
        self.wake = asyncio.Event()

    def push(self, entry: Entry) -> None:
        self.pending.append(entry)
        self.wake.set()


class EventStreams:
    """The app's open status streams: at most ``max_streams`` at once."""

    def __init__(self, max_streams: int = 8, interval_s: float = 1.0,
                 write_timeout_s: float = 10.0, pending: int = 256) -> None:
        self.max_streams = max_streams
        self.interval_s = interval_s
        self.write_timeout_s = write_timeout_s
        self._pending = pending
        self._open: set[Stream] = set()
        self.closed = False

    @property
    def count(self) -> int:
        return len(self._open)

    def join(self) -> Stream:
        """A new stream; 429 past the limit (or once the app closes)."""
        if self.closed or len(self._open) >= self.max_streams:
            raise Overloaded(f"status streams are limited to {self.max_streams} at once",
                             retry_after=5)
        stream = Stream(self._pending)
        self._open.add(stream)
        return stream

    def leave(self, stream: Stream) -> None:
        self._open.discard(stream)

    def close(self) -> None:
        """The app is closing: every stream ends now, not at the server's shutdown timeout."""
        self.closed = True
        for stream in self._open:
            stream.wake.set()

    async def pump(self, request: web.Request, resp: web.StreamResponse, stream: Stream,
                   snapshot: Snapshot) -> None:
        """Write a snapshot every ``interval_s`` and each decision as it comes, until the
        app closes, the client leaves or stops reading (then its connection is cut: the
        stream's end would wait for that client too)."""
        loop = asyncio.get_running_loop()
        due, first = loop.time(), True
        while not self.closed:
            if loop.time() >= due:
                if not await self._send(request, resp, b"snapshot", snapshot(first)):
                    return
                due, first = loop.time() + self.interval_s, False
            while stream.pending:
                if not await self._send(request, resp, b"decision", stream.pending.popleft()):
                    return
            stream.wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, due - loop.time())):
                    await stream.wake.wait()

    async def _send(self, request: web.Request, resp: web.StreamResponse, event: bytes,
                    data: object) -> bool:
        """One event; False when the client is gone or has not read it in time."""
        body = orjson.dumps(data, default=str, option=orjson.OPT_NON_STR_KEYS)
        try:
            async with asyncio.timeout(self.write_timeout_s):
                await resp.write(b"event: " + event + b"\ndata: " + body + b"\n\n")
        except TimeoutError:
            if request.transport is not None:
                request.transport.abort()
            return False
        except (ConnectionError, RuntimeError):
            return False  # (RuntimeError: aiohttp's write on a closed transport)
        return True
