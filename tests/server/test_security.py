"""Security: client keys, protected admin endpoints, what reaches a backend (no client
credentials, no client-chosen address, no hop-by-hop headers), and what reaches the logs.

What a backend receives can only be seen from the backend's side, so a recording fake
backend (a real aiohttp server) stands in for llama-server here; one test checks the
same against a real backend that enforces its own key.
"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import structlog
from aiohttp.test_utils import TestClient
from fake_backend import FakeBackend
from proxy_client import ProxyServer

from backends.binary import cache_dir
from backends.config import ExternalBackendConfig, SupervisionConfig
from backends.supervisor import Supervisor
from proxy.app import create_app
from proxy.config.load import Config, ProxyConfig, RoutingConfig
from proxy.config.settings import ProxySettings
from proxy.observability.logging import configure_logging

pytestmark = pytest.mark.timeout(120)

CLIENT_KEY = "client-key-7f3a9"
BACKEND_KEY = "backend-key-c41d2"
HELLO = {"model": "kvroute-demo", "max_tokens": 1,
         "messages": [{"role": "user", "content": "hello"}]}


@asynccontextmanager
async def stack(tmp_path: Path, demo_model: Path, **settings: Any
                ) -> AsyncIterator[tuple[TestClient[Any, Any], FakeBackend, FakeBackend]]:
    """Proxy -> fake backend (key BACKEND_KEY); plus a canary no request may ever reach."""
    fake, canary = FakeBackend(api_key=BACKEND_KEY), FakeBackend()
    await fake.start()
    await canary.start()
    cfg = Config(proxy=ProxyConfig(port=1), routing=RoutingConfig(),
                 backends=(ExternalBackendConfig(name="f", url=fake.url, api_key=BACKEND_KEY),),
                 llama_server=None, cache_dir=cache_dir(), log_dir=tmp_path,
                 supervision=SupervisionConfig(health_interval_s=30))
    sup = Supervisor(cfg)
    await sup.start()
    app = create_app(cfg, sup, ProxySettings(tokenizer=demo_model, **settings))
    try:
        async with TestClient(ProxyServer(app, handler_cancellation=True)) as client:
            yield client, fake, canary
    finally:
        await sup.stop()
        await fake.stop()
        await canary.stop()


async def raw(client: TestClient[Any, Any], request: bytes) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection(client.host, client.port)
    try:
        writer.write(request)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


# ------------------------------------------------------------------------ client keys
async def test_keys_both_headers_admin_protection_and_odd_bytes(tmp_path: Path,
                                                                demo_model: Path) -> None:
    async with stack(tmp_path, demo_model, api_keys=(CLIENT_KEY, "other")) as (c, _, _):
        for h in ({"Authorization": f"Bearer {CLIENT_KEY}"}, {"x-api-key": CLIENT_KEY}):
            async with c.post("/v1/chat/completions", json=HELLO, headers=h) as r:
                assert r.status == 200
        for path in ("/metrics", "/kvroute/status", "/v1/models", "/props"):
            async with c.get(path) as r:
                assert r.status == 401, path
        async with c.get("/health") as r:
            assert r.status == 200
        # a prefix, a longer string, an empty key, and bytes that are not UTF-8
        for key in (CLIENT_KEY[:-1], CLIENT_KEY + "x", "", "\u00e9t\u00e9"):
            async with c.get("/v1/models", headers={"x-api-key": key}) as r:
                assert r.status == 401
        status, body = await raw(c, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n"
                                    b"x-api-key: \xff\xfe\r\nConnection: close\r\n\r\n")
        assert status == 401 and json.loads(body)["error"]["type"] == "authentication_error"
    async with stack(tmp_path, demo_model, api_keys=(CLIENT_KEY,),
                     protect_admin=False) as (c, _, _):
        for path in ("/metrics", "/kvroute/status"):
            async with c.get(path) as r:
                assert r.status == 200, path
        async with c.get("/v1/models") as r:
            assert r.status == 401


# ------------------------------------------------------------- what reaches a backend
HOSTILE = {
    "Authorization": f"Bearer {CLIENT_KEY}", "x-api-key": CLIENT_KEY,
    "Proxy-Authorization": "Basic abc", "Cookie": "session=1",
    "X-Forwarded-For": "10.0.0.1", "X-Forwarded-Host": "evil.example",
    "Forwarded": "host=evil.example", "X-Real-IP": "10.0.0.1",
    "Upgrade": "websocket", "Connection": "Upgrade, Keep-Alive", "TE": "trailers",
    "X-Kvroute-Backend": "other", "X-Backend-Url": "http://evil.example",
}
FORBIDDEN = {k.lower() for k in HOSTILE} - {"authorization", "connection"}


async def test_backend_gets_only_its_own_key_and_no_client_headers(tmp_path: Path,
                                                                   demo_model: Path) -> None:
    async with stack(tmp_path, demo_model, api_keys=(CLIENT_KEY,)) as (c, fake, canary):
        async with c.post("/v1/chat/completions?url=http://evil.example", json=HELLO,
                          headers=HOSTILE) as r:
            assert r.status == 200 and r.headers["X-Kvroute-Backend"] == "f"
        async with c.post("/tokenize", json={"content": "hi"}, headers=HOSTILE) as r:
            assert r.status == 200
        assert [p for p, _, _ in fake.requests] == ["/v1/chat/completions", "/tokenize"]
        for _, headers, _ in fake.requests:
            seen = {k.lower(): v for k, v in headers.items()}
            assert seen["authorization"] == f"Bearer {BACKEND_KEY}"
            assert seen["host"] == fake.url.removeprefix("http://")
            assert not FORBIDDEN & seen.keys(), FORBIDDEN & seen.keys()
            assert CLIENT_KEY not in json.dumps(seen)
            assert "upgrade" not in seen.get("connection", "").lower()
        assert canary.hits == 0


async def test_no_request_chooses_the_backend_address(tmp_path: Path,
                                                      demo_model: Path) -> None:
    async with stack(tmp_path, demo_model) as (c, fake, canary):
        target = canary.url.removeprefix("http://").encode()
        body = json.dumps(HELLO).encode()
        # absolute-form request target and Host both naming the canary
        status, _ = await raw(c, b"POST " + canary.url.encode() + b"/v1/chat/completions "
                              b"HTTP/1.1\r\nHost: " + target + b"\r\nContent-Type: "
                              b"application/json\r\nContent-Length: "
                              + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n"
                              + body)
        assert status == 200
        for path in (b"//" + target + b"/tokenize", b"/../" + target + b"/props",
                     b"/v1/chat/completions/../../tokenize"):
            status, _ = await raw(c, b"GET " + path + b" HTTP/1.1\r\nHost: " + target
                                  + b"\r\nConnection: close\r\n\r\n")
            assert status in (400, 404, 405), path
        assert canary.hits == 0
        assert all(p == "/v1/chat/completions" for p, _, _ in fake.requests)


async def test_real_backend_accepts_the_proxy_key_not_the_clients(backend_pool: Any) -> None:
    sup = await backend_pool()
    settings = ProxySettings(api_keys=(CLIENT_KEY,))
    app = create_app(sup.config, sup, settings)
    async with TestClient(ProxyServer(app, handler_cancellation=True)) as c:
        h = {"Authorization": f"Bearer {CLIENT_KEY}"}
        async with c.post("/v1/chat/completions", json=HELLO, headers=h) as r:
            assert r.status == 200  # llama-server checked *its* key, which the proxy sent
        info = sup.ready()[0]
        async with c.session.post(info.url + "/v1/chat/completions", json=HELLO,
                                  headers=h) as r:
            assert r.status == 401  # the client's key opens nothing behind the proxy


# ----------------------------------------------------------------------------- logs
@pytest.mark.parametrize("log_prompts", [False, True])
async def test_logs_hold_no_keys_and_no_prompts_unless_asked(tmp_path: Path, demo_model: Path,
                                                             log_prompts: bool) -> None:
    marker = "zebra-quartz-marker"
    out = io.StringIO()
    saved = structlog.get_config()
    configure_logging("debug", stream=out, log_prompts=log_prompts)
    try:
        async with stack(tmp_path, demo_model, api_keys=(CLIENT_KEY,),
                         log_prompts=log_prompts) as (c, _fake, _):
            ok = {"Authorization": f"Bearer {CLIENT_KEY}"}
            body = {**HELLO, "messages": [{"role": "user", "content": f"{marker} " * 20}]}
            async with c.post("/v1/chat/completions", json=body, headers=ok) as r:
                assert r.status == 200
            async with c.post("/v1/chat/completions", json=body,
                              headers={"x-api-key": CLIENT_KEY + "-wrong"}) as r:
                assert r.status == 401
            async with c.post("/v1/chat/completions", data=f'{{"{marker}": ', headers=ok) as r:
                assert r.status == 400
    finally:
        structlog.configure(**saved)
    text = out.getvalue()
    assert '"routed"' in text  # the request was logged at all
    assert CLIENT_KEY not in text and BACKEND_KEY not in text
    assert (marker in text) is log_prompts
