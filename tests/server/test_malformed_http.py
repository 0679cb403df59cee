"""Requests that do not parse as HTTP (aiohttp's parser refuses them before any handler
runs): a JSON error in the API's own format, HTTP/1.1, the connection closed, none of the
client's bytes repeated, and the proxy serving the next connection.

The proxy runs in-process on kvroute's runner (`ProxyServer`, as `serve` makes it) in
front of a fake backend; raw sockets send the bytes an HTTP client would refuse to.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web, web_protocol
from aiohttp.test_utils import TestClient
from fake_backend import FakeBackend
from proxy_client import ProxyServer

from backends.binary import cache_dir
from backends.config import ExternalBackendConfig, SupervisionConfig
from backends.supervisor import Supervisor
from proxy.app import create_app
from proxy.config.load import Config, ProxyConfig, RoutingConfig
from proxy.config.settings import ProxySettings
from proxy.server.runner import last_request_target, make_runner, path_of

pytestmark = pytest.mark.timeout(120)

MARK = b"zq7echo"  # in every offending line: the answer must not hold it
OPENAI, ANTHROPIC = b"/v1/chat/completions", b"/v1/messages"
HUGE = b"a" * 256 * 1024  # a request line 32 times aiohttp's limit
CHAT = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def client(tmp_path_factory: pytest.TempPathFactory
                 ) -> AsyncIterator[TestClient[Any, Any]]:
    fake = FakeBackend()
    await fake.start()
    cfg = Config(proxy=ProxyConfig(port=1), routing=RoutingConfig(),
                 backends=(ExternalBackendConfig(name="fake", url=fake.url),),
                 llama_server=None, cache_dir=cache_dir(),
                 log_dir=tmp_path_factory.mktemp("malformed"),
                 supervision=SupervisionConfig(health_interval_s=30))
    sup = Supervisor(cfg)
    await sup.start()
    app = create_app(cfg, sup, ProxySettings())
    async with TestClient(ProxyServer(app)) as c:
        yield c
    await sup.stop()
    await fake.stop()


def post(path: bytes, *lines: bytes, body: bytes = b"{}", target: bytes | None = None,
         method: bytes = b"POST", version: bytes = b"HTTP/1.1") -> bytes:
    """A request with `lines` among its CRLF-ended header lines (each as given, bare LF
    and all)."""
    head = [method + b" " + (target or path) + b" " + version, b"Host: x", *lines]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


CASES: dict[str, tuple[Any, str]] = {
    # (a) a bare LF inside a header, among CRLF lines
    "bare-lf": (lambda p: post(p, b"X-A: " + MARK + b"\nc", b"Content-Length: 2"),
                "invalid_header"),
    # (b) a byte outside ASCII in a header name; a control byte in a value
    "non-ascii-name": (lambda p: post(p, b"X-Sessi\xffon-Id: " + MARK, b"Content-Length: 2"),
                       "invalid_header"),
    "control-byte": (lambda p: post(p, b"X-Session-Id: " + MARK + b"\x01\xff\xfe",
                                    b"Content-Length: 2"), "invalid_header"),
    # (c) both framings: a request smuggling vector
    "cl-and-te": (lambda p: post(p, b"X-A: " + MARK, b"Content-Length: 5",
                                 b"Transfer-Encoding: chunked", body=b"2\r\n{}\r\n0\r\n\r\n"),
                  "conflicting_length"),
    "extra-token": (lambda p: post(p, version=b"HTTP/1.1 " + MARK), "invalid_request_line"),
    "bad-version": (lambda p: post(p, b"X-A: " + MARK, version=b"HTTP/9.9"),
                    "invalid_request_line"),
    "bad-method": (lambda p: post(p, target=p + b"?" + MARK, method=b"P@ST"),
                   "invalid_method"),
    "bad-path-byte": (lambda p: post(p, target=p + b"\xff" + MARK), "invalid_target"),
    "header-too-large": (lambda p: post(p, b"X-Big: " + MARK + b"a" * 9000),
                         "line_too_long"),
    "request-line-too-large": (lambda p: post(p, target=p + b"?" + MARK + b"a" * 9000),
                               "line_too_long"),
    "too-many-headers": (lambda p: post(p, *(b"X-H%d: %s" % (i, MARK) for i in range(200))),
                         "too_many_headers"),
    "chunk-size-not-hex": (lambda p: post(p, b"Transfer-Encoding: chunked",
                                          body=MARK + b"\r\n{}\r\n0\r\n\r\n"),
                           "invalid_chunked_body"),
}


async def exchange(client: TestClient[Any, Any], request: bytes
                   ) -> tuple[str, dict[str, str], bytes, bytes]:
    """Send `request` on a new connection and read until the server closes it:
    (status line, headers, body, every byte received)."""
    reader, writer = await asyncio.open_connection(client.host, client.port)
    try:
        writer.write(request)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines)}
    return status_line, headers, body, raw


async def serves_a_new_connection(client: TestClient[Any, Any]) -> None:
    status_line, _, body, _ = await exchange(
        client, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status_line.startswith("HTTP/1.1 200"), (status_line, body)


def check_error(path: bytes, body: bytes, code: str) -> str:
    """The error in `path`'s API format; its message."""
    data = json.loads(body)
    if path == ANTHROPIC:
        assert data.keys() == {"type", "error"} and data["type"] == "error", data
        assert data["error"].keys() == {"type", "message"}, data
        assert data["error"]["type"] == "invalid_request_error"
    else:
        assert data.keys() == {"error"}, data
        assert data["error"].keys() == {"message", "type", "code"}, data
        assert data["error"]["type"] == "invalid_request_error"
        assert data["error"]["code"] == code
    message: str = data["error"]["message"]
    assert message.startswith("malformed HTTP request: ") and " - fix: " in message
    return message


