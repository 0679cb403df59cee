"""The status page without a browser: its event stream against real backends (snapshots
with the expected keys, each decision as its request ends, no prompt text), the admin
key on every path of the page, and the streams' bounds (how many, a client that stops
reading, the app closing)."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import socket
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient
from conftest import PoolFactory
from proxy_client import proxy

from proxy.config.settings import ProxySettings
from proxy.server.keys import RECENT, STATUS_STREAMS

pytestmark = pytest.mark.timeout(180)

STATIC = Path(__file__).resolve().parents[2] / "proxy" / "server" / "static"
CANARY = "zebra-canary-41d9 what does the fox say"
SNAPSHOT_KEYS = {"policy", "tokenizer", "backends", "admission", "pools", "kv_disk", "series",
                 "time"}
DECISION_KEYS = {"at", "request_id", "endpoint", "backend", "slot", "pinned", "tier", "queued",
                 "status", "stream", "prompt_tokens", "predicted_cached", "reported_cached",
                 "prompt_n", "ttft_ms", "latency_ms", "why", "head_tokens", "matched"}


def chat(text: str, max_tokens: int = 4) -> dict[str, Any]:
    return {"model": "kvroute-demo", "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": text}]}


class Events:
    """The events of one /kvroute/events response, read one at a time (and kept raw)."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self.resp = resp
        self.raw = bytearray()

    async def next(self, timeout: float = 10) -> tuple[str, dict[str, Any]]:
        event = data = None
        while True:
            line = await asyncio.wait_for(self.resp.content.readline(), timeout)
            if not line:
                raise EOFError("the stream ended")
            self.raw += line
            text = line.decode().rstrip("\n")
            if text.startswith("event: "):
                event = text[7:]
            elif text.startswith("data: "):
                data = text[6:]
            elif not text and event is not None and data is not None:
                return event, json.loads(data)

    async def until(self, event: str, pred: Any = lambda _: True, timeout: float = 30
                    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            got, data = await self.next(max(0.1, deadline - time.monotonic()))
            if got == event and pred(data):
                return data


async def test_events_snapshot_then_live_decisions_without_prompt_text(
        backend_pool: PoolFactory) -> None:
    sup = await backend_pool()
    async with proxy(sup) as c, c.get("/kvroute/events") as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = Events(r)
        kind, first = await events.next()
        assert kind == "snapshot"
        assert SNAPSHOT_KEYS | {"decisions"} <= set(first)
        assert {b["name"] for b in first["backends"]} == {"a", "b"}
        slots = [s for p in first["pools"] for b in p["router"]["backends"].values()
                 for s in b["slots"]]
        assert len(slots) == 4 and all({"id", "busy", "tokens", "session"} <= set(s)
                                       for s in slots)
        assert len(first["series"]) == 60
        seen = {d["request_id"] for d in first["decisions"]}

        for i in range(2):
            async with c.post("/v1/chat/completions", json=chat(f"{CANARY} {i}"),
                              headers={"X-Session-Id": "ops-session-1"}) as answer:
                assert answer.status == 200, await answer.text()
            d = await events.until("decision", lambda d: d["request_id"] not in seen)
            seen.add(d["request_id"])
            assert set(d) == DECISION_KEYS
            assert d["endpoint"] == "chat" and d["backend"] in {"a", "b"}
            assert d["status"] == "200" and d["prompt_tokens"] > 0
            assert d["reported_cached"] is not None and d["ttft_ms"] is not None

        # the next snapshots: live (a second apart), with the session in its slot
        t0 = time.monotonic()
        snap = await events.until("snapshot")
        later = await events.until("snapshot")
        assert time.monotonic() - t0 < 4 and later["time"] > snap["time"]
        assert "decisions" not in later
        sessions = [s["session"] for p in later["pools"]
                    for b in p["router"]["backends"].values() for s in b["slots"]]
        assert "ops-session-1" in sessions
        assert sum(b["requests"] for b in later["series"]) >= 2
        # ids, lengths and names only: the prompt's text is nowhere
        assert b"zebra" not in events.raw and b"fox" not in events.raw


async def test_every_page_path_needs_the_admin_key(backend_pool: PoolFactory) -> None:
    sup = await backend_pool()
    key = "status-key-9c2e"
    basic = "Basic " + base64.b64encode(f"operator:{key}".encode()).decode()
    paths = ("/", "/kvroute/", "/kvroute/events", "/kvroute/static/status.js",
             "/kvroute/static/status.css")
    async with proxy(sup, ProxySettings(api_keys=(key,))) as c:
        for path in paths:
            for headers in ({}, {"Authorization": "Bearer wrong"},
                            {"Authorization": "Basic " + base64.b64encode(b"op:no").decode()}):
                async with c.get(path, headers=headers) as r:
                    assert r.status == 401, (path, headers)
                    assert r.headers["WWW-Authenticate"].startswith("Basic ")
            for headers in ({"Authorization": f"Bearer {key}"}, {"x-api-key": key},
                            {"Authorization": basic}):
                async with c.get(path, headers=headers) as r:
                    assert r.status == 200, (path, headers)
        async with c.get("/kvroute/static/other.js", headers={"x-api-key": key}) as r:
            assert r.status == 404
        # a browser sends the page's credentials with any request to kvroute, another
        # site's form post included: they open the page, never a backend
        async with c.post("/v1/chat/completions", headers={"Authorization": basic}, json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}) as r:
            assert r.status == 401
    async with proxy(sup, ProxySettings(api_keys=(key,), protect_admin=False)) as c, \
            c.get("/") as r:
        assert r.status == 200


