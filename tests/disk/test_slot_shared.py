"""External llama-servers that declare a shared --slot-save-path (`slot_save_path`): real
servers the test starts itself, which kvroute only reaches by URL. A conversation saved
from one is restored into another of the same model; never into a server of another
model, whether it runs that model from the start or was restarted with it unseen between
two health probes (the restore is refused and counted)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp.test_utils import TestClient
from faults import FAST_HEALTH, until
from proxy_client import proxy
from proxy_client import slot_files_counted as counted
from texts import words

from backends.config import ExternalBackendConfig, KvDiskConfig
from backends.process import LlamaServerProcess, Ready, ServerSpec, free_port
from backends.supervisor import Supervisor
from proxy.config.load import Config
from proxy.config.settings import ProxySettings
from proxy.disk.records import INDEX
from proxy.server.keys import FORWARDER, ROUTER

pytestmark = pytest.mark.timeout(240)


def other_model(demo_model: Path, tmp_path: Path) -> Path:
    """The demo weights under another name: a server loads it as silently as a fine-tune
    of the same shape, and reports another model."""
    link = tmp_path / "other.gguf"
    try:
        os.link(demo_model, link)
    except OSError:  # (another file system)
        shutil.copyfile(demo_model, link)
    return link


def kvroute_over(base: Config, servers: dict[str, tuple[str, str | None]], shared: Path,
                 own: Path, **supervision: float) -> Config:
    """kvroute with only external backends {name: (url, key)}, all declaring ``shared``;
    its own kv_disk directory (for managed backends: none here) is ``own``."""
    return dataclasses.replace(
        base, backends=tuple(ExternalBackendConfig(name=n, url=u, api_key=k,
                                                   slot_save_path=shared)
                             for n, (u, k) in servers.items()),
        kv_disk=KvDiskConfig(own, save_after_idle_s=0.3, min_tokens=64),
        supervision=dataclasses.replace(base.supervision, **supervision))


def routed(client: TestClient[Any, Any]) -> list[str]:
    return list(client.server.app[ROUTER].snapshot()["backends"])  # type: ignore[call-overload]


async def chat(client: TestClient[Any, Any], messages: list[dict[str, str]]
               ) -> tuple[dict[str, Any], dict[str, str]]:
    async with client.post("/v1/chat/completions", json={
            "model": "kvroute-demo", "max_tokens": 4, "messages": messages}) as r:
        body = await r.json()
        assert r.status == 200, body
        return body, dict(r.headers)


@pytest.mark.parametrize("other", ["same model", "another model"])
async def test_a_conversation_moves_between_external_servers_by_their_shared_directory(
        pool_config: Callable[..., Config], demo_model: Path, tmp_path: Path,
        other: str) -> None:
    """Two servers started with --slot-save-path on one directory; a conversation on one,
    saved there once idle; that one stops answering (SIGSTOP): the next turn goes to the
    other, whose slot is first given the conversation from the file if it runs the same
    model (reused, predicted exactly), and not if it runs another."""
    shared = tmp_path / "shared"
    outside_cfg = pool_config(n=2, slots=1, cache_ram_mib=0, names=("x", "y"))
    if other == "another model":
        y = dataclasses.replace(outside_cfg.backends[1],
                                model=other_model(demo_model, tmp_path))
        outside_cfg = dataclasses.replace(outside_cfg, backends=(outside_cfg.backends[0], y))
    outside = Supervisor(dataclasses.replace(outside_cfg, kv_disk=KvDiskConfig(shared)))
    await outside.start()
    servers = {i.name: (i.url, i.api_key) for i in outside.ready()}
    sup = Supervisor(kvroute_over(pool_config(n=1), servers, shared, tmp_path / "own"))
    await sup.start()
    stopped = None
    try:
        settings = ProxySettings(health=FAST_HEALTH, tokenizer=demo_model)
        async with proxy(sup, settings) as client:
            await until(lambda: len(routed(client)) == 2, 30)  # (asked what they run first)
            session = [{"role": "system", "content": words(600, 10)},
                       {"role": "user", "content": words(40, 11)}]
            body, headers = await chat(client, session)
            first, previous = headers["X-Kvroute-Backend"], body["usage"]["prompt_tokens"]
            session.append({"role": "assistant", "content": "Noted."})
            store = client.server.app[FORWARDER].slot_store(first)
            assert store is not None and store.cfg.path == shared.resolve()
            await until(lambda: counted(client, "saved") >= 1, 30)
            (saved,) = json.loads((shared / INDEX).read_text())
            assert saved["backend"] == first and (shared / f"kvroute-{saved['id']}.bin").is_file()

            stopped = outside.pid(first)
            assert stopped is not None
            os.kill(stopped, signal.SIGSTOP)
            await until(lambda: first not in routed(client), 30)

            session.append({"role": "user", "content": words(20, 12)})
            body, headers = await chat(client, session)
            assert headers["X-Kvroute-Backend"] != first
            predicted, reused = int(headers["X-Kvroute-Predicted-Cached"]), \
                body["timings"]["cache_n"]
            assert abs(predicted - reused) <= 1, (predicted, reused)
            if other == "same model":
                assert headers["X-Kvroute-Tier"] == "disk"
                assert reused >= 0.9 * previous, (reused, previous)
                assert counted(client, "restored") == 1
            else:
                assert headers["X-Kvroute-Tier"] != "disk"
                assert [counted(client, e) for e in ("restored", "restore_failed")] == [0, 0]
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        await sup.stop()
        await outside.stop()


async def start_server(binary: str, model: Path, port: int, shared: Path, log: Path
                       ) -> LlamaServerProcess:
    """A llama-server on ``port`` saving slots in ``shared``, as an operator starts one."""
    proc = LlamaServerProcess(ServerSpec(
        binary=Path(binary), model=model, port=port, slots=1, ctx_per_slot=8192,
        cache_ram_mib=0, alias="kvroute-demo", slot_save_path=shared), log)
    proc.spawn()
    async with aiohttp.ClientSession() as session:
        ready = await proc.wait_ready(session, 60)
    assert isinstance(ready, Ready), ready
    return proc


def one_server(pool_config: Callable[..., Config], tmp_path: Path, **supervision: float
               ) -> tuple[str, int, Path, Config]:
    """(llama-server, a port, the shared directory, kvroute's config) for one external
    server "x" on that port, declaring that directory."""
    shared = tmp_path / "shared"
    shared.mkdir()
    base = pool_config(n=1)
    assert base.llama_server is not None
    port = free_port()
    cfg = kvroute_over(base, {"x": (f"http://127.0.0.1:{port}", None)}, shared,
                       tmp_path / "own", **supervision)
    return base.llama_server, port, shared, cfg


async def test_a_server_restarted_with_another_model_unseen_is_refused_the_file(
        pool_config: Callable[..., Config], demo_model: Path, tmp_path: Path) -> None:
    """The operator restarts the server at its URL with another model between two of
    kvroute's health probes: kvroute still takes it for the server it was, but asks it
    which model it runs before restoring into it. The file of the first model is refused
    (counted `foreign`), and kept for that model."""
    binary, port, shared, cfg = one_server(pool_config, tmp_path,
                                           health_interval_s=3600)  # (the restart: unseen)
    procs = [await start_server(binary, demo_model, port, shared, tmp_path / "x.log")]
    sup = Supervisor(cfg)
    await sup.start()
    try:
        async with proxy(sup, ProxySettings(tokenizer=demo_model)) as client:
            await until(lambda: routed(client) == ["x"], 30)
            await chat(client, [{"role": "system", "content": words(300, 20)},
                                {"role": "user", "content": words(30, 21)}])
            store = client.server.app[FORWARDER].slot_store("x")
            assert store is not None
            await until(lambda: counted(client, "saved") >= 1, 30)
            (entry,) = store.saved.values()

            await procs[0].stop()
            procs.append(await start_server(binary,
                                            other_model(demo_model, tmp_path), port,
                                            shared, tmp_path / "x2.log"))
            info = sup.get("x")
            assert info is not None  # (not seen down)
            assert await store.restore_into(info, 0, entry.file) is False
            assert counted(client, "foreign") == 1 and counted(client, "restored") == 0
            assert (shared / entry.file).is_file() and entry.id in store.saved
    finally:
        await sup.stop()
        for proc in procs:
            await proc.stop()


async def test_a_restarted_kvroute_gives_an_external_server_its_slots_back(
        pool_config: Callable[..., Config], demo_model: Path, tmp_path: Path) -> None:
    """kvroute restarts, the server does not: its slot, in use, is not overwritten at
    kvroute's start; the index in the shared directory says what the slot was saved
    with, restored with the next turn (which reuses its history, predicted exactly).
    Then the server is restarted with another model, and kvroute too: the file is not
    restored into it, and counted `foreign`. The operator's own files in the directory
    (an `index.json` of theirs) are neither read nor touched."""
    binary, port, shared, cfg = one_server(pool_config, tmp_path)
    # the operator's own files there, named as a tool of theirs might name them
    operators = {"index.json": '{"theirs": true}', "index.json.tmp": "x", "a.bin": "kv"}
    for name, text in operators.items():
        (shared / name).write_text(text)
    session = [{"role": "system", "content": words(300, 30)},
               {"role": "user", "content": words(30, 31)}]
    procs = [await start_server(binary, demo_model, port, shared, tmp_path / "x.log")]
    try:
        for run in range(3):
            if run == 2:
                await procs[-1].stop()
                procs.append(await start_server(binary,
                                                other_model(demo_model, tmp_path), port,
                                                shared, tmp_path / "x2.log"))
            sup = Supervisor(cfg)
            await sup.start()
            try:
                async with proxy(sup, ProxySettings(tokenizer=demo_model)) as client:
                    await until(lambda: routed(client) == ["x"], 30)
                    if run == 0:
                        body, _ = await chat(client, session)
                        previous = body["usage"]["prompt_tokens"]
                        session.append({"role": "assistant", "content": "Noted."})
                        await until(lambda: counted(client, "saved") >= 1, 30)
                    elif run == 1:
                        store = client.server.app[FORWARDER].slot_store("x")
                        info = sup.get("x")
                        assert store is not None and info is not None
                        await until(lambda s=store: "x" in s.models, 30)
                        # its slot holds the conversation still: not overwritten
                        assert await store.restore(info, routed=True) == []
                        session.append({"role": "user", "content": words(20, 32)})
                        body, headers = await chat(client, session)
                        # (restored with the request: the router did not know it held it)
                        assert counted(client, "restored") == 1
                        reused = body["timings"]["cache_n"]
                        predicted = int(headers["X-Kvroute-Predicted-Cached"])
                        assert reused >= 0.9 * previous and abs(predicted - reused) <= 1, \
                            (predicted, reused, previous)
                    else:
                        await until(lambda: counted(client, "foreign") == 1, 30)
                        assert counted(client, "restored") == 0
                        assert len(list(shared.glob("kvroute-*.bin"))) == 1  # kept
            finally:
                await sup.stop()
            assert {n: (shared / n).read_text() for n in operators} == operators
            assert all(p.name.startswith("kvroute") for p in shared.iterdir()
                       if p.name not in operators), sorted(os.listdir(shared))
    finally:
        for proc in procs:
            await proc.stop()


async def test_a_second_kvroute_declaring_the_same_directory_is_refused(
        pool_config: Callable[..., Config], demo_model: Path, tmp_path: Path) -> None:
    """A kvroute serves a server declaring the shared directory, and has saved its slot
    there. A second `kvroute serve` (a process of its own) declares the same directory
    for the same server: it does not start, and says which directory another kvroute
    holds; the first's files and index are as they were. Once the first stops, the
    directory is free for the next."""
    binary, port, shared, cfg = one_server(pool_config, tmp_path)
    proc = await start_server(binary, demo_model, port, shared, tmp_path / "x.log")
    second = tmp_path / "second.yaml"
    second.write_text(yaml.safe_dump({
        "proxy": {"host": "127.0.0.1", "port": free_port()},
        "log_dir": str(tmp_path / "logs2"), "kv_disk": {"path": str(tmp_path / "own2")},
        "backends": [{"name": "x", "url": f"http://127.0.0.1:{port}",
                      "slot_save_path": str(shared)}]}))
    try:
        for run in range(2):
            sup = Supervisor(cfg)
            await sup.start()
            try:
                async with proxy(sup, ProxySettings(tokenizer=demo_model)) as client:
                    await until(lambda: routed(client) == ["x"], 30)
                    if run == 1:
                        break  # (the directory was free again)
                    await chat(client, [{"role": "system", "content": words(300, 40)},
                                        {"role": "user", "content": words(30, 41)}])
                    await until(lambda: counted(client, "saved") >= 1, 30)
                    before = {p.name: p.read_bytes() for p in shared.iterdir()}
                    serve = await asyncio.create_subprocess_exec(
                        sys.executable, "-m", "proxy.cli", "serve", "--config", str(second),
                        cwd=Path(__file__).resolve().parents[2],
                        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
                    try:
                        _, err = await asyncio.wait_for(serve.communicate(), 60)
                    finally:
                        if serve.returncode is None:
                            serve.kill()
                            await serve.wait()
                    assert serve.returncode == 2, err.decode()[-2000:]
                    assert f"disk tier: {shared.resolve()} is in use by another kvroute" \
                        in err.decode(), err.decode()[-2000:]
                    assert {p.name: p.read_bytes() for p in shared.iterdir()} == before
            finally:
                await sup.stop()
    finally:
        await proc.stop()