@pytest.mark.parametrize("path", [OPENAI, ANTHROPIC], ids=["openai", "anthropic"])
@pytest.mark.parametrize("case", list(CASES))
async def test_unparsable_request_gets_a_json_error(client: TestClient[Any, Any], case: str,
                                                    path: bytes,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    build, code = CASES[case]
    caplog.set_level(logging.DEBUG)
    status_line, headers, body, raw = await exchange(client, build(path))
    # the status aiohttp's parser chose (400 for all of these), on an HTTP/1.1 line
    assert status_line.startswith("HTTP/1.1 400 "), raw[:300]
    assert headers["content-type"].startswith("application/json"), raw[:300]
    assert headers["connection"].lower() == "close"
    assert int(headers["content-length"]) == len(body)
    check_error(path, body, code)
    assert MARK not in raw
    assert MARK.decode() not in caplog.text  # nor in any log line (aiohttp's quoted it)
    await serves_a_new_connection(client)


async def test_other_connections_are_served_meanwhile(client: TestClient[Any, Any]) -> None:
    async with client.get("/health") as r:  # a kept-alive connection in the client's pool
        assert r.status == 200
    status_line, _, body, _ = await exchange(client, CASES["bare-lf"][0](ANTHROPIC))
    assert status_line.startswith("HTTP/1.1 400"), body
    async with client.post("/v1/chat/completions", data=CHAT,
                           headers={"Content-Type": "application/json"}) as r:
        assert r.status == 200, await r.text()
        assert (await r.json())["choices"][0]["message"]["content"] == "ok"
    await serves_a_new_connection(client)


async def test_a_malformed_request_after_a_good_one_on_the_same_connection(
        client: TestClient[Any, Any]) -> None:
    # the bad request is judged by its own request line, not by the connection's first
    good = post(ANTHROPIC, b"Content-Type: application/json", b"anthropic-version: 1",
                b"Content-Length: %d" % len(CHAT), body=CHAT)
    reader, writer = await asyncio.open_connection(client.host, client.port)
    try:
        writer.write(good)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200"), head
        length = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n")
                          if ln.lower().startswith(b"content-length:")))
        assert json.loads(await reader.readexactly(length))["type"] == "message"
        writer.write(CASES["bare-lf"][0](OPENAI))
        raw = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    assert raw.startswith(b"HTTP/1.1 400 "), raw[:300]
    check_error(OPENAI, raw.partition(b"\r\n\r\n")[2], "invalid_header")
    assert MARK not in raw


@pytest.mark.parametrize("path", [OPENAI, ANTHROPIC], ids=["openai", "anthropic"])
async def test_a_256_kib_request_line(client: TestClient[Any, Any], path: bytes) -> None:
    status_line, headers, body, raw = await exchange(client, post(path, target=path + b"?"
                                                                   + MARK + HUGE))
    assert status_line.startswith("HTTP/1.1 400 "), raw[:300]
    assert headers["connection"].lower() == "close"
    check_error(path, body, "line_too_long")
    assert MARK not in raw
    await serves_a_new_connection(client)


def good(path: bytes) -> bytes:
    return post(path, b"Content-Type: application/json", b"anthropic-version: 1",
                b"Content-Length: %d" % len(CHAT), body=CHAT)


@pytest.mark.parametrize("bad", [OPENAI, ANTHROPIC], ids=["openai", "anthropic"])
async def test_a_good_and_a_malformed_request_pipelined(client: TestClient[Any, Any],
                                                        bad: bytes) -> None:
    # both in one write: the bad one is answered in its own request line's format
    reader, writer = await asyncio.open_connection(client.host, client.port)
    try:
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n" + CASES["bare-lf"][0](bad))
        raw = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    answers = raw.split(b"HTTP/1.1 ")[1:]
    *goods, error = answers
    # aiohttp's parser refuses the chunk as a whole: the good one may go unanswered
    assert all(a.startswith(b"200 ") for a in goods), raw[:600]
    assert error.startswith(b"400 "), raw[:600]
    check_error(bad, error.partition(b"\r\n\r\n")[2], "invalid_header")
    assert MARK not in raw


