"""Overload: past max_in_flight and max_queue, a 429 with Retry-After in each API's own
format."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from fake_backend import FakeBackend
from faults import chat_body, external, until
from proxy_client import proxy

from proxy.config.settings import ProxySettings
from proxy.server.keys import ADMISSION

pytestmark = pytest.mark.timeout(240)


async def test_overload_is_429_with_retry_after_in_each_api_format(
        demo_model: Path, tmp_path: Path) -> None:
    fake = FakeBackend()
    await fake.start()
    settings = ProxySettings(tokenizer=demo_model, max_in_flight=1, max_queue=1,
                             queue_timeout_s=1.0)
    try:
        async with external(tmp_path, {"f": (fake.url, None)}) as sup, \
                proxy(sup, settings) as client:
            fake.mode = "stall"
            first = asyncio.create_task(client.post("/v1/chat/completions",
                                                    json=chat_body(1)))
            await until(lambda: fake.hits == 1, 5)
            queued = asyncio.create_task(client.post("/v1/chat/completions",
                                                     json=chat_body(2)))
            await until(lambda: _queued(client) == 1, 5)
            async with client.post("/v1/chat/completions", json=chat_body(3)) as r:
                assert r.status == 429 and r.headers["Retry-After"] == "1"
                err = (await r.json())["error"]
                assert err["type"] == "rate_limit_error" and err["code"] == "overloaded"
            body = {"model": "m", "max_tokens": 4,
                    "messages": [{"role": "user", "content": "hi"}]}
            async with client.post("/v1/messages", json=body) as r:
                assert r.status == 429 and "Retry-After" in r.headers
                data = await r.json()
                assert data["type"] == "error"
                assert data["error"]["type"] == "rate_limit_error"
            r2 = await asyncio.wait_for(queued, 5)  # waited past queue_timeout_s
            assert r2.status == 429
            async with client.get("/health") as h:  # reads are never queued
                assert h.status == 200
            fake.release.set()
            r1 = await asyncio.wait_for(first, 5)
            assert r1.status == 200
            async with client.post("/v1/chat/completions", json=chat_body(4)) as r:
                assert r.status == 200
    finally:
        await fake.stop()


def _queued(client: TestClient[Any, Any]) -> int:
    return client.server.app[ADMISSION].queued
