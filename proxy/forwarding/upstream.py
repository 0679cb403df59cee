"""HTTP/1.1 to the backends, for the request path: pooled keep-alive connections, answers
parsed by llhttp (httptools) and read whole or as they arrive.

Why not aiohttp's client (which still serves the health prober and the CLI): the proxy's
whole budget for a small request is 1 ms, and `ClientSession.request` spends 2-3x the
CPU of this on one (URL objects, tracing hooks, timers, payload registry, a response
object tree; `bench/bench_upstream.py` measures both in one run). What the proxy
needs of a client is little: one request at a time per connection, a body whose length
is known, answers with a Content-Length or chunked (llama-server's streams), a connect
timeout and a timeout between reads.

    upstream = Upstream(connect_timeout=5, read_timeout=600)
    resp = await upstream.request("POST", "http://127.0.0.1:8081", "/completion",
                                  body, {"Content-Type": "application/json"})
    resp.status, resp.headers["content-type"]     # head arrived (header names lowercase)
    data = await resp.read()                      # or: async for chunk in resp.chunks()
    resp.release()                                # connection back to the pool
    resp.close()                                  # or dropped (stops llama-server's task)

It fails with transport.py's errors (ConnectFailed: nothing was sent; ConnectionDropped:
the answer broke off), or TimeoutError: no connection within `connect_timeout`, or no byte
of the answer for `read_timeout` s.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

import httptools

from proxy.forwarding.transport import ConnectFailed, ConnectionDropped

# Answer bytes buffered (not yet taken by the reader) before reading from the backend
# pauses: a client slower than the backend must not make the proxy hold the whole stream.
_HIGH_WATER = 1 << 20
# An answer's status line and headers larger than this end the connection (llama-server's
# are < 1 KiB; an external backend gone wrong must not grow them without bound).
_MAX_HEAD = 64 << 10


@dataclass(frozen=True)
class _Origin:
    """Where a base URL's connections go, and what its requests' heads start with."""

    host: str
    port: int
    tls: bool
    path: str         # a base URL's own path ("" for http://host:port)
    host_header: str


class Response:
    """One backend answer: `status` and `headers` once its head arrived, then its body."""

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self.status = 0
        self.headers: dict[str, str] = {}   # names lowercase; a repeated one: the last
        self._chunks: list[bytes] = []      # body bytes arrived and not yet taken
        self._buffered = 0
        self._head = False                  # status and headers are in
        self._done = False                  # the whole body is in
        self._keep_alive = False
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        # called as each part of the answer arrives (before it is read: the time it came)
        self.on_data: Callable[[], None] | None = None

    async def read(self) -> bytes:
        """The whole body (taken as it arrives: reading pauses past `_HIGH_WATER` until
        the buffered part is taken)."""
        return b"".join([chunk async for chunk in self.chunks()])

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives (chunked encoding already undone)."""
        while True:
            if self._chunks:
                data = b"".join(self._chunks)
                self._chunks.clear()
                self._buffered = 0
                self._conn.resume_reading()
                yield data
            elif self._done:
                return
            else:
                await self._wait()

    def release(self) -> None:
        """The connection goes back to the pool if the answer was read to its end and
        the backend keeps it alive; otherwise it is closed."""
        if self._done and self._keep_alive and not self._chunks and not self._conn.closed:
            self._conn.idle()
        else:
            self._conn.close()

    def close(self) -> None:
        """Drop the connection (llama-server then cancels the request's task)."""
        self._conn.close()

    def cut(self, reason: str) -> None:
        """End this answer now: its reader gets ConnectionDropped(reason) (the backend
        was found stuck), and the connection is dropped."""
        self._fail(ConnectionDropped(reason))
        self._conn.close()

    async def _wait(self) -> None:
        if self._exc is not None:
            raise self._exc
        conn = self._conn
        waiter = self._waiter = conn.loop.create_future()
        timer = (conn.loop.call_later(conn.read_timeout, _expire, waiter)
                 if conn.read_timeout is not None else None)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if self._exc is None and not self._done:
            self._exc = exc
            if self._waiter is not None and not self._waiter.done():
                self._waiter.set_exception(exc)


async def _exchange(conn: _Connection, head: bytes, body: bytes,
                    sent: Callable[[Response], None] | None) -> Response:
    try:
        return await conn.exchange(head, body, sent)
    except BaseException:
        conn.close()  # timed out, cancelled or dropped: the connection is out of step
        raise


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError("no answer from the backend in time"))