async def test_a_kept_alive_connection_keeps_no_target(client: TestClient[Any, Any]) -> None:
    # the target decides only a parse error's format: once its request is parsed whole,
    # the connection holds none of it
    connections = client.server.runner.server.connections
    reader, writer = await asyncio.open_connection(client.host, client.port)
    try:
        for request in (b"GET /health?" + b"a" * 8000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
                        good(ANTHROPIC)):
            writer.write(request)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert head.startswith(b"HTTP/1.1 200"), head
            length = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n")
                              if ln.lower().startswith(b"content-length:")))
            await reader.readexactly(length)
            targets = [c._target for c in client.server.runner.server.connections
                       if c not in connections]
            assert targets == [None]
    finally:
        writer.close()


def test_a_long_target_is_kept_short() -> None:
    for start in (True, False):
        target = last_request_target(b"POST /v1/messages/" + HUGE + b" HTTP/1.1\r\nX: y",
                                     at_message_start=start)
        assert target is not None and len(target) <= 300
        assert (b"/v1/messages/" + HUGE).startswith(target)
    assert last_request_target(b"POST /v1/messages?" + HUGE, at_message_start=True) == \
        (b"/v1/messages?" + HUGE)[:len(target)]
    path = path_of(b"/v1/messages/" + HUGE)
    assert path.startswith("/v1/messages/a") and len(path) <= 300


async def test_an_aiohttp_without_the_internals_answers_in_plain_text(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # a future aiohttp: served by aiohttp's own runner, with one warning, not a crash
    monkeypatch.delattr(web_protocol, "ERROR")
    capsys.readouterr()
    runner = make_runner(web.Application())
    assert type(runner) is web.AppRunner
    warnings = [ln for ln in capsys.readouterr().out.splitlines() if "warning" in ln]
    assert len(warnings) == 1 and "missing=web_protocol.ERROR" in warnings[0], warnings
    monkeypatch.undo()  # aiohttp's own protocol reads it: serve as that aiohttp would
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(CASES["bare-lf"][0](OPENAI))
        raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        writer.close()
    finally:
        await runner.cleanup()
    assert b" 400 " in raw.split(b"\r\n", 1)[0] and b"text/plain" in raw, raw[:300]


async def test_bytes_outside_ascii_in_a_header_value_are_served(
        client: TestClient[Any, Any]) -> None:
    # obs-text (RFC 9110 5.5): aiohttp's parser takes `X-Session-Id: \xff\xfe` as a value,
    # so the request is answered like any other, in JSON
    request = post(OPENAI, b"X-Session-Id: \xff\xfe", b"Content-Type: application/json",
                   b"Content-Length: %d" % len(CHAT), b"Connection: close", body=CHAT)
    status_line, headers, body, _ = await exchange(client, request)
    assert status_line.startswith("HTTP/1.1 200"), body
    assert headers["content-type"].startswith("application/json")
    assert json.loads(body)["choices"][0]["message"]["content"] == "ok"


@pytest.mark.parametrize(("chunk", "start", "target"), [
    (b"POST /v1/messages HTTP/1.1\r\nHost: x\r\n\r\n", True, b"/v1/messages"),
    (b"GET /a HTTP/1.1\r\n\r\nPOST /v1/messages?q HTTP/1.1\r\nX: y", False,
     b"/v1/messages?q"),
    (b"POST http://h:1/v1/messages HTTP/1.1\r\n", False, b"http://h:1/v1/messages"),
    (b"POST /v1/messages?" + b"a" * 100, True, b"/v1/messages?" + b"a" * 100),
    (b"POST /v1/messages?" + b"a" * 100, False, None),  # mid-message: not a request line
    (b'{"content": "GET /v1/messages HTTP/1.1"}', False, None),  # a body that mentions one
    (b"Referer: http://x/v1/messages HTTP/1.1\r\n", False, None),  # a header line
])
def test_request_target_is_found_on_the_wire(chunk: bytes, start: bool,
                                             target: bytes | None) -> None:
    assert last_request_target(chunk, at_message_start=start) == target


@pytest.mark.parametrize(("target", "path"), [
    (b"/v1/messages", "/v1/messages"),
    (b"/v1/messages?beta=true", "/v1/messages"),
    (b"/v1/messages\xff\x01", "/v1/messages"),
    (b"http://h:1/v1/messages/count_tokens", "/v1/messages/count_tokens"),
    (b"http://h:1", "/"),
])
def test_path_of_a_target(target: bytes, path: str) -> None:
    assert path_of(target) == path
