"""A saved slot restored on the request path (`SlotStore.restore_into`, a real llama-server):
a file the server cannot use is dropped, not chosen for the next request again; a server
that does not answer costs the request a bounded wait, not the file; and a conversation
moves by restore only to a backend that runs the model that computed it and reads the
directory it is in."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import os
import shutil
import signal
import struct
import time
from array import array
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from faults import FAST_HEALTH, until
from proxy_client import proxy
from texts import words

from backends.client import BackendClient, Tokens
from backends.config import ExternalBackendConfig, KvDiskConfig, ManagedBackendConfig
from backends.info import BackendInfo
from backends.supervisor import Supervisor
from proxy.config.load import Config
from proxy.config.settings import ProxySettings
from proxy.disk.identity import model_identity
from proxy.disk.records import INDEX
from proxy.disk.restore import RESTORE_BASE_S
from proxy.disk.store import SlotStore
from proxy.forwarding.health import capacity
from proxy.routing.router import Router
from proxy.server.keys import FORWARDER, METRICS, ROUTER

pytestmark = pytest.mark.timeout(120)
FILE = "kvroute-1.bin"


@dataclasses.dataclass
class Saved:
    sup: Supervisor
    info: BackendInfo
    store: SlotStore
    router: Router
    events: list[str]
    prompt: list[int]  # what the file holds, then the next turn's tokens
    path: Path  # the file


@asynccontextmanager
async def saved_slot(pool_config: Callable[..., Config], tmp_path: Path,
                     claimed_extra: int = 0) -> AsyncIterator[Saved]:
    """One backend whose slot 0 the server saved as FILE, recorded in the index (with
    ``claimed_extra`` tokens more than it holds), and a SlotStore and Router over it."""
    disk = KvDiskConfig(tmp_path / "slots", min_tokens=64)
    cfg = dataclasses.replace(pool_config(n=1, slots=1, cache_ram_mib=0), kv_disk=disk)
    sup = Supervisor(cfg)
    await sup.start()
    try:
        async with aiohttp.ClientSession() as session:
            info = sup.ready()[0]
            server = BackendClient(session, info.url, info.api_key)
            got = await server.tokenize(words(500, 3) + words(100, 4))
            assert isinstance(got, Tokens)
            held, rest = got.ids[:-150], got.ids[-150:]
            async with session.post(info.url + "/completion", headers={
                    "Authorization": f"Bearer {info.api_key}"}, json={
                    "prompt": held, "n_predict": 1, "id_slot": 0,
                    "cache_prompt": True}) as r:
                assert r.status == 200, await r.text()
            assert await server.slot_file(0, "save", FILE) == len(held)
            claimed = held + rest[:claimed_extra]
            model = model_identity(cfg.backends[0])
            assert model is not None
            (disk.path / INDEX).write_text(json.dumps([{
                "id": 1, "backend": "a", "slot": 0, "saved_at": time.time(), "model": model,
                "size": (disk.path / FILE).stat().st_size,
                "tokens": base64.b64encode(array("i", claimed).tobytes()).decode()}]))
            router, events = Router(), []
            store = SlotStore(disk, session, router, events.append)
            store.backend_ready("a", model)
            router.add_backend(capacity(info))
            yield Saved(sup, info, store, router, events, held + rest, disk.path / FILE)
    finally:
        await sup.stop()


@pytest.mark.parametrize("fault", ["another build", "truncated", "short"])
async def test_a_file_that_cannot_be_restored_is_not_chosen_again(
        pool_config: Callable[..., Config], tmp_path: Path, fault: str) -> None:
    """``another build``: a file of another version of the sequence state, which the
    server refuses. ``truncated``: never sent (the server aborts on one). ``short``:
    restored, but fewer tokens than the index says."""
    async with saved_slot(pool_config, tmp_path, 100 if fault == "short" else 0) as s:
        if fault == "another build":
            with s.path.open("r+b") as f:
                f.seek(4)
                f.write(struct.pack("<I", 99))  # (after the magic: its version)
        elif fault == "truncated":
            with s.path.open("r+b") as f:
                f.truncate(s.path.stat().st_size // 2)
        pid = s.sup.pid("a")
        decision = s.router.decide(s.prompt)
        assert decision.restore == FILE, decision  # type: ignore[union-attr]
        assert not await s.store.restore_into(s.info, 0, FILE)
        assert s.events == ["restore_failed"]
        assert not s.path.exists() and s.store.saved == {}
        assert s.sup.pid("a") == pid
        if fault == "another build":  # the server refused it and cleared the slot
            failed = s.router.restore_failed(decision)  # type: ignore[arg-type]
            async with aiohttp.ClientSession() as session, session.post(
                    s.info.url + "/completion",
                    headers={"Authorization": f"Bearer {s.info.api_key}"},
                    json={"prompt": s.prompt, "n_predict": 1, "id_slot": 0,
                          "cache_prompt": True}) as r:
                assert r.status == 200, await r.text()
                reused = (await r.json())["timings"]["cache_n"]
            assert (failed.predicted_cached, reused) == (0, 0)
        s.router.add_backend(capacity(s.info))  # afresh: its slot holds nothing
        assert s.router.decide(s.prompt).restore is None  # type: ignore[union-attr]


async def test_a_server_that_does_not_answer_a_restore_costs_a_bounded_wait(
        pool_config: Callable[..., Config], tmp_path: Path) -> None:
    """The server is stopped (SIGSTOP): the request goes on without the restore after a
    few seconds, and the file, of which the server said nothing, is kept; so it is when
    that happens again (a busy server is not one the file brought down)."""
    async with saved_slot(pool_config, tmp_path) as s:
        pid = s.sup.pid("a")
        assert pid is not None
        for n in (1, 2):
            os.kill(pid, signal.SIGSTOP)
            try:
                start = time.monotonic()
                done = await asyncio.wait_for(s.store.restore_into(s.info, 0, FILE), 30)
                waited = time.monotonic() - start
            finally:
                os.kill(pid, signal.SIGCONT)
            assert not done and waited < RESTORE_BASE_S + 2, waited
            assert s.events == ["restore_interrupted"] * n
            assert s.path.is_file() and s.store.has("a")


def counted(m: object, event: str) -> float:
    return float(m.child(m.slot_files, event)._value.get())  # type: ignore[attr-defined]


@pytest.mark.parametrize("other", ["another model", "external"])
async def test_a_conversation_moves_by_restore_only_where_it_may(
        pool_config: Callable[..., Config], demo_model: Path, tmp_path: Path,
        other: str) -> None:
    """Its backend stops answering; the other one runs another model file (a hard link to
    the same weights: the server would load a fine-tune of the same shape as silently;
    a pool of its own, asked for by its name), or is an external server of the same pool
    (the files are not in its directory): the next turn goes there without a restore,
    and reuses what it is predicted to."""
    disk = KvDiskConfig(tmp_path / "slots", save_after_idle_s=0.3, min_tokens=64)
    base = pool_config(n=1, slots=1, cache_ram_mib=0)
    a = base.backends[0]
    assert isinstance(a, ManagedBackendConfig)
    outside = None
    if other == "another model":
        link = tmp_path / "other.gguf"
        try:
            os.link(demo_model, link)
        except OSError:  # (another file system)
            shutil.copyfile(demo_model, link)
        b: ManagedBackendConfig | ExternalBackendConfig = dataclasses.replace(
            a, name="b", model=link, alias="other")
    else:
        outside = Supervisor(pool_config(n=1, slots=1, cache_ram_mib=0, names=("x",)))
        await outside.start()
        x = outside.ready()[0]
        b = ExternalBackendConfig(name="b", url=x.url, api_key=x.api_key)
    sup = Supervisor(dataclasses.replace(base, backends=(a, b), kv_disk=disk))
    await sup.start()
    stopped = None
    try:
        async with proxy(sup, ProxySettings(health=FAST_HEALTH)) as client:
            store, m = client.server.app[FORWARDER].slot_store("a"), client.server.app[METRICS]
            assert store is not None
            for seed in range(4):  # a conversation on "a" (the first try, ties go to it)
                session = [{"role": "system", "content": words(600, 20 + seed)},
                           {"role": "user", "content": words(40, 30 + seed)}]
                async with client.post("/v1/chat/completions", json={
                        "model": "kvroute-demo", "max_tokens": 4, "messages": session}) as r:
                    assert r.status == 200
                    if r.headers["X-Kvroute-Backend"] == "a":
                        break
            else:
                pytest.fail("no conversation landed on a")
            session.append({"role": "assistant", "content": "Noted."})
            await until(lambda: any(e.backend == "a" for e in store.saved.values()), 30)
            stopped = sup.pid("a")
            assert stopped is not None
            os.kill(stopped, signal.SIGSTOP)
            router = client.server.app[ROUTER]
            await until(lambda: "a" not in router.snapshot()["backends"], 30)  # type: ignore[operator]

            session.append({"role": "user", "content": words(20, 40)})
            model = "other" if other == "another model" else "kvroute-demo"
            async with client.post("/v1/chat/completions", json={
                    "model": model, "max_tokens": 4, "messages": session}) as r:
                body = await r.json()
                assert r.status == 200, body
                assert r.headers["X-Kvroute-Backend"] == "b"
                assert r.headers["X-Kvroute-Tier"] != "disk"
                predicted = int(r.headers["X-Kvroute-Predicted-Cached"])
            assert abs(predicted - body["timings"]["cache_n"]) <= 1
            assert [counted(m, e) for e in ("restored", "restore_failed",
                                            "restore_interrupted")] == [0, 0, 0]
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        await sup.stop()
        if outside is not None:
            await outside.stop()
