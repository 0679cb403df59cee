"""Slots saved to disk and restored into a backend that restarts (kv_disk): a real
llama-server killed with SIGKILL while it holds three conversations; each one's next turn
reuses its history from the restored slot, predicted exactly."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from faults import FAST_HEALTH, until
from proxy_client import proxy
from texts import words

from backends.config import KvDiskConfig
from backends.supervisor import Supervisor
from proxy.config.load import Config
from proxy.config.settings import ProxySettings
from proxy.forwarding.slot_store import INDEX
from proxy.server.keys import METRICS, ROUTER

pytestmark = pytest.mark.timeout(240)


async def turn(client: TestClient[Any, Any], messages: list[dict[str, str]]
               ) -> tuple[int, int, int]:
    """(predicted, reported reuse, prompt tokens) of one turn; the answer is kept out of
    the history (a fixed one goes in) so that what a slot holds is known exactly."""
    async with client.post("/v1/chat/completions", json={
            "model": "kvroute-demo", "max_tokens": 4, "messages": messages}) as r:
        body = await r.json()
        assert r.status == 200, body
        predicted = int(r.headers["X-Kvroute-Predicted-Cached"])
    t = body["timings"]
    messages.append({"role": "assistant", "content": "Noted."})
    return predicted, t["cache_n"], t["cache_n"] + t["prompt_n"]


def counted(client: TestClient[Any, Any], event: str) -> float:
    m = client.server.app[METRICS]
    return float(m.child(m.slot_files, event)._value.get())


async def test_a_killed_backend_comes_back_with_its_conversations(
        pool_config: Callable[..., Config], tmp_path: Path) -> None:
    disk = KvDiskConfig(tmp_path / "slots", save_after_idle_s=0.3, min_tokens=64)
    cfg = dataclasses.replace(pool_config(n=1, slots=4, cache_ram_mib=0), kv_disk=disk)
    sup = Supervisor(cfg)
    await sup.start()
    try:
        async with proxy(sup) as client:
            sessions = [[{"role": "system", "content": words(300, 70 + i)},
                         {"role": "user", "content": words(40, 80 + i)}] for i in range(3)]
            before = [(await turn(client, s))[2] for s in sessions]
            await until(lambda: counted(client, "saved") >= 3, 30)
            index = json.loads((disk.path / INDEX).read_text())
            assert len({e["slot"] for e in index}) == 3  # three slots, one file each
            assert stat.S_IMODE(disk.path.stat().st_mode) == 0o700
            files = sorted(disk.path.glob("kvroute-*.bin"))
            assert len(files) == 3
            assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)

            old = sup.pid("a")
            assert old is not None
            os.kill(old, signal.SIGKILL)
            await until(lambda: sup.pid("a") not in (None, old), 90)
            await until(lambda: "a" in client.server.app[ROUTER].snapshot()["backends"], 30)
            assert counted(client, "restored") == 3

            for s, previous in zip(sessions, before, strict=True):
                s.append({"role": "user", "content": words(20, len(s))})  # the next turn
                predicted, reused, _ = await turn(client, s)
                assert reused >= 0.9 * previous, (reused, previous)
                assert abs(predicted - reused) <= 1, (predicted, reused)
    finally:
        await sup.stop()


async def test_a_restarted_kvroute_restores_what_the_last_one_saved(
        pool_config: Callable[..., Config], tmp_path: Path) -> None:
    """Everything stopped (kvroute and its backends) and started again: the index beside
    the files says what each holds."""
    disk = KvDiskConfig(tmp_path / "slots", save_after_idle_s=0.3, min_tokens=64)
    cfg = dataclasses.replace(pool_config(n=1, slots=2, cache_ram_mib=0), kv_disk=disk)
    session = [{"role": "system", "content": words(300, 90)},
               {"role": "user", "content": words(40, 91)}]
    for run in range(2):
        sup = Supervisor(cfg)
        await sup.start()
        try:
            async with proxy(sup) as client:
                if run == 0:
                    previous = (await turn(client, session))[2]
                    await until(lambda: counted(client, "saved") >= 1, 30)
                else:
                    await until(lambda: counted(client, "restored") >= 1, 30)
                    session.append({"role": "user", "content": words(20, 92)})
                    predicted, reused, _ = await turn(client, session)
                    assert reused >= 0.9 * previous and abs(predicted - reused) <= 1
        finally:
            await sup.stop()


async def test_a_conversation_moves_to_another_backend_by_restore(
        pool_config: Callable[..., Config], tmp_path: Path) -> None:
    """Its backend stops answering (SIGSTOP: the proxy's breaker takes it out): the next
    turn goes to the other backend, whose slot is first given the conversation from disk;
    it reuses its history there, predicted exactly."""
    disk = KvDiskConfig(tmp_path / "slots", save_after_idle_s=0.3, min_tokens=64)
    cfg = dataclasses.replace(pool_config(n=2, slots=1, cache_ram_mib=0), kv_disk=disk)
    sup = Supervisor(cfg)
    await sup.start()
    stopped = None
    try:
        async with proxy(sup, ProxySettings(health=FAST_HEALTH)) as client:
            session = [{"role": "system", "content": words(600, 95)},
                       {"role": "user", "content": words(40, 96)}]
            async with client.post("/v1/chat/completions", json={
                    "model": "kvroute-demo", "max_tokens": 4, "messages": session}) as r:
                first = r.headers["X-Kvroute-Backend"]
                previous = (await r.json())["usage"]["prompt_tokens"]
            session.append({"role": "assistant", "content": "Noted."})
            await until(lambda: counted(client, "saved") >= 1, 30)
            stopped = sup.pid(first)
            assert stopped is not None
            os.kill(stopped, signal.SIGSTOP)
            router = client.server.app[ROUTER]
            await until(lambda: first not in router.snapshot()["backends"], 30)

            session.append({"role": "user", "content": words(20, 97)})
            async with client.post("/v1/chat/completions", json={
                    "model": "kvroute-demo", "max_tokens": 4, "messages": session}) as r:
                body = await r.json()
                assert r.status == 200, body
                assert r.headers["X-Kvroute-Backend"] != first
                assert r.headers["X-Kvroute-Tier"] == "disk"
                predicted = int(r.headers["X-Kvroute-Predicted-Cached"])
            reused = body["timings"]["cache_n"]
            assert reused >= 0.9 * previous and abs(predicted - reused) <= 1, \
                (predicted, reused, previous)
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        await sup.stop()
