"""The disk tier's own files, without a llama-server: what a save that loses its race leaves
(a fake backend: the slot's next turn must start during the save, a moment a real server
cannot be made to hit), what a server that dies or errs during a restore costs, what a
file unfit to send costs, what a damaged index keeps, that a stop waits for the index
write under way, and the budget's bounds. The fake backend writes files as llama-server
does (a sequence-state header, then the state), and answers errors in its shape."""

from __future__ import annotations

import asyncio
import base64
import json
import math
import os
import struct
import threading
from array import array
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from faults import until
from structlog.testing import capture_logs

from backends.config import KvDiskConfig
from backends.info import BackendInfo
from proxy.disk.records import INDEX, MAGIC, QUARANTINE
from proxy.disk.store import SlotStore
from proxy.forwarding.health import capacity
from proxy.instance import DISK_FIX, InUse, lock
from proxy.routing.router import Router

pytestmark = pytest.mark.timeout(60)

MODEL = "m1"  # a model identity (proxy/disk/identity.py's format does not matter here)


def ids(start: int, n: int) -> bytes:
    return array("i", range(start, start + n)).tobytes()


def state_file(tokens: bytes, state: int = 4000) -> bytes:
    """A slot file as llama-server writes one: its header, the tokens, the state."""
    return struct.pack("<III", MAGIC, 3, len(tokens) // 4) + tokens + bytes(state)


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
    failed, logged with its reason, and its file removed, logged. The server writing that
    file again after kvroute gave up on it (a save cancelled or timed out runs on in the
    server) has it removed at the next save; a file kvroute did not write is left."""
    disk = KvDiskConfig(tmp_path, save_after_idle_s=0, min_tokens=10)
    router = Router()
    events: list[str] = []

    async def on_save(_: web.Request, slot: int, filename: str) -> None:
        (tmp_path / filename).write_bytes(state_file(ids(0, 600)))
        if slot == 0:  # the next turn arrives and is given this slot
            router.decide(ids(1000, 620))

    async with slots_server(on_save) as url, aiohttp.ClientSession() as session:
        info = info_at(url)
        router.add_backend(capacity(info))
        router.seed("a", 0, ids(1000, 600))
        router.seed("a", 1, ids(5000, 600))
        store = SlotStore(disk, session, router, events.append)
        store.backend_ready("a", MODEL)

        with capture_logs() as logs:
            store.note(info, 0)
            await until(lambda: events, 10)
        assert events == ["save_failed"]
        assert store.saved == {}
        (failed,) = [e for e in logs if e["event"] == "slot.save_failed"]
        assert (failed["log_level"], failed["slot"]) == ("warning", 0)
        assert "next turn" in failed["reason"] and failed["fix"]
        assert store.files.status()["save_failed"] == 1
        assert slot_files(tmp_path) == set()
        given_up = ("slot.file_removed", failed["file"], "written by a save given up")
        assert [(e["event"], e.get("file"), e.get("reason")) for e in logs
                if e["event"] == "slot.file_removed"] == [given_up]
        # the server writes it again, late
        (tmp_path / failed["file"]).write_bytes(state_file(ids(0, 600)))

        (tmp_path / "kvroute-77.bin").write_bytes(b"theirs")  # not a file kvroute wrote
        with capture_logs() as logs:
            store.note(info, 1)
            await until(lambda: "saved" in events, 10)
        (kept,) = store.saved.values()
        assert slot_files(tmp_path) == {kept.file, "kvroute-77.bin"}
        assert store.files.status()["saved"] == 1
        assert [(e["event"], e.get("file"), e.get("reason")) for e in logs
                if e["event"] == "slot.file_removed"] == [given_up]
        await store.close()


@pytest.mark.parametrize("apart", [False, True])
async def test_a_file_the_server_dies_on_twice_is_dropped(tmp_path: Path,
                                                          apart: bool) -> None:
    """The server goes away during a restore (its process died): the file is kept, it may
    not be the file's doing. The same again on that file: the file is taken to bring the
    server down, and dropped; else every restart of the backend would die on it. Not so
    when the two are further apart than `Strikes.window_s` (``apart``: two deaths hours
    apart say nothing of the file)."""
    (tmp_path / INDEX).write_text(json.dumps([entry(1)]))
    (tmp_path / "kvroute-1.bin").write_bytes(state_file(ids(100, 50)))
    events: list[str] = []

    async def dies(request: web.Request, _slot: int, _filename: str) -> None:
        assert request.transport is not None
        request.transport.close()

    async with slots_server(dies) as url, aiohttp.ClientSession() as session:
        store = SlotStore(KvDiskConfig(tmp_path), session, Router(), events.append)
        if apart:
            store.restorer.strikes.window_s = 0.0
        store.backend_ready("a", MODEL)
        assert await store.restore(info_at(url)) == []
        assert events == ["restore_interrupted"] and slot_files(tmp_path) == {"kvroute-1.bin"}
        assert await store.restore(info_at(url)) == []
        if apart:
            assert events[1:] == ["restore_interrupted"] and store.has("a")
            assert slot_files(tmp_path) == {"kvroute-1.bin"}
        else:
            assert events[1:] == ["restore_failed"] and slot_files(tmp_path) == set()
        await store.close()


async def test_a_backend_that_refuses_the_connection_keeps_the_file(tmp_path: Path) -> None:
    """A restore that never reached the server (its port closed: the server is not up)
    says nothing of the file, however often: kept."""
    from backends.process import free_port

    (tmp_path / INDEX).write_text(json.dumps([entry(1)]))
    (tmp_path / "kvroute-1.bin").write_bytes(state_file(ids(100, 50)))
    events: list[str] = []
    async with aiohttp.ClientSession() as session:
        store = SlotStore(KvDiskConfig(tmp_path), session, Router(), events.append)
        store.backend_ready("a", MODEL)
        closed = info_at(f"http://127.0.0.1:{free_port()}")
        for _ in range(3):
            assert await store.restore(closed) == []
        assert events == ["restore_interrupted"] * 3
        assert slot_files(tmp_path) == {"kvroute-1.bin"} and store.has("a")
        await store.close()


@pytest.mark.parametrize("error,message,type_", [
    (web.HTTPServiceUnavailable, "Loading model", "unavailable_error"),
    (web.HTTPInternalServerError, "failed to allocate a buffer", "server_error"),
    (web.HTTPBadRequest, "Invalid slot ID", "invalid_request_error")])
async def test_an_answer_that_is_no_refusal_of_the_file_keeps_it(
        tmp_path: Path, error: type[web.HTTPError], message: str, type_: str) -> None:
    """The server answers a restore with an error that says nothing of the file (in
    llama-server's shape): the file is kept, and the rest of the backend's slots wait
    for its next start."""
    (tmp_path / INDEX).write_text(json.dumps([entry(1), entry(2)]))
    for i in (1, 2):
        (tmp_path / f"kvroute-{i}.bin").write_bytes(state_file(ids(100 * i, 50)))
    events: list[str] = []
    asked: list[str] = []

    async def fails(_: web.Request, _slot: int, filename: str) -> None:
        asked.append(filename)
        raise error(text=json.dumps({"error": {"code": error.status_code, "message": message,
                                               "type": type_}}),
                    content_type="application/json")

    async with slots_server(fails) as url, aiohttp.ClientSession() as session:
        store = SlotStore(KvDiskConfig(tmp_path), session, Router(), events.append)
        store.backend_ready("a", MODEL)
        with capture_logs() as logs:
            assert await store.restore(info_at(url)) == []
        assert events == ["restore_interrupted"] and len(asked) == 1
        assert sorted(store.saved) == [1, 2]
        assert slot_files(tmp_path) == {"kvroute-1.bin", "kvroute-2.bin"}
        (failed,) = [e for e in logs if e["event"] == "slot.restore_failed"]
        assert failed["reason"] == f"server: {message}"
        assert not [e for e in logs if e["event"] == "slot.file_removed"]
        await store.close()


@pytest.mark.parametrize("fault", ["unreadable", "longer"])
async def test_a_file_judged_unfit_to_send_is_not_removed(tmp_path: Path,
                                                          fault: str) -> None:
    """``unreadable``: a file the restore cannot even stat (a symbolic link loop in its
    place; as root nothing else refuses a read), which says nothing of the file: kept,
    entry and all. ``longer``: whole, but longer than the server wrote it (another file
    under its name): put aside, as a start would. Neither is sent."""
    (tmp_path / INDEX).write_text(json.dumps([entry(1)]))
    (tmp_path / "kvroute-1.bin").write_bytes(state_file(ids(100, 50)))
    events: list[str] = []
    asked: list[str] = []

    async def on_restore(_: web.Request, _slot: int, filename: str) -> None:
        asked.append(filename)

    async with slots_server(on_restore) as url, aiohttp.ClientSession() as session:
        store = SlotStore(KvDiskConfig(tmp_path), session, Router(), events.append)
        store.backend_ready("a", MODEL)
        where = tmp_path / "kvroute-1.bin"
        if fault == "unreadable":
            where.unlink()
            where.symlink_to(where.name)
        else:
            where.write_bytes(state_file(ids(100, 50)) + b"more")
        with capture_logs() as logs:
            assert await store.restore(info_at(url)) == []
        assert asked == [] and not [e for e in logs if e["event"] == "slot.file_removed"]
        (failed,) = [e for e in logs if e["event"] == "slot.restore_failed"]
        if fault == "unreadable":
            assert events == ["restore_interrupted"] and store.has("a")
            assert where.is_symlink()
            assert failed["reason"] == "cannot read the file: Too many levels of symbolic links"
        else:
            assert events == ["restore_failed"] and not store.has("a")
            assert slot_files(tmp_path / QUARANTINE) == {where.name}
            assert failed["reason"] == f"{len(state_file(ids(100, 50))) + 4} bytes, the " \
                f"server wrote {len(state_file(ids(100, 50)))}"
        await store.close()


async def test_a_save_no_server_could_restore_is_given_up(tmp_path: Path) -> None:
    """The server says it saved the slot, but the file is shorter than its own header says
    (a disk that filled up during the write): the save fails, as a start would judge the
    file, and the file is removed."""
    disk = KvDiskConfig(tmp_path, save_after_idle_s=0, min_tokens=10)
    events: list[str] = []

    async def on_save(_: web.Request, _slot: int, filename: str) -> None:
        (tmp_path / filename).write_bytes(state_file(ids(0, 600))[:1000])

    async with slots_server(on_save) as url, aiohttp.ClientSession() as session:
        info, router = info_at(url), Router()
        router.add_backend(capacity(info))
        router.seed("a", 0, ids(0, 600))
        store = SlotStore(disk, session, router, events.append)
        store.backend_ready("a", MODEL)
        with capture_logs() as logs:
            store.note(info, 0)
            await until(lambda: events, 10)
        assert events == ["save_failed"] and store.saved == {}
        assert slot_files(tmp_path) == set()
        (failed,) = [e for e in logs if e["event"] == "slot.save_failed"]
        assert failed["reason"] == ("the file cannot be restored: truncated: 1000 bytes, its "
                                    "header says 600 tokens")
        await store.close()


async def test_a_store_lets_its_directory_go_only_after_the_index_write(
        tmp_path: Path) -> None:
    """An index write whose caller was cancelled (a stop during a save) runs on in its
    thread: the store keeps the directory locked until it is done, and its failure is told
    on the event loop (the tally, the log and the counters are the loop's)."""
    heard: list[tuple[str, bool]] = []
    async with aiohttp.ClientSession() as session:
        store = SlotStore(KvDiskConfig(tmp_path), session, Router(), lambda e: heard.append(
            (e, threading.current_thread() is threading.main_thread())))
        fifo = tmp_path / (INDEX + ".tmp")
        os.mkfifo(fifo)  # (the write blocks opening it until a reader comes, then fails)
        commit = asyncio.create_task(store.files.commit(store.saved))
        await asyncio.sleep(0)  # (the write started)
        commit.cancel()
        closing = asyncio.create_task(store.close())
        try:
            await asyncio.sleep(0.3)
            assert not closing.done()
            with pytest.raises(InUse):
                lock(tmp_path, "disk tier", DISK_FIX)
        finally:
            reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
            try:
                await asyncio.wait_for(closing, 10)
            finally:
                os.close(reader)
    assert heard == [("index_failed", True)]
    assert store.files.status()["index_failed"] == 1
    os.close(lock(tmp_path, "disk tier", DISK_FIX))  # (let go)


def entry(i: int, **over: Any) -> dict[str, Any]:
    """An index entry for ``kvroute-<i>.bin`` written by `state_file(ids(100 * i, 50))`."""
    return {"id": i, "backend": "a", "slot": i % 2, "saved_at": float(i), "model": MODEL,
            "size": len(state_file(ids(100 * i, 50))),
            "tokens": base64.b64encode(ids(100 * i, 50)).decode(), **over}


async def test_a_malformed_index_entry_costs_only_its_own_file(tmp_path: Path) -> None:
    """One entry that does not parse, and one of an index without models (what computed
    its KV is unknown): those two files are put aside (nothing describes them), the
    entries after them stand."""
    index = [entry(1), entry(2, slot="zero"), entry(3), entry(4), entry(5)]
    del index[3]["model"]
    (tmp_path / INDEX).write_text(json.dumps(index))
    for i in range(1, 6):
        (tmp_path / f"kvroute-{i}.bin").write_bytes(state_file(ids(100 * i, 50)))
    async with aiohttp.ClientSession() as session:
        store = SlotStore(KvDiskConfig(tmp_path), session, Router(), lambda _: None)
    assert sorted(store.saved) == [1, 3, 5]
    assert slot_files(tmp_path) == {"kvroute-1.bin", "kvroute-3.bin", "kvroute-5.bin"}
    assert slot_files(tmp_path / QUARANTINE) == {"kvroute-2.bin", "kvroute-4.bin"}
    assert store.files.status()["quarantined"] == 2


async def test_the_budget_takes_the_quarantined_files_first(tmp_path: Path) -> None:
    """A save over the budget: the files put aside go before any saved one, then the
    oldest saves; each removal is logged with its reason."""
    size = len(state_file(ids(0, 600)))
    (tmp_path / INDEX).write_text(json.dumps([entry(1, size=size)]))
    (tmp_path / "kvroute-1.bin").write_bytes(state_file(ids(100, 50), state=size - 212))
    (tmp_path / "kvroute-2.bin").write_bytes(state_file(ids(0, 600)))  # nothing names it
    disk = KvDiskConfig(tmp_path, max_gib=2.5 * size / (1 << 30), save_after_idle_s=0,
                        min_tokens=10)
    events: list[str] = []

    async def on_save(_: web.Request, slot: int, filename: str) -> None:
        (tmp_path / filename).write_bytes(state_file(ids(0, 600)))

    async with slots_server(on_save) as url, aiohttp.ClientSession() as session:
        info = info_at(url)
        router = Router()
        router.add_backend(capacity(info))
        store = SlotStore(disk, session, router, events.append)
        assert slot_files(tmp_path / QUARANTINE) == {"kvroute-2.bin"}  # (within budget)
        store.backend_ready("a", MODEL)
        with capture_logs() as logs:
            for slot, n in ((0, 1), (1, 2)):
                router.seed("a", slot, ids(1000 * (slot + 1), 600))
                store.note(info, slot)
                await until(lambda n=n: events.count("saved") == n, 10)  # type: ignore[misc]
        assert slot_files(tmp_path / QUARANTINE) == set()
        assert sorted(store.saved) == [3, 4]  # (entry 1 the oldest; ids past the quarantine)
        removed = [(e["file"], e["reason"]) for e in logs
                   if e["event"] == "slot.file_removed"]
        assert removed == [(f"{QUARANTINE}/kvroute-2.bin", "over the budget"),
                           ("kvroute-1.bin", f"over the budget (kv_disk.max_gib "
                                             f"{disk.max_gib})")]


@pytest.mark.parametrize("field,value", [
    ("max_gib", 0.0), ("max_gib", -1.0), ("max_gib", math.nan),
    ("save_after_idle_s", -0.5), ("min_tokens", -1)])
def test_a_disk_budget_out_of_range_is_refused(tmp_path: Path, field: str,
                                               value: float) -> None:
    with pytest.raises(ValueError, match=f"kv_disk.{field}"):
        KvDiskConfig(tmp_path, **{field: value})  # type: ignore[arg-type]
