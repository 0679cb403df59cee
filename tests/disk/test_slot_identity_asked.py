"""An external server routed before kvroute knows it: a server that does not say which
model it runs (`slot.model_unknown`) is asked again; the turns routed to it while it is
being asked are saved once it says; and a slot given a request while kvroute asks
whether it is empty, to restore its file, is not restored over that request.

The server is a real llama-server, reached through a front (a real aiohttp server) that
passes everything through except, when told: `/v1/models` fails, `/lora-adapters`
waits, or `/slots`' answer is held. Only the front can have the server fail or stall
those at a chosen moment."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
import structlog
from aiohttp import web
from faults import FAST_HEALTH, until
from proxy_client import proxy
from proxy_client import slot_files_counted as counted
from test_slot_shared import chat, kvroute_over, routed, start_server
from texts import words

from backends.process import free_port
from backends.supervisor import Supervisor
from proxy.config.load import Config
from proxy.config.settings import ProxySettings
from proxy.disk.records import INDEX
from proxy.observability.logging import configure_logging
from proxy.server.keys import FORWARDER

pytestmark = pytest.mark.timeout(240)
Restart = Callable[[], Awaitable[None]]


class Front:
    """What reaches the server behind it: each path's requests (``asked``);
    `/v1/models` answers 503 while ``models_down`` (the identity's ask alone uses it
    here: the supervisor's probe and kvroute's prober do not); `/lora-adapters` waits
    for ``adapters``; `/slots`' answer, read at once, is held until ``slots``."""

    def __init__(self, real: str, session: aiohttp.ClientSession) -> None:
        self.real, self.session = real, session
        self.asked: Counter[str] = Counter()
        self.models_down = False
        self.adapters, self.slots = asyncio.Event(), asyncio.Event()
        self.adapters.set()
        self.slots.set()

    async def handle(self, request: web.Request) -> web.Response:
        self.asked[request.path] += 1
        if request.path == "/v1/models" and self.models_down:
            return web.json_response({"error": {"message": "loading"}}, status=503)
        if request.path == "/lora-adapters":
            await self.adapters.wait()
        async with self.session.request(
                request.method, self.real + request.path_qs, data=await request.read(),
                headers={k: v for k, v in request.headers.items()
                         if k in ("Authorization", "Content-Type")}) as r:
            body = await r.read()
        if request.path == "/slots":
            await self.slots.wait()
        return web.Response(body=body, status=r.status, content_type=r.content_type)


@asynccontextmanager
async def front_of(real: str) -> AsyncIterator[tuple[Front, str]]:
    async with aiohttp.ClientSession() as session:
        front = Front(real, session)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", front.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            yield front, f"http://127.0.0.1:{port}"
        finally:
            await runner.cleanup()


@asynccontextmanager
async def fronted(pool_config: Callable[..., Config], demo_model: Path, tmp_path: Path,
                  save_after_idle_s: float | None = None
                  ) -> AsyncIterator[tuple[Front, Supervisor, Path, Restart]]:
    """A llama-server saving slots in a shared directory, its front, kvroute's
    Supervisor for it (external "x" at the front, declaring that directory; not
    started), and what restarts the server at its port (its slots empty)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    base = pool_config(n=1)
    binary = base.llama_server
    assert binary is not None
    port = free_port()
    procs = [await start_server(binary, demo_model, port, shared, tmp_path / "x.log")]

    async def restart() -> None:
        await procs[-1].stop()
        procs.append(await start_server(binary, demo_model, port, shared,
                                        tmp_path / f"x{len(procs)}.log"))

    try:
        async with front_of(f"http://127.0.0.1:{port}") as (front, url):
            cfg = kvroute_over(base, {"x": (url, None)}, shared, tmp_path / "own")
            if save_after_idle_s is not None:
                assert cfg.kv_disk is not None
                cfg = dataclasses.replace(cfg, kv_disk=dataclasses.replace(
                    cfg.kv_disk, save_after_idle_s=save_after_idle_s))
            yield front, Supervisor(cfg), shared, restart
    finally:
        for proc in procs:
            await proc.stop()


def turn(n: int, seed: int = 50) -> list[dict[str, str]]:
    """A conversation's first ``n`` user turns (each answered "Noted.")."""
    out = [{"role": "system", "content": words(300, seed)}]
    for i in range(n):
        out += [{"role": "user", "content": words(30, seed + 1 + i)},
                {"role": "assistant", "content": "Noted."}]
    return out[:-1]


