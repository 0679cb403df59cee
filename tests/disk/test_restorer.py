"""The disk tier's restores (proxy/disk/restore.py) on their own: when a server that went
away during a file's restore is taken to be brought down by it (`Strikes`), what each
failure is told as, and what each answer of the server to a restore costs the file
(`Restorer`, over a fake server that answers as llama-server does). Real servers:
test_slot_restore_into.py, test_slot_store.py."""

from __future__ import annotations

import json
import struct
from array import array
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from backends.client import BackendDown, BadResponse
from backends.info import BackendInfo
from proxy.disk.catalog import Catalog
from proxy.disk.files import SlotFiles
from proxy.disk.identity import Identities
from proxy.disk.records import INDEX, MAGIC, Saved, encode
from proxy.disk.restore import Restorer, Strikes, refused, restore_trouble
from proxy.routing.router import Router

pytestmark = pytest.mark.timeout(30)

GONE = BackendDown("u", "ServerDisconnectedError")  # the server went away
TIMED_OUT = BackendDown("u", "TimeoutError", timed_out=True)
NOT_REACHED = BackendDown("u", "ClientConnectorError", refused=True)
REFUSED = BadResponse("u", 400, json.dumps({"error": {"message": "Unable to restore slot"}}))


@pytest.mark.parametrize(("window", "restores", "struck"), [
    # restores: (entry, what the server answered, when); struck: the answer to each
    (900.0, [(1, GONE, 0.0)], [False]),
    (900.0, [(1, GONE, 0.0), (1, GONE, 10.0)], [False, True]),
    (900.0, [(1, GONE, 0.0), (1, GONE, 901.0)], [False, False]),  # two unrelated deaths
    (900.0, [(1, GONE, 0.0), (2, GONE, 10.0)], [False, False]),  # another file's
    (900.0, [(1, TIMED_OUT, 0.0), (1, TIMED_OUT, 1.0)], [False, False]),  # busy, hung
    (900.0, [(1, NOT_REACHED, 0.0), (1, NOT_REACHED, 1.0)], [False, False]),
    (900.0, [(1, REFUSED, 0.0), (1, GONE, 1.0)], [False, False]),
    (900.0, [(1, GONE, 0.0), (1, TIMED_OUT, 5.0), (1, GONE, 10.0)], [False, False, True]),
    (0.0, [(1, GONE, 0.0), (1, GONE, 1.0)], [False, False]),
    # a strike far back is forgotten with the others that count no more
    (900.0, [(1, GONE, 0.0), (2, GONE, 1000.0), (1, GONE, 1001.0)], [False, False, False]),
])
def test_a_file_the_server_went_away_during_twice_in_the_window_is_struck(
        window: float, restores: list[tuple[int, object, float]], struck: list[bool]) -> None:
    strikes = Strikes(window)
    assert [strikes.strike(i, got, at) for i, got, at in restores] == struck


def test_a_cleared_strike_counts_no_more() -> None:
    strikes = Strikes(900.0)
    assert not strikes.strike(1, GONE, 0.0)
    strikes.clear(1)
    assert not strikes.strike(1, GONE, 1.0)
    assert strikes.strike(1, GONE, 2.0)


@pytest.mark.parametrize(("got", "kept", "reason", "fix"), [
    (GONE, True, "no answer: ServerDisconnectedError", "none: the file waits"),
    (GONE, False, "no answer", "see the server's log: it went away"),
    (REFUSED, False, "server: Unable to restore slot", "none for this file (dropped)"),
    (BadResponse("u", 503, "loading"), True, "server: HTTP 503: loading", "none: the file"),
    (3, False, "the server restored 3 tokens, its record says 50", "none for this file"),
])
def test_each_failed_restore_is_told_with_its_reason_and_fix(
        got: object, kept: bool, reason: str, fix: str) -> None:
    why, how = restore_trouble(got, 50, kept)
    assert why.startswith(reason) and how.startswith(fix)


