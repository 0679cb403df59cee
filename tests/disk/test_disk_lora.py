"""The disk tier and LoRA adapters: a slot's KV is made under the adapters of its last
request, which a saved file does not record, so the slots of a backend with adapters
are never saved (a restore under other adapters would decode wrong); a plain
backend's are, beside it."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from faults import until
from proxy_client import serving
from proxy_client import slot_files_counted as counted
from texts import words

from backends.config import KvDiskConfig
from backends.demo_lora import ensure_demo_lora, for_model
from backends.demo_model import DemoModelParams
from proxy.config.load import Config
from proxy.disk.records import INDEX

pytestmark = pytest.mark.timeout(180)


async def _backend_of(client: TestClient[Any, Any], seed: int) -> str:
    async with client.post("/v1/chat/completions", json={
            "model": "kvroute-demo", "max_tokens": 2, "messages": [
                {"role": "system", "content": words(200, seed)},
                {"role": "user", "content": words(30, seed + 1)}]}) as r:
        assert r.status == 200, await r.text()
        return r.headers["X-Kvroute-Backend"]


async def test_slots_of_a_backend_with_adapters_are_not_saved(
        pool_config: Callable[..., Config], tmp_path: Path) -> None:
    disk = KvDiskConfig(tmp_path / "slots", save_after_idle_s=0.3, min_tokens=64)
    cfg = pool_config(n=2, slots=1, ctx_per_slot=4096, cache_ram_mib=0)
    plain, adapted = cfg.backends
    loras = tuple(ensure_demo_lora(for_model(DemoModelParams(), s)) for s in (0, 1))
    adapted = dataclasses.replace(adapted, lora=loras)
    async with serving(dataclasses.replace(cfg, backends=(plain, adapted), kv_disk=disk)) as c:
        # two new conversations, one slot each: one per backend
        served = {await _backend_of(c, 10), await _backend_of(c, 20)}
        assert served == {"a", "b"}, served
        await until(lambda: counted(c, "saved") >= 1, 30)
        await asyncio.sleep(1.0)  # (b's turn ended with a's: its save would be done)
        assert counted(c, "saved") == 1
    index = json.loads((disk.path / INDEX).read_text())
    assert {e["backend"] for e in index} == {"a"}, index
