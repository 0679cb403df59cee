"""The disk tier's saves (proxy/disk/save.py `Saver`) on their own: when a request about to
displace a slot's content has it spilled first, over the fake server of
test_slot_files.py (it writes each file as llama-server does). When a spill pays at all
is test_spill_estimate.py's; real servers: test_slot_store.py, test_slot_handoff.py."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from test_slot_files import MODEL, ids, info_at, slots_server, state_file

from backends.config import KvDiskConfig
from backends.memory import MemoryKind
from proxy.disk.catalog import Catalog
from proxy.disk.files import SlotFiles
from proxy.disk.identity import Identities
from proxy.disk.save import Saver
from proxy.forwarding.health import capacity
from proxy.routing.router import Router

pytestmark = pytest.mark.timeout(30)

HELD = ids(1000, 600)  # what slot 0 holds when its turn ends
HANDED = ids(5000, 600)  # what a hand-off says the slot held


# noted: its turn's end was noted; forgotten: then its backend restarted; keeps: tokens
# of it the request reuses; displaced: what a hand-off says it held; memory: the
# backend's; write_bps: the save rate as measured; saved: the tokens saved (None: none)
SPILLS = {
    "noted, displaced": (True, False, 0, None, None, None, HELD),
    "noted, mostly kept": (True, False, 595, None, None, None, None),
    "not noted": (False, False, 0, None, None, None, None),
    "handed over": (False, False, 0, HANDED, None, None, HANDED),
    "noted, then handed over": (True, False, 0, HANDED, None, None, HANDED),
    "forgotten": (True, True, 0, None, None, None, None),
    "a sliding window": (True, False, 0, HANDED, MemoryKind(n_swa=4096), None, None),
    "too slow to pay": (True, False, 0, None, None, 1.0, None),
}


@pytest.mark.parametrize("case", list(SPILLS))
async def test_a_displaced_slot_is_spilled_when_unsaved_and_worth_it(
        tmp_path: Path, case: str) -> None:
    noted, forgotten, keeps, displaced, memory, write_bps, saved = SPILLS[case]
    events: list[str] = []

    async def on_save(_: web.Request, _slot: int, filename: str) -> None:
        (tmp_path / filename).write_bytes(state_file(ids(0, 600)))

    cfg = KvDiskConfig(tmp_path, save_after_idle_s=3600, min_tokens=10)
    async with slots_server(on_save) as url, aiohttp.ClientSession() as session:
        info = info_at(url)
        if memory is not None:
            info = replace(info, memory=memory)
        router = Router()
        router.add_backend(capacity(info))
        router.seed("a", 0, HELD)
        files = SlotFiles(tmp_path, events.append)
        catalog = Catalog(files, cfg.max_gib, router)
        identities = Identities(session, lambda *_: None)
        identities.learn("a", MODEL)
        saver = Saver(cfg, files, catalog, identities, session, events.append)
        if write_bps is not None:
            saver.write_bps = write_bps
        if noted:
            saver.note(info, 0)
        if forgotten:
            saver.forget("a")
        await saver.spill(info, 0, keeps, displaced)
        await saver.close()
        await files.close()
    assert events == ([] if saved is None else ["spilled"])
    assert [e.tokens for e in catalog.saved.values()] == ([] if saved is None else [saved])


async def test_a_slow_spill_halves_the_rate_the_next_are_weighed_at(tmp_path: Path) -> None:
    """A spill the server does not answer within its bound fails, and the next spills are
    weighed at half the rate (a disk that stalls: skipped rather than waited on)."""
    events: list[str] = []

    async def stalls(_: web.Request, _slot: int, _filename: str) -> None:
        await asyncio.sleep(3)

    cfg = KvDiskConfig(tmp_path, save_after_idle_s=3600, min_tokens=10)
    async with slots_server(stalls) as url, aiohttp.ClientSession() as session:
        info = info_at(url)
        router = Router()
        router.add_backend(capacity(info))
        files = SlotFiles(tmp_path, events.append)
        catalog = Catalog(files, cfg.max_gib, router)
        identities = Identities(session, lambda *_: None)
        identities.learn("a", MODEL)
        saver = Saver(cfg, files, catalog, identities, session, events.append)
        saver.write_bps = 4 * 600 * 1024  # (a spill of 0.25 s: bound at 2 s)
        await saver.spill(info, 0, 0, HANDED)
        await files.close()
    assert events == ["save_failed"] and catalog.saved == {}
    assert saver.write_bps == 2 * 600 * 1024
