"""The proxy's own answers: bad input, size limit, auth, no backend, unknown paths.

All in the OpenAI error format, never a traceback. No llama-server is needed: the
Supervisor is never started, so no backend is ready (the tokenizer still loads the demo
model's vocabulary, as `serve` does).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient
from proxy_client import ProxyServer

from backends.supervisor import Supervisor
from proxy.app import create_app
from proxy.config.load import Config
from proxy.config.settings import ProxySettings


@pytest_asyncio.fixture(loop_scope="session")
async def client(pool_config: Callable[..., Config]) -> AsyncIterator[TestClient[Any, Any]]:
    cfg = pool_config(n=1)
    settings = ProxySettings(api_keys=("k-one", "k-two"), max_body_bytes=4096)
    server = ProxyServer(create_app(cfg, Supervisor(cfg), settings))
    async with TestClient(server) as c:
        yield c


AUTH = {"Authorization": "Bearer k-two"}


def assert_openai_error(data: Any, type_: str) -> None:
    assert set(data) == {"error"}
    assert set(data["error"]) == {"message", "type", "code"}
    assert data["error"]["type"] == type_ and data["error"]["message"]


async def test_health_is_open_and_503_without_backends(client: TestClient[Any, Any]) -> None:
    async with client.get("/health") as r:
        assert r.status == 503
        assert (await r.json())["status"] == "unavailable"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer nope"},
                                     {"x-api-key": "k-on"}, {"Authorization": "k-one"}])
async def test_wrong_or_missing_key_is_401(client: TestClient[Any, Any],
                                           headers: dict[str, str]) -> None:
    for path in ("/v1/models", "/metrics", "/kvroute/status"):
        async with client.get(path, headers=headers) as r:
            assert r.status == 401
            assert_openai_error(await r.json(), "authentication_error")


async def test_both_key_headers_accepted(client: TestClient[Any, Any]) -> None:
    for headers in (AUTH, {"x-api-key": "k-one"}):
        async with client.get("/v1/models", headers=headers) as r:
            assert r.status == 200


@pytest.mark.parametrize(("body", "needle"), [
    (b"{not json", "not valid JSON"),
    (b"", "empty"),
    (b"[1, 2]", "JSON object"),
    (b'{"messages": "hi"}', "messages"),
    (b'{"messages": [], "stream": "yes"}', "stream"),
    (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', "UTF-8"),
])
async def test_bad_chat_bodies_are_400(client: TestClient[Any, Any], body: bytes,
                                       needle: str) -> None:
    async with client.post("/v1/chat/completions", data=body,
                           headers={**AUTH, "Content-Type": "application/json"}) as r:
        data = await r.json()
        assert r.status == 400, data
        assert_openai_error(data, "invalid_request_error")
        assert needle in data["error"]["message"]


async def test_bad_prompt_is_400(client: TestClient[Any, Any]) -> None:
    async with client.post("/completion", json={"prompt": [{"x": 1}]}, headers=AUTH) as r:
        assert r.status == 400
        assert_openai_error(await r.json(), "invalid_request_error")


async def test_body_over_limit_is_413(client: TestClient[Any, Any]) -> None:
    big = {"messages": [{"role": "user", "content": "x" * 10_000}]}
    async with client.post("/v1/chat/completions", json=big, headers=AUTH) as r:
        assert r.status == 413
        assert_openai_error(await r.json(), "invalid_request_error")


async def test_no_backend_is_503_with_retry_after(client: TestClient[Any, Any]) -> None:
    body = {"messages": [{"role": "user", "content": "hello"}]}
    async with client.post("/v1/chat/completions", json=body, headers=AUTH) as r:
        assert r.status == 503
        assert r.headers["Retry-After"] == "1"
        assert_openai_error(await r.json(), "server_error")


async def test_unknown_path_and_method_in_api_format(client: TestClient[Any, Any]) -> None:
    # (an unknown path that merely starts like Anthropic's is not Anthropic's)
    for path in ("/v1/nothing", "/v1/messagesXYZ"):
        async with client.get(path, headers=AUTH) as r:
            assert r.status == 404
            assert_openai_error(await r.json(), "not_found_error")
    async with client.get("/v1/chat/completions", headers=AUTH) as r:
        assert r.status == 405
        assert_openai_error(await r.json(), "invalid_request_error")


async def test_status_without_backends(client: TestClient[Any, Any]) -> None:
    async with client.get("/kvroute/status", headers=AUTH) as r:
        data = await r.json()
    assert data["policy"] == "prefix" and data["tokenizer"] == "local"
    assert [b["healthy"] for b in data["backends"]] == [False]


async def test_failure_after_the_answer_began_ends_it(
        pool_config: Callable[..., Config]) -> None:
    """A handler failing after its response began must not write a second response
    into the connection (it did: a 500 JSON inside the event stream, the chunked
    framing broken): a stream ends with an error event in the API's format."""
    from aiohttp import web

    from proxy.errors import RESPONSE_STARTED

    async def stream_then_fail(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        request[RESPONSE_STARTED] = resp
        await resp.prepare(request)
        await resp.write(b"data: {}\n\n")
        raise RuntimeError("a bug after the first event")

    async def answer_then_fail(request: web.Request) -> web.StreamResponse:
        resp = web.Response(body=b'{"ok": true}', content_type="application/json")
        request[RESPONSE_STARTED] = resp
        await resp.prepare(request)
        await resp.write_eof()
        raise RuntimeError("a bug in the work after the answer")

    cfg = pool_config(n=1)
    app = create_app(cfg, Supervisor(cfg), ProxySettings())
    app.router.add_post("/v1/messages/test-stream", stream_then_fail)
    app.router.add_post("/v1/chat/test-answer", answer_then_fail)
    async with TestClient(ProxyServer(app)) as c:
        r = await c.post("/v1/messages/test-stream", json={})
        assert r.status == 200
        body = await r.read()  # a broken chunked framing would raise here
        assert body.startswith(b"data: {}\n\n")
        event = body[len(b"data: {}\n\n"):]
        assert event.startswith(b"event: error\ndata: ")
        assert b'"type": "error"' in event and b"HTTP/1.1" not in body
        r = await c.post("/v1/chat/test-answer", json={})
        assert r.status == 200 and await r.json() == {"ok": True}
        assert (await c.get("/health")).status in (200, 503)  # still serving