@pytest.mark.parametrize("identity_comes", ["before the save is due", "while it is due"])
async def test_turns_routed_while_the_identity_is_asked_are_saved(
        pool_config: Callable[..., Config], demo_model: Path, tmp_path: Path,
        identity_comes: str) -> None:
    """The server is routed at once, its identity asked in the background: its
    `/lora-adapters` waits (the server's loop is busy). A turn ends meanwhile. Whether the
    identity comes before that turn's save is due or while the save is waiting for it,
    the turn is saved, once."""
    due = 3.0 if identity_comes == "before the save is due" else None
    async with fronted(pool_config, demo_model, tmp_path, due) as (front, sup, shared, _):
        front.adapters.clear()
        await sup.start()
        try:
            async with proxy(sup, ProxySettings(health=FAST_HEALTH,
                                                tokenizer=demo_model)) as client:
                await until(lambda: routed(client) == ["x"] and front.asked["/lora-adapters"],
                            30)
                await chat(client, turn(1))
                store = client.server.app[FORWARDER].slot_store("x")
                assert store is not None and "x" not in store.models
                if due is None:  # (the save is due, and waits for the identity)
                    await asyncio.sleep(3 * store.cfg.save_after_idle_s)
                front.adapters.set()
                await until(lambda: "x" in store.models, 30)
                await until(lambda: counted(client, "saved") >= 1, 30)
                assert counted(client, "saved") == 1
                assert len(list(shared.glob("kvroute-*.bin"))) == 1
        finally:
            front.adapters.set()
            await sup.stop()


async def test_a_server_that_does_not_say_its_model_is_asked_again(
        pool_config: Callable[..., Config], demo_model: Path, tmp_path: Path) -> None:
    """The server's `/v1/models` fails when it becomes ready: `slot.model_unknown` is logged
    with the reason and the fix, it is routed, and its turns are not saved (what computed
    them is unknown); asked again (at the next save once `Identities.retry_s` passed) while
    it still fails, still nothing. Once it answers, the next turn's save learns the model
    and is made."""
    out = io.StringIO()
    saved_logging = structlog.get_config()
    configure_logging("info", stream=out)
    try:
        async with fronted(pool_config, demo_model, tmp_path) as (front, sup, shared, _):
            front.models_down = True
            await sup.start()
            try:
                async with proxy(sup, ProxySettings(health=FAST_HEALTH,
                                                    tokenizer=demo_model)) as client:
                    await until(lambda: '"slot.model_unknown"' in out.getvalue(), 30)
                    (line,) = [json.loads(x) for x in out.getvalue().splitlines()
                               if '"slot.model_unknown"' in x]
                    assert line["backend"] == "x" and "/v1/models" in line["reason"] \
                        and "absolute path" in line["fix"], line
                    assert routed(client) == ["x"]
                    store = client.server.app[FORWARDER].slot_store("x")
                    assert store is not None
                    store.identities.retry_s = 0.0  # (every save asks)
                    asked = front.asked["/v1/models"]
                    await chat(client, turn(1))
                    await until(lambda: front.asked["/v1/models"] > asked, 30)
                    front.models_down = False
                    await chat(client, turn(2))
                    await until(lambda: counted(client, "saved") >= 1, 30)
                    assert "x" in store.models
                    # (the first turn's save was never made: no file replaced by this one)
                    assert counted(client, "saved") == 1 and len(store.saved) == 1
                    assert len(list(shared.glob("kvroute-*.bin"))) == 1
            finally:
                await sup.stop()
    finally:
        structlog.configure(**saved_logging)



async def test_a_slot_routed_while_its_emptiness_is_asked_is_not_restored_over(
        pool_config: Callable[..., Config], demo_model: Path, tmp_path: Path) -> None:
    """kvroute has saved a conversation's slot; the server and kvroute restart. kvroute
    asks the server whether the slot is still empty before restoring the file into
    it, and the answer takes a while (the server's loop answers `/slots`): meanwhile
    another conversation is routed to that slot and answered. The file is not restored
    over it: that conversation's next turn reuses what it was predicted to."""
    async with fronted(pool_config, demo_model, tmp_path) as (front, sup, shared, restart):
        for run in range(2):
            if run == 1:
                await restart()
                sup = Supervisor(sup.config)
                front.slots.clear()
            asked = front.asked["/slots"]
            await sup.start()
            try:
                async with proxy(sup, ProxySettings(health=FAST_HEALTH,
                                                    tokenizer=demo_model)) as client:
                    await until(lambda: routed(client) == ["x"], 30)
                    if run == 0:
                        await chat(client, turn(1))
                        await until(lambda: counted(client, "saved") >= 1, 30)
                        continue
                    await until(lambda a=asked: front.asked["/slots"] > a, 30)
                    await chat(client, turn(1, seed=60))
                    index = shared / INDEX  # (written when the restores are done)
                    written = index.stat()
                    front.slots.set()
                    await until(lambda i=index, w=written: i.stat() != w, 30)
                    body, headers = await chat(client, turn(2, seed=60))
                    predicted = int(headers["X-Kvroute-Predicted-Cached"])
                    reused = body["timings"]["cache_n"]
                    assert predicted > 0 and abs(predicted - reused) <= 1, \
                        (predicted, reused)
                    assert counted(client, "restored") == 0
            finally:
                front.slots.set()
                await sup.stop()
