"""proxy/forwarding/upstream.py, the request path's HTTP client, against real servers on
loopback: an aiohttp app for well-formed exchanges, raw asyncio servers for precise faults
(a connection closed at a given byte, a head that never comes, a body ended by EOF)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web

from proxy.forwarding.transport import ConnectFailed, ConnectionDropped
from proxy.forwarding.upstream import Upstream

pytestmark = pytest.mark.timeout(30)


@contextlib.asynccontextmanager
async def app_server() -> AsyncIterator[tuple[str, dict[str, object]]]:
    """An aiohttp server; `seen` records each request's peer port and body."""
    seen: dict[str, object] = {"peers": [], "bodies": [], "headers": []}
    step = asyncio.Event()

    async def echo(request: web.Request) -> web.Response:
        body = await request.read()
        assert request.transport is not None
        seen["peers"].append(request.transport.get_extra_info("peername")[1])  # type: ignore[attr-defined]
        seen["bodies"].append(body)  # type: ignore[attr-defined]
        seen["headers"].append(dict(request.headers))  # type: ignore[attr-defined]
        status = int(request.query.get("status", "200"))
        headers = {"Connection": "close"} if "close" in request.query else None
        return web.Response(status=status, body=b"got:" + body, headers=headers,
                            content_type="application/json")

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: one\n\n")
        await step.wait()  # the second event only once the client has the first
        await resp.write(b"data: two\n\n")
        return resp

    async def big(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        for i in range(64):
            await resp.write(bytes([i]) * 65536)
        return resp

    app = web.Application()
    app.router.add_post("/echo", echo)
    app.router.add_get("/echo", echo)
    app.router.add_get("/stream", stream)
    app.router.add_get("/big", big)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    seen["step"] = step
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", seen
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def raw_server(handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter],
                                      Awaitable[None]]) -> AsyncIterator[str]:
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


async def read_head(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + await reader.readexactly(length)


async def test_body_status_headers_and_keep_alive() -> None:
    up = Upstream()
    async with app_server() as (url, seen):
        for i in range(3):
            r = await up.request("POST", url, "/echo", b'{"n": %d}' % i,
                                 {"Content-Type": "application/json", "X-Key": "k"})
            assert r.status == 200 and r.headers["content-type"] == "application/json"
            assert await r.read() == b'got:{"n": %d}' % i
            r.release()
        assert len(set(seen["peers"])) == 1  # type: ignore[arg-type]  # one connection
        h = seen["headers"][0]  # type: ignore[index]
        assert h["X-Key"] == "k" and h["Host"] == url.removeprefix("http://")
        r = await up.request("POST", url, "/echo?status=404", b"x", {})
        assert r.status == 404 and await r.read() == b"got:x"
        r.release()
        r = await up.request("GET", url, "/echo", b"", {})
        assert r.status == 200 and await r.read() == b"got:"
        r.release()
    await up.close()


async def test_connection_close_and_idle_expiry_are_not_reused() -> None:
    up = Upstream(keepalive_s=0.2)
    async with app_server() as (url, seen):
        for query in ("?close", "", ""):
            r = await up.request("POST", url, "/echo" + query, b"x", {})
            await r.read()
            r.release()
            if not query:
                await asyncio.sleep(0.3)  # past keepalive_s: dropped, not reused
        assert len(set(seen["peers"])) == 3  # type: ignore[arg-type]
    await up.close()


async def test_stream_events_arrive_as_they_are_sent() -> None:
    up = Upstream()
    async with app_server() as (url, seen):
        r = await up.request("GET", url, "/stream", b"", {})
        assert r.headers["transfer-encoding"] == "chunked"
        got: list[bytes] = []
        async for chunk in r.chunks():
            got.append(chunk)
            seen["step"].set()  # type: ignore[attr-defined]
        assert got == [b"data: one\n\n", b"data: two\n\n"]
        r.release()
    await up.close()


async def test_large_answer_read_slowly_is_whole() -> None:
    """4 MiB (over the buffer bound, so reading pauses and resumes) read slowly."""
    up = Upstream()
    async with app_server() as (url, _):
        r = await up.request("GET", url, "/big", b"", {})
        data = bytearray()
        async for chunk in r.chunks():
            data += chunk
            await asyncio.sleep(0.001)
        assert data == b"".join(bytes([i]) * 65536 for i in range(64))
        r.release()
    await up.close()


async def test_large_answer_read_whole_at_once() -> None:
    """`read()` of an answer over the buffer bound (reading pauses) still gets it all."""
    up = Upstream(read_timeout=5)
    async with app_server() as (url, _):
        r = await up.request("GET", url, "/big", b"", {})
        assert await r.read() == b"".join(bytes([i]) * 65536 for i in range(64))
        r.release()
    await up.close()


async def test_refused_connection_is_connect_failed() -> None:
    async with raw_server(lambda r, w: asyncio.sleep(0)) as url:
        pass  # closed: nothing listens on its port any more
    with pytest.raises(ConnectFailed):
        await Upstream().request("POST", url, "/x", b"", {})


async def test_no_answer_is_a_timeout_and_the_connection_is_dropped() -> None:
    closed = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        await reader.read()  # until the client closes
        closed.set()

    up = Upstream(read_timeout=0.2)
    async with raw_server(silent) as url:
        with pytest.raises(TimeoutError):
            await up.request("POST", url, "/x", b"body", {})
        await asyncio.wait_for(closed.wait(), 5)


async def test_connection_cut_mid_body_is_dropped_and_eof_body_is_whole() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part")
        await writer.drain()
        writer.close()

    async def eof_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it")
        await writer.drain()
        writer.close()

    up = Upstream()
    async with raw_server(cut) as url:
        r = await up.request("POST", url, "/x", b"", {})
        with pytest.raises(ConnectionDropped):
            await r.read()
    async with raw_server(eof_body) as url:
        r = await up.request("POST", url, "/x", b"", {})
        assert await r.read() == b"all of it"
        r.release()
    await up.close()


async def test_reused_connection_closed_by_the_server_is_retried_once() -> None:
    """A keep-alive connection the server closes as the next request comes (llama-server
    closes idle ones after 5 s): the request goes again on a new connection. A fresh
    connection that drops is not retried (the backend may have started the work)."""
    conns = 0

    async def one_per_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                           ) -> None:
        nonlocal conns
        conns += 1
        await read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await read_head(reader)  # the second request on this connection: cut
        writer.close()

    up = Upstream()
    async with raw_server(one_per_conn) as url:
        for _ in range(3):
            r = await up.request("POST", url, "/x", b"{}", {})
            assert await r.read() == b"ok"
            r.release()
        assert conns == 3

    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.close()

    async with raw_server(drop) as url:
        with pytest.raises(ConnectionDropped):
            await up.request("POST", url, "/x", b"{}", {})
    await up.close()