async def test_the_page_is_self_contained(backend_pool: PoolFactory) -> None:
    sup = await backend_pool()
    async with proxy(sup) as c:
        async with c.get("/") as r:
            assert r.status == 200 and r.content_type == "text/html"
            html = await r.text()
            assert "default-src 'none'" in r.headers["Content-Security-Policy"]
        assert set(re.findall(r'(?:src|href)="([^"]+)"', html)) == {
            "/kvroute/static/status.js", "/kvroute/static/status.css"}
        async with c.get("/kvroute/") as r2:
            assert await r2.text() == html
    for f in STATIC.iterdir():
        text = f.read_text()
        assert not re.search(r"https?://|//[a-z0-9.-]+\.[a-z]{2,}/", text), f
    js = (STATIC / "status.js").read_text()
    # data reaches the page as text only
    assert not re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|eval\(", js)


async def test_streams_are_bounded_and_end_with_the_app(backend_pool: PoolFactory) -> None:
    sup = await backend_pool()
    c_cm = proxy(sup)
    c = await c_cm.__aenter__()
    closed = False
    try:
        streams = c.app[STATUS_STREAMS]
        streams.max_streams, streams.write_timeout_s = 2, 1.0
        a = await c.get("/kvroute/events")
        b = await c.get("/kvroute/events")
        assert (a.status, b.status) == (200, 200)
        await Events(a).next()
        async with c.get("/kvroute/events") as third:
            assert third.status == 429 and "Retry-After" in third.headers
        b.close()  # the client leaves: its place frees
        await _until(lambda: streams.count == 1)

        # a client that stops reading: its stream ends, its memory stays bounded
        stalled = await _stalled_client(c)
        await _until(lambda: streams.count == 2)
        server = c.server.runner.server
        assert server is not None
        with_stalled = len(server.connections)
        recent = c.app[RECENT]
        big = {"request_id": 0, "backend": "a", "why": "x" * 4000}
        deadline = time.monotonic() + 60
        while streams.count == 2 and time.monotonic() < deadline:
            for _ in range(100):
                recent.add(big)
            assert all(len(s.pending) <= 256 for s in streams._open)
            await asyncio.sleep(0.01)
        assert streams.count == 1, "the stalled stream did not end"
        await _until(lambda: len(server.connections) < with_stalled)  # cut, not left waiting
        await _cut(stalled)

        # the app closes: the open stream ends now (not at the shutdown timeout)
        events = Events(a)
        t0 = time.monotonic()
        await c_cm.__aexit__(None, None, None)
        closed = True
        assert time.monotonic() - t0 < 5
        with pytest.raises((EOFError, aiohttp.ClientError)):
            while True:
                await events.next(timeout=5)
    finally:
        if not closed:
            await c_cm.__aexit__(None, None, None)


async def _stalled_client(c: TestClient[Any, Any]) -> socket.socket:
    """A client that asks for the stream and never reads a byte of it."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (c.host, c.port))
    await asyncio.get_running_loop().sock_sendall(
        sock, b"GET /kvroute/events HTTP/1.1\r\nHost: x\r\n\r\n")
    return sock


async def _cut(sock: socket.socket) -> None:
    """``sock``'s connection ends (reset, or closed after what was sent)."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(20):
            while await loop.sock_recv(sock, 1 << 20):
                pass
    except ConnectionResetError:
        pass
    finally:
        sock.close()


async def _until(cond: Any, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)
