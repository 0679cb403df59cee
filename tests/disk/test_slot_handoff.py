"""A queued request and the disk tier (kv_disk), against a real llama-server with one
slot: the turn whose conversation only a file holds waits for the slot; when the slot
frees, what it held (the other conversation's turn, just ended, never idle) is saved
first, then the file is restored, and the turn reuses its history, predicted exactly."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from faults import until
from proxy_client import proxy
from proxy_client import slot_files_counted as counted
from texts import words

from backends.config import KvDiskConfig, ManagedBackendConfig
from backends.demo_model import ensure_demo_model
from backends.supervisor import Supervisor
from proxy.config.load import Config
from proxy.server.keys import ROUTER

pytestmark = pytest.mark.timeout(240)


async def chat(client: TestClient[Any, Any], messages: list[dict[str, str]],
               max_tokens: int = 4) -> tuple[int, int, str]:
    """(predicted, reported reuse, tier) of one turn."""
    async with client.post("/v1/chat/completions", json={
            "model": "kvroute-demo", "max_tokens": max_tokens, "messages": messages}) as r:
        body = await r.json()
        assert r.status == 200, body
        return (int(r.headers["X-Kvroute-Predicted-Cached"]), body["timings"]["cache_n"],
                r.headers["X-Kvroute-Tier"])


async def test_a_queued_turn_is_restored_into_the_slot_it_is_handed(
        pool_config: Callable[..., Config], tmp_path: Path) -> None:
    disk = KvDiskConfig(tmp_path / "slots", save_after_idle_s=0.3, min_tokens=64)
    cfg = dataclasses.replace(pool_config(n=1, slots=1, cache_ram_mib=0), kv_disk=disk)
    sup = Supervisor(cfg)
    await sup.start()
    try:
        async with proxy(sup) as client:
            mine = [{"role": "system", "content": words(400, 31)},
                    {"role": "user", "content": words(30, 32)}]
            await chat(client, mine)
            await until(lambda: counted(client, "saved") >= 1, 30)
            mine.append({"role": "assistant", "content": "Noted."})
            mine.append({"role": "user", "content": words(20, 33)})
            other = [{"role": "system", "content": words(900, 34)},
                     {"role": "user", "content": words(30, 35)}]
            router = client.server.app[ROUTER]
            busy = asyncio.create_task(chat(client, other, max_tokens=32))
            await until(lambda: router.snapshot()["inflight"] == 1, 30)
            predicted, reused, tier = await chat(client, mine)  # queued behind `other`
            await busy
            assert tier == "disk" and reused > 400, (tier, reused)
            assert abs(predicted - reused) <= 1, (predicted, reused)
            # the other conversation's turn was saved before the restore replaced it
            assert counted(client, "spilled") == 1
            other.append({"role": "assistant", "content": "Noted."})
            other.append({"role": "user", "content": words(20, 36)})
            predicted, reused, tier = await chat(client, other)
            assert tier == "disk" and reused > 900, (tier, reused)
            assert abs(predicted - reused) <= 1, (predicted, reused)
    finally:
        await sup.stop()


async def test_a_sliding_window_slot_is_not_spilled_at_a_hand_off(
        pool_config: Callable[..., Config], tmp_path: Path) -> None:
    """A slot of a sliding-window model is not saved (the server restores it without its
    checkpoints: only a continuation could use it), so a queued request handed it does
    not wait for a save of what it held either."""
    cfg = pool_config(n=1, slots=1, cache_ram_mib=0)
    backend = cfg.backends[0]
    assert isinstance(backend, ManagedBackendConfig)
    swa = dataclasses.replace(backend, model=ensure_demo_model(kind="demo-swa"),
                              alias="kvroute-demo")
    disk = KvDiskConfig(tmp_path / "slots", save_after_idle_s=0.3, min_tokens=64)
    sup = Supervisor(dataclasses.replace(cfg, backends=(swa,), kv_disk=disk))
    await sup.start()
    try:
        async with proxy(sup) as client:
            other = [{"role": "system", "content": words(900, 34)},
                     {"role": "user", "content": words(30, 35)}]
            router = client.server.app[ROUTER]
            busy = asyncio.create_task(chat(client, other, max_tokens=32))
            await until(lambda: router.snapshot()["inflight"] == 1, 30)
            await chat(client, [{"role": "user", "content": words(200, 37)}])  # queued
            await busy
            assert counted(client, "spilled") == counted(client, "save_failed") == 0
    finally:
        await sup.stop()
