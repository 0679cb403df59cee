"""The disk tier's own files, without a llama-server: what a save that loses its race leaves
(a fake backend: the slot's next turn must start during the save, a moment a real server
cannot be made to hit), what a server that dies during a restore costs, what a damaged
index keeps, and the budget's bounds."""

from __future__ import annotations

import asyncio
import base64
import json
import math
from array import array
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from faults import until

from backends.config import KvDiskConfig
from backends.info import BackendInfo
from proxy.forwarding.health import capacity
from proxy.forwarding.slot_files import INDEX
from proxy.forwarding.slot_store import SlotStore
from proxy.routing.router import Router

pytestmark = pytest.mark.timeout(60)

MODEL = "m1"  # a model identity (slot_identity's format does not matter here)


def ids(start: int, n: int) -> bytes:
    return array("i", range(start, start + n)).tobytes()


@asynccontextmanager
async def slots_server(on_slot: Callable[[web.Request, int, str], Awaitable[None]]
                       ) -> AsyncIterator[str]:
    """A real aiohttp server answering `/slots/{id}?action=save|restore` as llama-server
    does (600 tokens), after ``on_slot(request, slot, filename)``."""
    async def slots(request: web.Request) -> web.Response:
        slot = int(request.match_info["id"])
        body = await request.json()
        await on_slot(request, slot, body["filename"])
        n = "n_saved" if request.query["action"] == "save" else "n_restored"
        return web.json_response({"id_slot": slot, "filename": body["filename"], n: 600})

    app = web.Application()
    app.router.add_post("/slots/{id}", slots)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def info_at(url: str) -> BackendInfo:
    return BackendInfo(name="a", url=url, api_key=None, n_slots=2, slot_ctx=8192,
                       ram_cache_bytes=0, kv_bytes_per_token=1024, model="kvroute-demo",
                       managed=True)


def slot_files(path: Path) -> set[str]:
    return {f.name for f in path.glob("kvroute-*.bin")}


async def test_a_save_that_loses_its_race_leaves_no_file(tmp_path: Path) -> None:
    """The slot's next turn starts while the server writes the file: the save is counted
    failed and its file removed. A file the server writes after kvroute gave up on it (a
    save cancelled or timed out) is removed at the next save: nothing escapes the
    budget."""
    disk = KvDiskConfig(tmp_path, save_after_idle_s=0, min_tokens=10)
    router = Router()
    events: list[str] = []

    async def on_save(_: web.Request, slot: int, filename: str) -> None:
        (tmp_path / filename).write_bytes(b"kv" * 2048)
        if slot == 0:  # the next turn arrives and is given this slot
            router.decide(ids(1000, 620))

    async with slots_server(on_save) as url, aiohttp.ClientSession() as session:
        info = info_at(url)
        router.add_backend(capacity(info))
        router.seed("a", 0, ids(1000, 600))
        router.seed("a", 1, ids(5000, 600))
        store = SlotStore(disk, session, router, events.append)
        store.backend_ready("a", MODEL)

        store.note(info, 0)
        await until(lambda: events, 10)
        await asyncio.sleep(0.1)
        assert events == ["save_failed"]
        assert store.saved == {}
        assert slot_files(tmp_path) == set()

        (tmp_path / "kvroute-77.bin").write_bytes(b"late")  # a save given up, written late
        store.note(info, 1)
        await until(lambda: "saved" in events, 10)
        (kept,) = store.saved.values()
        assert slot_files(tmp_path) == {kept.file}


async def test_a_file_the_server_dies_on_twice_is_dropped(tmp_path: Path) -> None:
    """The server goes away during a restore (its process died): the file is kept, it may
    not be the file's doing. The same again on that file: the file is taken to bring the
    server down, and dropped; else every restart of the backend would die on it."""
    (tmp_path / INDEX).write_text(json.dumps([entry(1, size=4096)]))
    (tmp_path / "kvroute-1.bin").write_bytes(b"kv" * 2048)
    events: list[str] = []

    async def dies(request: web.Request, _slot: int, _filename: str) -> None:
        assert request.transport is not None
        request.transport.close()

    async with slots_server(dies) as url, aiohttp.ClientSession() as session:
        store = SlotStore(KvDiskConfig(tmp_path), session, Router(), events.append)
        store.backend_ready("a", MODEL)
        assert await store.restore(info_at(url)) == []
        assert events == ["restore_interrupted"] and slot_files(tmp_path) == {"kvroute-1.bin"}
        assert await store.restore(info_at(url)) == []
        assert events[1:] == ["restore_failed"] and slot_files(tmp_path) == set()


def entry(i: int, **over: Any) -> dict[str, Any]:
    return {"id": i, "backend": "a", "slot": i % 2, "saved_at": float(i), "model": MODEL,
            "size": 2, "tokens": base64.b64encode(ids(100 * i, 50)).decode(), **over}


async def test_a_malformed_index_entry_costs_only_its_own_file(tmp_path: Path) -> None:
    """One entry that does not parse, and one of an index without models (what computed
    its KV is unknown): those two are dropped, the entries after them stand."""
    index = [entry(1), entry(2, slot="zero"), entry(3), entry(4), entry(5)]
    del index[3]["model"]
    (tmp_path / INDEX).write_text(json.dumps(index))
    for i in range(1, 6):
        (tmp_path / f"kvroute-{i}.bin").write_bytes(b"kv")
    async with aiohttp.ClientSession() as session:
        store = SlotStore(KvDiskConfig(tmp_path), session, Router(), lambda _: None)
    assert sorted(store.saved) == [1, 3, 5]
    assert slot_files(tmp_path) == {"kvroute-1.bin", "kvroute-3.bin", "kvroute-5.bin"}


@pytest.mark.parametrize("field,value", [
    ("max_gib", 0.0), ("max_gib", -1.0), ("max_gib", math.nan),
    ("save_after_idle_s", -0.5), ("min_tokens", -1)])
def test_a_disk_budget_out_of_range_is_refused(tmp_path: Path, field: str,
                                               value: float) -> None:
    with pytest.raises(ValueError, match=f"kv_disk.{field}"):
        KvDiskConfig(tmp_path, **{field: value})  # type: ignore[arg-type]
