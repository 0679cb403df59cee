"""Shared by the fault tests: request bodies, a proxy over external or fake backends,
polling, and what a backend's /slots says."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp.test_utils import TestClient
from fake_backend import FakeBackend
from proxy_client import proxy
from texts import words

from backends.binary import cache_dir
from backends.config import ExternalBackendConfig, SupervisionConfig
from backends.info import BackendInfo
from backends.supervisor import Supervisor
from proxy.config.load import Config, ProxyConfig, RoutingConfig
from proxy.config.settings import HealthSettings, ProxySettings
from proxy.server.keys import ROUTER


def chat_body(seed: int, n_words: int = 60, **extra: Any) -> dict[str, Any]:
    return {"model": "kvroute-demo", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": f"{seed}: " + words(n_words, seed)}],
            **extra}


@asynccontextmanager
async def external(tmp_path: Path, backends: dict[str, tuple[str, str | None]],
                   interval: float = 0.5) -> AsyncIterator[Supervisor]:
    """A Supervisor over external backends {name: (url, api_key)}, probing every
    `interval` s (it drops an external backend at its first failed probe)."""
    cfg = Config(proxy=ProxyConfig(port=1), routing=RoutingConfig(),
                 backends=tuple(ExternalBackendConfig(name=n, url=u, api_key=k)
                                for n, (u, k) in backends.items()),
                 llama_server=None, cache_dir=cache_dir(), log_dir=tmp_path,
                 supervision=SupervisionConfig(health_interval_s=interval))
    sup = Supervisor(cfg)
    await sup.start()
    try:
        yield sup
    finally:
        await sup.stop()


@asynccontextmanager
async def fake_behind_proxy(tmp_path: Path, demo_model: Path, mode: str,
                            health: HealthSettings | None = None
                            ) -> AsyncIterator[tuple[FakeBackend, TestClient[Any, Any]]]:
    """One FakeBackend "f" (1 slot) in `mode`, the only backend of a proxy."""
    fake = FakeBackend(slots=1)
    await fake.start()
    fake.mode = mode
    settings = ProxySettings(tokenizer=demo_model, health=health or FAST_HEALTH)
    try:
        async with external(tmp_path, {"f": (fake.url, None)}) as sup, \
                proxy(sup, settings) as client:
            yield fake, client
    finally:
        await fake.stop()


async def until(cond: Callable[[], Any], timeout: float, step: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if asyncio.iscoroutine(got):
            got = await got
        if got:
            return got
        await asyncio.sleep(step)
    raise AssertionError(f"condition not met within {timeout} s")


async def busy_slots(info: BackendInfo) -> int:
    async with aiohttp.ClientSession() as s, s.get(
            info.url + "/slots", headers={"Authorization": f"Bearer {info.api_key}"},
            timeout=aiohttp.ClientTimeout(total=5)) as r:
        return sum(slot["is_processing"] for slot in await r.json())


FAST_HEALTH = HealthSettings(probe_interval_s=0.2, probe_timeout_s=0.5, breaker_failures=2,
                             open_backoff_s=0.2, open_backoff_max_s=1.0)


@asynccontextmanager
async def fake_beside_real(backend_pool: Any, tmp_path: Path, name: str,
                           settings: ProxySettings
                           ) -> AsyncIterator[tuple[FakeBackend, TestClient[Any, Any]]]:
    """A FakeBackend `name` and a real backend "real", both external, behind a proxy."""
    real = (await backend_pool()).ready()[0]
    fake = FakeBackend(n_ctx=real.slot_ctx)
    await fake.start()
    try:
        async with external(tmp_path, {name: (fake.url, None),
                                        "real": (real.url, real.api_key)}) as sup:
            assert len(sup.ready()) == 2
            async with proxy(sup, settings) as client:
                yield fake, client
    finally:
        await fake.stop()


async def all_served_by_real(client: TestClient[Any, Any], seed: int) -> float:
    """Four requests at once, some sent to the faulty backend first: every one answered
    by "real" (retried there); how long they took."""
    t0 = time.monotonic()
    rs = await asyncio.gather(*(client.post("/v1/chat/completions", json=chat_body(seed + i))
                                for i in range(4)))
    for r in rs:
        assert r.status == 200, await r.text()
        assert r.headers["X-Kvroute-Backend"] == "real"
    return time.monotonic() - t0


STALL_HEALTH = dataclasses.replace(FAST_HEALTH, stall_timeout_s=1.0)


def app_inflight(client: TestClient[Any, Any]) -> int:
    return int(client.server.app[ROUTER].snapshot()["inflight"])
