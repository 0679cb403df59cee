"""The model each backend of a directory runs (proxy/disk/identity.py `Identities`), over
a fake external server that reports its model as llama-server does (`/props`,
`/v1/models`, `/lora-adapters`): what an ask learns, when a server is asked again, and
one ask at a time. Real servers restarted with another model: test_slot_shared.py,
test_slot_model_asked.py, test_slot_identity_asked.py."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from structlog.testing import capture_logs

from backends.info import BackendInfo
from proxy.disk.identity import Identities

pytestmark = pytest.mark.timeout(30)


@dataclass
class Reports:
    """What the fake server says of itself; ``asked``: its requests by path."""

    path: str = "/models/a.gguf"
    props_status: int = 200
    adapters_status: int = 200
    adapters_delay_s: float = 0.0
    asked: Counter[str] = field(default_factory=Counter)


@asynccontextmanager
async def reporting(reports: Reports) -> AsyncIterator[str]:
    async def props(_: web.Request) -> web.Response:
        reports.asked["/props"] += 1
        return web.json_response({
            "total_slots": 1, "model_path": reports.path, "model_ftype": "Q8_0",
            "default_generation_settings": {"n_ctx": 8192, "params": {"lora": []}}},
            status=reports.props_status)

    async def models(_: web.Request) -> web.Response:
        reports.asked["/v1/models"] += 1
        return web.json_response({"data": [{"id": "m", "meta": {"n_params": 7,
                                                                "n_ctx": 8192}}]})

    async def adapters(_: web.Request) -> web.Response:
        reports.asked["/lora-adapters"] += 1
        await asyncio.sleep(reports.adapters_delay_s)
        return web.json_response([], status=reports.adapters_status)

    app = web.Application()
    app.router.add_get("/props", props)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/lora-adapters", adapters)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def info_at(url: str, managed: bool = False) -> BackendInfo:
    return BackendInfo(name="x", url=url, api_key=None, n_slots=1, slot_ctx=8192,
                       ram_cache_bytes=0, kv_bytes_per_token=1024, model="m",
                       managed=managed)


@asynccontextmanager
async def identities() -> AsyncIterator[tuple[Identities, list[tuple[Any, ...]]]]:
    """Identities whose ``learnt`` is recorded and learnt, as SlotStore.backend_ready
    learns it."""
    learnt: list[tuple[Any, ...]] = []
    async with aiohttp.ClientSession() as session:
        def heard(name: str, model: str | None, count: bool, fresh: bool) -> None:
            learnt.append((name, model, count, fresh))
            ids.learn(name, model)

        ids = Identities(session, heard)
        try:
            yield ids, learnt
        finally:
            await ids.close()


# What the server says when it is asked again, after it told its model once: whether
# the model asked for is the one it told, another, or unknown; what is learnt (None: no
# new ask); the requests made.
AGAIN = {
    "the same": ({}, "same", None, {"/props": 1, "/v1/models": 1}),
    "another model": ({"path": "/models/b.gguf"}, "other", ("other", False, True),
                      {"/props": 2, "/v1/models": 2, "/lora-adapters": 1}),
    "no answer": ({"props_status": 500}, None, None, {"/props": 1, "/v1/models": 1}),
    "another, its adapters unknown": (
        {"path": "/models/b.gguf", "adapters_status": 404}, None, (None, False, True),
        {"/props": 2, "/v1/models": 2, "/lora-adapters": 1}),
}


@pytest.mark.parametrize("case", list(AGAIN))
async def test_an_external_server_is_asked_again_before_each_use(case: str) -> None:
    change, model, learnt_again, asked = AGAIN[case]
    reports = Reports()
    async with reporting(reports) as url, identities() as (ids, learnt):
        info = info_at(url)
        await ids.ask(info)
        (first,) = learnt
        assert first[0] == "x" and isinstance(first[1], str) and first[2:] == (True, False)
        reports.asked.clear()
        for k, v in change.items():
            setattr(reports, k, v)
        with capture_logs() as logs:
            got = await ids.model_of(info)
        if model == "same":
            assert got == first[1]
        elif model == "other":
            assert got is not None and got != first[1] and ids.models == {"x": got}
        else:
            assert got is None
        assert learnt[1:] == ([] if learnt_again is None else [
            ("x", got, *learnt_again[1:])])
        assert dict(reports.asked) == asked
        changed = [e for e in logs if e["event"] == "slot.model_changed"]
        assert len(changed) == (learnt_again is not None)


async def test_a_server_that_did_not_say_is_asked_again_once_in_retry_s() -> None:
    reports = Reports(adapters_status=404)
    async with reporting(reports) as url, identities() as (ids, learnt):
        info = info_at(url)
        with capture_logs() as logs:
            await ids.ask(info)
        assert learnt == [("x", None, True, False)] and ids.models == {}
        (unknown,) = [e for e in logs if e["event"] == "slot.model_unknown"]
        assert "404" in unknown["reason"] and unknown["fix"]
        reports.asked.clear()
        assert await ids.model_of(info) is None  # (asked a moment ago)
        assert not reports.asked
        reports.adapters_status = 200
        ids.retry_s = 0.0
        model = await ids.model_of(info)
        assert model is not None and ids.models == {"x": model}
        assert learnt[1:] == [("x", model, False, False)]


async def test_one_ask_at_a_time() -> None:
    """Callers that come while an ask is under way wait for that one; one that goes away
    leaves it to finish."""
    reports = Reports(adapters_delay_s=0.3)
    async with reporting(reports) as url, identities() as (ids, learnt):
        info = info_at(url)
        first = asyncio.create_task(ids.ask(info))
        await asyncio.sleep(0.1)
        gone = asyncio.create_task(ids.ask(info))
        await asyncio.sleep(0.05)
        gone.cancel()
        await asyncio.gather(first, ids.ask(info))
        assert reports.asked["/lora-adapters"] == 1 and len(learnt) == 1


async def test_a_managed_backend_is_not_asked() -> None:
    """kvroute started it: what it runs is what kvroute started it with."""
    async with identities() as (ids, learnt):
        info = info_at("http://127.0.0.1:9", managed=True)  # (nothing answers there)
        assert await ids.model_of(info) is None
        ids.learn("x", "m1")
        assert await ids.model_of(info) == "m1"
        ids.learn("x", None)
        assert ids.models == {} and learnt == []