async def test_line_break_in_a_header_value_is_refused() -> None:
    with pytest.raises(ValueError, match="line break"):
        await Upstream().request("POST", "http://127.0.0.1:9", "/x", b"",
                                 {"Authorization": "Bearer k\r\nX-Evil: 1"})


async def test_bytes_past_the_answer_spoil_the_connection() -> None:
    """A backend that sends more than the answer (a second one, or stray bytes while
    idle) is out of step: its connection is closed, never reused for the next request."""
    conns = 0

    async def extra(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal conns
        conns += 1
        while True:
            try:
                await read_head(reader)
            except asyncio.IncompleteReadError:
                return
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
                         b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nbad")
            await writer.drain()

    up = Upstream()
    async with raw_server(extra) as url:
        for _ in range(2):
            r = await up.request("POST", url, "/x", b"{}", {})
            assert r.status == 200 and await r.read() == b"ok"
            r.release()
        assert conns == 2
    await up.close()


async def test_informational_answers_before_the_answer_are_skipped() -> None:
    """1xx answers (100 Continue, 103 Early Hints) precede the real one: taken for it,
    the request got a header-only "answer" and the real one spoiled the connection."""
    async def hints(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                await read_head(reader)
            except asyncio.IncompleteReadError:
                return
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\n"
                         b"Link: </x>\r\n\r\n")
            await writer.drain()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
                         b"Content-Length: 2\r\n\r\nok")
            await writer.drain()

    up = Upstream()
    async with raw_server(hints) as url:
        for _ in range(2):  # and the connection is reused
            r = await up.request("POST", url, "/x", b"{}", {})
            assert r.status == 200 and "link" not in r.headers
            assert await r.read() == b"ok"
            r.release()
    await up.close()


async def test_endless_answer_head_is_cut() -> None:
    async def headers_forever(reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                              ) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n")
        with contextlib.suppress(ConnectionError):
            for i in range(10_000):
                writer.write(b"X-Filler-%d: %s\r\n" % (i, b"y" * 100))
                await writer.drain()

    async with raw_server(headers_forever) as url:
        with pytest.raises(ConnectionDropped, match="head over"):
            await Upstream().request("POST", url, "/x", b"", {})


async def test_sse_events_split_anywhere_come_out_whole() -> None:
    """The relay's event splitter (answer.sse_events) over this client: an event cut
    mid-line, CRLF line ends, a two-line event and a last line with no newline all come
    out as the events the backend meant, each as soon as its blank line is in."""
    from proxy.forwarding.answer import sse_events

    pieces = [b"data: {\"a\":", b" 1}\n", b"\ndata: x\r\n\r", b"\nid: 7\ndata: y\n\n",
              b"data: [DONE]"]
    sent = asyncio.Event()

    async def stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        for piece in pieces:
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
            await asyncio.sleep(0.02)  # separate reads on the client's side
        sent.set()
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    up = Upstream()
    async with raw_server(stream) as url:
        r = await up.request("POST", url, "/x", b"{}", {})
        got = []
        async for event in sse_events(r):
            got.append((b"".join(event), sent.is_set()))
        r.release()
    await up.close()
    assert [e for e, _ in got] == [b'data: {"a": 1}\n', b"data: x\r\n",
                                   b"id: 7\ndata: y\n", b"data: [DONE]"]
    assert [late for _, late in got] == [False, False, False, True]  # none held back


async def test_endless_sse_line_is_cut_at_the_event_bound() -> None:
    """A broken backend's line that never ends (or one in \\r line ends only) was
    buffered without bound and rejoined with every chunk (50 MB: 9 s, +260 MB)."""
    from proxy.forwarding.answer import MAX_EVENT_BYTES, sse_events

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n"
                     b"data: ok\n\ndata: ")
        piece = b"x" * (1 << 20)
        with contextlib.suppress(ConnectionError):
            for _ in range(MAX_EVENT_BYTES // len(piece) + 8):
                writer.write(piece)
                await writer.drain()

    up = Upstream()
    async with raw_server(endless) as url:
        r = await up.request("POST", url, "/x", b"{}", {})
        got = []
        with pytest.raises(ConnectionDropped, match="over"):
            async for event in sse_events(r):
                got.append(b"".join(event))
        r.close()
    await up.close()
    assert got == [b"data: ok\n"]  # what came before it was relayed