class _Connection(asyncio.Protocol):
    """One keep-alive connection; carries one request at a time."""

    def __init__(self, pool: Upstream, origin: _Origin) -> None:
        self.loop = asyncio.get_running_loop()
        self.pool = pool
        self.origin = origin
        self.read_timeout = pool.read_timeout
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.received = 0           # bytes of the current answer so far
        self.closed = False
        self.idle_since = 0.0
        self._paused = False
        self._interim = False  # parsing a 1xx answer: the real one follows it

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (not an isinstance check: uvloop's transports are not asyncio.Transport classes)
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.response is None or self.response._done:
            self.close()  # bytes no request asked for: the stream is out of step
            return
        r = self.response
        self.received += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            r._fail(ConnectionDropped(f"malformed HTTP answer: {e}"))
            self.close()
            return
        if r.on_data is not None:
            r.on_data()
        if not r._head and self.received > _MAX_HEAD:
            r._fail(ConnectionDropped(f"answer head over {_MAX_HEAD} bytes"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._forget(self)
        r = self.response
        if r is None or r._done:
            return
        if r._head and "content-length" not in r.headers \
                and "chunked" not in r.headers.get("transfer-encoding", "").lower():
            self.on_message_complete()  # a body that ends with the connection
            return
        why = f": {exc}" if exc else ""
        r._fail(ConnectionDropped(f"the backend closed the connection{why}"))

    # -- httptools callbacks
    def on_message_begin(self) -> None:
        if self.response is not None and self.response._head:
            # a second answer behind the first in one read: stops the parser (-> close)
            raise ConnectionDropped("the backend sent an answer nobody asked for")

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.response is not None
        self.response.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        r = self.response
        assert r is not None
        status = self.parser.get_status_code()
        if 100 <= status < 200:
            # 100 Continue, 103 Early Hints: informational, the answer comes after it
            self._interim = True
            r.headers.clear()
            return
        r.status = status
        r._head = True
        r._wake()

    def on_body(self, body: bytes) -> None:
        r = self.response
        assert r is not None
        r._chunks.append(body)
        r._buffered += len(body)
        if r._buffered > _HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        r._wake()

    def on_message_complete(self) -> None:
        r = self.response
        assert r is not None
        if self._interim:
            self._interim = False
            return
        r._keep_alive = self.parser.should_keep_alive()
        r._done = True
        r._wake()

    # -- pool side
    async def exchange(self, head: bytes, body: bytes,
                       sent: Callable[[Response], None] | None = None) -> Response:
        """Send one request (then call `sent`); its Response once the answer's head is in."""
        assert self.transport is not None
        r = self.response = Response(self)
        self.received = 0
        if len(body) < 65536:  # one write, one send(): a syscall less than head + body
            self.transport.write(head + body)
        else:  # a send() more, not a copy of a 200 KB conversation
            self.transport.write(head)
            self.transport.write(body)
        if sent is not None:
            sent(r)
        while not r._head:
            await r._wait()
        return r

    def resume_reading(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def idle(self) -> None:
        self.response = None
        self.resume_reading()
        self.idle_since = time.monotonic()
        self.pool._put(self)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.pool._forget(self)
            if self.transport is not None:
                self.transport.close()


class Upstream:
    """Keep-alive connections to the backends, reused most-recent first.

    Idle connections are dropped after `keepalive_s`: llama-server's HTTP library
    (cpp-httplib) closes them after 5 s, and one it closes just as a request is written on
    it fails that request; such a request (nothing of an answer came back on a reused
    connection) is sent once more on a fresh connection.
    """

    def __init__(self, *, connect_timeout: float | None = 5.0,
                 read_timeout: float | None = None, keepalive_s: float = 4.0) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.keepalive_s = keepalive_s
        self._idle: dict[_Origin, list[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._origins: dict[str, _Origin] = {}
        self._tls: ssl.SSLContext | None = None

    async def request(self, method: str, base_url: str, path: str, body: bytes,
                      headers: Mapping[str, str], *,
                      sent: Callable[[Response], None] | None = None) -> Response:
        """Send `method base_url+path` with `body`; the Response once its head is in.

        `sent(response)` is called right after the request is written, before waiting for the
        answer: work the caller can do while the backend works (once per write: twice
        when a reused connection turns out closed and the request is sent again).

        No HEAD: its answer announces a body it does not carry, which this client would
        wait for (callers send GET and drop the body)."""
        if method == "HEAD":
            raise ValueError("HEAD is not supported: send GET")
        origin = self._origin(base_url)
        head = self._head(method, origin, path, body, headers)
        conn = self._take(origin)
        if conn is not None:
            try:
                return await _exchange(conn, head, body, sent)
            except ConnectionDropped:
                if conn.received:
                    raise
                # closed by the backend as this request came: once more, on a new one
        return await _exchange(await self._connect(origin), head, body, sent)

    async def close(self) -> None:
        for conn in list(self._open):
            conn.close()
        self._idle.clear()

    def _head(self, method: str, origin: _Origin, path: str, body: bytes,
              headers: Mapping[str, str]) -> bytes:
        lines = [f"{method} {origin.path}{path} HTTP/1.1\r\nHost: {origin.host_header}\r\n"]
        for name, value in headers.items():
            if "\r" in value or "\n" in value:  # would split the head (a key from config)
                raise ValueError(f"header {name!r} holds a line break")
            lines.append(f"{name}: {value}\r\n")
        if body or method != "GET":
            lines.append(f"Content-Length: {len(body)}\r\n")
        lines.append("\r\n")
        return "".join(lines).encode("latin-1")

    def _origin(self, base_url: str) -> _Origin:
        o = self._origins.get(base_url)
        if o is None:
            u = urlsplit(base_url)
            tls = u.scheme == "https"
            host = u.hostname or "127.0.0.1"
            port = u.port or (443 if tls else 80)
            o = self._origins[base_url] = _Origin(host, port, tls, u.path.rstrip("/"),
                                                  u.netloc.rsplit("@", 1)[-1])
        return o

    def _take(self, origin: _Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < self.keepalive_s:
                return conn
            conn.close()
        return None

    async def _connect(self, origin: _Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        tls = None
        if origin.tls:
            tls = self._tls = self._tls or ssl.create_default_context()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self, origin), origin.host, origin.port, ssl=tls,
                    server_hostname=origin.host if tls else None)
        except OSError as e:
            raise ConnectFailed(f"{type(e).__name__}: {e}") from e
        self._open.add(conn)
        return conn

    def _put(self, conn: _Connection) -> None:
        self._idle.setdefault(conn.origin, []).append(conn)

    def _forget(self, conn: _Connection) -> None:
        self._open.discard(conn)
        idle = self._idle.get(conn.origin)
        if idle and conn in idle:
            idle.remove(conn)
