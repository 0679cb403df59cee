"""An external server's model, asked before a restore, when that ask is cut short: the
server was restarted with another model, unseen, and the request whose restore asked
went away while the server's loop was busy (its `/lora-adapters` answers after the
batch under way). The next ask must find the other model, not take the first for it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest
from faults import busy_slots, until
from proxy_client import proxy
from proxy_client import slot_files_counted as counted
from test_slot_shared import one_server, other_model, start_server
from texts import words

from backends.supervisor import Supervisor
from proxy.config.load import Config
from proxy.config.settings import ProxySettings
from proxy.server.keys import FORWARDER

pytestmark = pytest.mark.timeout(240)


async def test_an_identity_check_cut_short_is_asked_again_whole(
        pool_config: Callable[..., Config], demo_model: Path, tmp_path: Path) -> None:
    binary, port, shared, cfg = one_server(pool_config, tmp_path,
                                           health_interval_s=3600)  # (the restart: unseen)
    url = f"http://127.0.0.1:{port}"
    procs = [await start_server(binary, demo_model, port, shared, tmp_path / "1.log")]
    sup = Supervisor(cfg)
    await sup.start()
    try:
        async with proxy(sup, ProxySettings(tokenizer=demo_model)) as client:
            store = client.server.app[FORWARDER].slot_store("x")
            info = sup.get("x")
            assert store is not None and info is not None
            await until(lambda: "x" in store.models, 30)
            async with client.post("/v1/chat/completions", json={
                    "model": "kvroute-demo", "max_tokens": 4, "messages": [
                        {"role": "user", "content": words(300, 40)}]}) as r:
                assert r.status == 200
            await until(lambda: counted(client, "saved") >= 1, 30)
            (entry,) = store.saved.values()

            await procs[0].stop()
            procs.append(await start_server(binary, other_model(demo_model, tmp_path),
                                            port, shared, tmp_path / "2.log"))
            async with aiohttp.ClientSession() as session:
                # a long prefill holds the server's loop: /lora-adapters waits for it
                long = asyncio.create_task(session.post(url + "/completion", json={
                    "prompt": words(5000, 41), "n_predict": 1}))
                # (its prefill under way: a busy machine may take long to tokenize it)
                await until(lambda: busy_slots(info), 30, step=0.02)
                with pytest.raises(TimeoutError):  # (the request went away meanwhile)
                    await asyncio.wait_for(store.restore_into(info, 0, entry.file), 0.5)
                (await long).release()
            assert await store.restore_into(info, 0, entry.file) is False
            assert counted(client, "foreign") == 1 and counted(client, "restored") == 0
    finally:
        await sup.stop()
        for proc in procs:
            await proc.stop()