@pytest.mark.parametrize(("got", "is_refused"), [
    (REFUSED, True),
    (BadResponse("u", 400, json.dumps({"error": {"message": "Invalid slot id"}})), False),
    (BadResponse("u", 500, json.dumps({"error": {"message": "Unable to restore slot"}})),
     False),
    (GONE, False),
])
def test_a_refusal_is_the_servers_400_that_it_cannot_restore_the_file(
        got: object, is_refused: bool) -> None:
    assert refused(got) is is_refused


def tokens(n: int = 200) -> bytes:
    return array("i", range(n)).tobytes()


def entry(model: str = "m1") -> Saved:
    whole = struct.pack("<III", MAGIC, 3, 200) + tokens() + bytes(300)
    return Saved(1, "a", 0, tokens(), 1.0, model, len(whole), count=200)


@asynccontextmanager
async def restoring(answer: Callable[[], web.Response]) -> AsyncIterator[tuple[str, list[str]]]:
    """A server answering each restore with ``answer()``; its URL, and the files it was
    asked to restore."""
    asked: list[str] = []

    async def slots(request: web.Request) -> web.Response:
        asked.append((await request.json())["filename"])
        return answer()

    app = web.Application()
    app.router.add_post("/slots/{id}", slots)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}", asked
    finally:
        await runner.cleanup()


def restored(n: int) -> Callable[[], web.Response]:
    return lambda: web.json_response({"id_slot": 0, "n_restored": n})


def error(status: int, message: str) -> Callable[[], web.Response]:
    return lambda: web.json_response({"error": {"message": message}}, status=status)


@pytest.mark.parametrize(("answer", "model", "done", "counted", "kept"), [
    (restored(200), "m1", True, ["restored"], True),
    (restored(10), "m1", False, ["restore_failed"], False),  # (fewer than its quarter)
    (error(400, "Unable to restore slot, no available space"), "m1", False,
     ["restore_failed"], False),
    (error(400, "Invalid slot id"), "m1", False, ["restore_interrupted"], True),
    (error(503, "Loading model"), "m1", False, ["restore_interrupted"], True),
    (restored(200), "m2", False, ["foreign"], True),  # (not sent: another model runs)
], ids=["restored", "too few", "refused", "another 400", "loading", "another model"])
async def test_what_each_answer_to_a_restore_costs_the_file(
        tmp_path: Path, answer: Callable[[], web.Response], model: str, done: bool,
        counted: list[str], kept: bool) -> None:
    e = entry()
    (tmp_path / e.file).write_bytes(struct.pack("<III", MAGIC, 3, 200) + tokens()
                                    + bytes(300))
    (tmp_path / e.sidecar).write_text(json.dumps(encode(e)))
    (tmp_path / INDEX).write_text(json.dumps([encode(e)]))
    events: list[str] = []
    async with restoring(answer) as (url, asked), aiohttp.ClientSession() as session:
        files = SlotFiles(tmp_path, events.append)
        catalog = Catalog(files, 1.0, Router())
        identities = Identities(session, lambda *_: None)
        identities.learn("a", model)
        restorer = Restorer(files, catalog, identities, session, events.append)
        info = BackendInfo(name="a", url=url, api_key=None, n_slots=1, slot_ctx=8192,
                           ram_cache_bytes=0, kv_bytes_per_token=1024, model="m",
                           managed=True)
        assert await restorer.restore_into(info, 0, e.file) is done
        assert await restorer.restore_into(info, 0, "kvroute-99.bin") is False
        await files.close()
    assert asked == ([] if model != "m1" else [e.file])
    assert events == counted
    assert (e.id in catalog.saved) is kept and (tmp_path / e.file).exists() is kept
    # (the status counts each restore that failed, the file kept or not)
    assert files.status()["restore_failed"] == len(set(counted) & {
        "restore_failed", "restore_interrupted"})
