"""Slots saved to disk and restored into a backend that restarts (kv_disk): a real
llama-server killed with SIGKILL while it holds three conversations; each one's next turn
reuses its history from the restored slot, predicted exactly. And what must not cost a
backend its files or its routing: being down when they are restored, an index that
cannot be written; and what must not be restored at all: the files of another model."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import signal
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import structlog
from aiohttp.test_utils import TestClient
from faults import FAST_HEALTH, until
from proxy_client import proxy
from proxy_client import slot_files_counted as counted
from texts import words

from backends.config import KvDiskConfig
from backends.supervisor import Supervisor
from proxy.config.load import Config
from proxy.config.settings import ProxySettings
from proxy.disk.records import INDEX
from proxy.observability.logging import configure_logging
from proxy.server.keys import FORWARDER, ROUTER

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


def routed(client: TestClient[Any, Any], name: str) -> bool:
    return name in client.server.app[ROUTER].snapshot()["backends"]  # type: ignore[operator]


async def test_a_backend_down_while_its_slots_are_restored_keeps_its_files(
        pool_config: Callable[..., Config], tmp_path: Path) -> None:
    """Its process is gone (killed, restarting) when its slots are restored: the server
    said nothing of the files, which wait for its next start. That start restores one
    and drops the other, truncated, without sending it (the server aborts on one)."""
    disk = KvDiskConfig(tmp_path / "slots", save_after_idle_s=0.3, min_tokens=64)
    cfg = dataclasses.replace(pool_config(n=1, slots=2, cache_ram_mib=0), kv_disk=disk)
    sup = Supervisor(cfg)
    await sup.start()
    try:
        async with proxy(sup) as client:
            # two lengths: the index's token counts tell which file is which
            sessions = [[{"role": "system", "content": words(n, 60 + n)},
                         {"role": "user", "content": words(30, 61)}] for n in (300, 500)]
            before = [(await turn(client, s))[2] for s in sessions]
            await until(lambda: counted(client, "saved") >= 2, 30)
            files = {len(e["tokens"]): disk.path / f"kvroute-{e['id']}.bin"
                     for e in json.loads((disk.path / INDEX).read_text())}
            short, long = (files[k] for k in sorted(files))
            with long.open("r+b") as f:
                f.truncate(long.stat().st_size // 2)

            old, pid = sup.get("a"), sup.pid("a")
            assert old is not None and pid is not None
            os.kill(pid, signal.SIGKILL)
            await until(lambda: not routed(client, "a"), 30)
            store = client.server.app[FORWARDER].slot_store("a")
            assert store is not None
            assert await store.restore(old) == []  # (nothing listens on its port)
            assert short.is_file() and long.is_file() and store.has("a")

            await until(lambda: sup.pid("a") not in (None, pid), 90)
            await until(lambda: routed(client, "a"), 30)
            assert (counted(client, "restored"), counted(client, "restore_failed")) == (1, 1)
            assert short.is_file() and not long.exists()
            restarted = sup.pid("a")  # (the server aborts on a truncated file: never sent)
            for s, previous in zip(sessions, before, strict=True):
                s.append({"role": "user", "content": words(20, len(s))})
                predicted, reused, _ = await turn(client, s)
                assert abs(predicted - reused) <= 1, (predicted, reused)
                if s is sessions[0]:
                    assert reused >= 0.9 * previous, (reused, previous)
            assert sup.pid("a") == restarted
    finally:
        await sup.stop()


async def test_a_backend_is_routed_when_the_index_cannot_be_written(
        pool_config: Callable[..., Config], tmp_path: Path) -> None:
    """A restarted backend's slots come back while the index cannot be written (a
    directory in the way of its temporary file: an OSError, as on a full disk): the
    backend is routed all the same, holding them, and the failure is logged."""
    disk = KvDiskConfig(tmp_path / "slots", save_after_idle_s=0.3, min_tokens=64)
    cfg = dataclasses.replace(pool_config(n=1, slots=2, cache_ram_mib=0), kv_disk=disk)
    out = io.StringIO()
    saved_logging = structlog.get_config()
    configure_logging("info", stream=out)
    sup = Supervisor(cfg)
    try:
        await sup.start()
        async with proxy(sup) as client:
            session = [{"role": "system", "content": words(300, 40)},
                       {"role": "user", "content": words(30, 41)}]
            previous = (await turn(client, session))[2]
            await until(lambda: counted(client, "saved") >= 1, 30)
            (disk.path / (INDEX + ".tmp")).mkdir()
            pid = sup.pid("a")
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            await until(lambda: sup.pid("a") not in (None, pid), 90)
            await until(lambda: routed(client, "a"), 30)
            assert counted(client, "restored") == 1
            assert counted(client, "index_failed") >= 1
            session.append({"role": "user", "content": words(20, 42)})
            predicted, reused, _ = await turn(client, session)
            assert reused >= 0.9 * previous and abs(predicted - reused) <= 1
    finally:
        await sup.stop()
        structlog.configure(**saved_logging)
    assert '"slot.index_failed"' in out.getvalue()


async def test_files_of_another_model_are_not_restored_but_kept_for_theirs(
        pool_config: Callable[..., Config], demo_model: Path, tmp_path: Path) -> None:
    """Backend "a" is given another model file between two runs (a hard link to the same
    weights here: the server would load a fine-tune of the same shape as silently): the
    slot saved from the first is not restored into it, and is counted. The first model
    back, it is restored."""
    other = tmp_path / "other.gguf"
    try:
        os.link(demo_model, other)
    except OSError:  # (another file system)
        shutil.copyfile(demo_model, other)
    disk = KvDiskConfig(tmp_path / "slots", save_after_idle_s=0.3, min_tokens=64)
    base = pool_config(n=1, slots=2, cache_ram_mib=0)
    session = [{"role": "system", "content": words(300, 50)},
               {"role": "user", "content": words(40, 51)}]
    for run, model in enumerate((demo_model, other, demo_model)):
        a = dataclasses.replace(base.backends[0], model=model)
        sup = Supervisor(dataclasses.replace(base, backends=(a,), kv_disk=disk))
        await sup.start()
        try:
            async with proxy(sup) as client:
                if run == 0:
                    previous = (await turn(client, session))[2]
                    await until(lambda: counted(client, "saved") >= 1, 30)
                elif run == 1:
                    await until(lambda: routed(client, "a"), 30)
                    assert counted(client, "restored") == 0
                    assert counted(client, "foreign") == 1
                    assert len(list(disk.path.glob("kvroute-*.bin"))) == 1  # kept
                else:
                    await until(lambda: counted(client, "restored") >= 1, 30)
                    session.append({"role": "user", "content": words(20, 52)})
                    predicted, reused, _ = await turn(client, session)
                    assert reused >= 0.9 * previous and abs(predicted - reused) <= 1
        finally:
            await sup.stop()


async def test_a_slot_displaced_before_its_idle_save_is_spilled_first(
        pool_config: Callable[..., Config], tmp_path: Path) -> None:
    """One slot, no RAM cache, no idle save in time: conversation B displaces A from the
    slot right after A's turn. A is saved first (a spill, before B is sent), so A's next
    turn gets its history back from disk, predicted exactly; without the spill it would
    be a cold prefill. B's content, displaced by A's return, is spilled in turn."""
    disk = KvDiskConfig(tmp_path / "slots", save_after_idle_s=600, min_tokens=64)
    cfg = dataclasses.replace(pool_config(n=1, slots=1, cache_ram_mib=0), kv_disk=disk)
    sup = Supervisor(cfg)
    await sup.start()
    try:
        async with proxy(sup) as client:
            a = [{"role": "system", "content": words(500, 120)},
                 {"role": "user", "content": words(40, 121)}]
            b = [{"role": "system", "content": words(300, 122)},
                 {"role": "user", "content": words(40, 123)}]
            previous = (await turn(client, a))[2]
            await turn(client, b)
            assert counted(client, "spilled") == 1 and counted(client, "saved") == 0
            a.append({"role": "user", "content": words(20, 124)})
            async with client.post("/v1/chat/completions", json={
                    "model": "kvroute-demo", "max_tokens": 4, "messages": a}) as r:
                body = await r.json()
                assert r.status == 200, body
                assert r.headers["X-Kvroute-Tier"] == "disk"
                predicted = int(r.headers["X-Kvroute-Predicted-Cached"])
            reused = body["timings"]["cache_n"]
            assert reused >= 0.9 * previous and abs(predicted - reused) <= 1, \
                (predicted, reused, previous)
            assert counted(client, "spilled") == 2  # B's turn, displaced by A's return
    finally:
        await sup.stop()
