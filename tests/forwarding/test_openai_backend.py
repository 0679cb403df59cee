"""A backend that speaks only the OpenAI API (`kind: openai`): here a second kvroute in
front of a real llama-server, beside a managed llama-server. kvroute asks it nothing of
llama-server's (up while /v1/models answers), pins no slot there, sends it only the
OpenAI API's endpoints, and routes each conversation back to where its history is: every
later turn reuses the previous one's prompt, predicted from the model of its cache."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from itertools import pairwise
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from faults import until
from proxy_client import ProxyServer, proxy
from texts import words

from backends.config import OPENAI, ExternalBackendConfig
from backends.supervisor import Supervisor
from proxy.app import create_app
from proxy.config.load import Config
from proxy.config.settings import ProxySettings
from proxy.server.keys import ROUTER

pytestmark = pytest.mark.timeout(240)
INNER_KEY = "inner-key"


async def chat_turn(client: TestClient[Any, Any], messages: list[dict[str, str]]
                    ) -> tuple[str, int, int, int, str | None]:
    """(backend, predicted, reused, prompt tokens, slot header) of one turn."""
    # a name the OpenAI server does not serve: it is sent its own (it is strict here)
    async with client.post("/v1/chat/completions", json={
            "model": "gpt-4o", "max_tokens": 4, "messages": messages}) as r:
        body = await r.json()
        assert r.status == 200, body
        h = r.headers
    t = body["timings"]
    messages.append({"role": "assistant", "content": "Noted."})
    return (h["X-Kvroute-Backend"], int(h["X-Kvroute-Predicted-Cached"]), t["cache_n"],
            t["cache_n"] + t["prompt_n"], h.get("X-Kvroute-Slot"))


async def test_conversations_come_back_to_a_server_of_the_openai_api(
        pool_config: Callable[..., Config]) -> None:
    inner_cfg = pool_config(n=1, slots=3, cache_ram_mib=0, names=("x",))
    inner_sup = Supervisor(inner_cfg)
    await inner_sup.start()
    inner = ProxyServer(create_app(inner_cfg, inner_sup, ProxySettings(
        api_keys=(INNER_KEY,), strict_models=True)))
    await inner.start_server()
    base = pool_config(n=1, slots=3, cache_ram_mib=0)
    other = ExternalBackendConfig(name="o", url=f"http://127.0.0.1:{inner.port}",
                                  api_key=INNER_KEY, kind=OPENAI, sequences=3, ctx=8192)
    outer_sup = Supervisor(dataclasses.replace(base, backends=(*base.backends, other)))
    await outer_sup.start()
    try:
        async with proxy(outer_sup) as client:
            router = client.server.app[ROUTER]
            await until(lambda: set(router.snapshot()["backends"]) == {"a", "o"}, 30)
            convs = [[{"role": "system", "content": words(300, 300 + i)},
                      {"role": "user", "content": words(30, 310 + i)}] for i in range(4)]
            # first turns together: they spread over both backends
            turns = [[t] for t in await asyncio.gather(*(chat_turn(client, c) for c in convs))]
            for k in range(5):
                for i, c in enumerate(convs):
                    c.append({"role": "user", "content": words(20, 400 + 10 * k + i)})
                    turns[i].append(await chat_turn(client, c))
            for i in range(3):  # llama-server's own endpoint: never to the OpenAI server
                async with client.post("/completion", json={
                        "prompt": words(50, 500 + i), "n_predict": 2}) as r:
                    assert r.status == 200 and r.headers["X-Kvroute-Backend"] == "a"
            async with client.get("/kvroute/status") as r:
                kinds = {b["name"]: b["kind"] for b in (await r.json())["backends"]}
            async with client.get("/metrics") as r:
                metrics = await r.text()
    finally:
        await outer_sup.stop()
        await inner.close()
        await inner_sup.stop()
    assert kinds == {"a": "llama", "o": "openai"}
    # the llama-server's own families only (the inner kvroute's would collide with ours)
    types = [line.split()[2] for line in metrics.splitlines() if line.startswith("# TYPE ")]
    assert len(types) == len(set(types))
    assert 'kvroute_backend_metrics_up{backend="a"} 1.0' in metrics
    assert 'backend="o"' not in metrics.split("kvroute_backend_metrics_up")[-1]
    assert {t[0][0] for t in turns} == {"a", "o"}, turns
    for conv in turns:
        where = {t[0] for t in conv}
        assert len(where) == 1, conv  # each conversation stays with its history
        for prev, (backend, predicted, reused, _, slot) in pairwise(conv):
            assert reused >= 0.9 * prev[3], conv
            assert abs(predicted - reused) <= max(16, 0.02 * reused), conv
            assert (slot is None) == (backend == "o")  # no slot is pinned there


async def test_with_no_tokenizer_and_no_llama_server_requests_are_served_unrouted(
        pool_config: Callable[..., Config]) -> None:
    """Only a server of the OpenAI API, no GGUF to tokenize with, none to ask for the ids:
    served without prefix routing, not refused."""
    inner_cfg = pool_config(n=1, slots=1, cache_ram_mib=0, names=("x",))
    inner_sup = Supervisor(inner_cfg)
    await inner_sup.start()
    inner = ProxyServer(create_app(inner_cfg, inner_sup, ProxySettings(api_keys=(INNER_KEY,))))
    await inner.start_server()
    only = ExternalBackendConfig(name="o", url=f"http://127.0.0.1:{inner.port}",
                                 api_key=INNER_KEY, kind=OPENAI)
    outer_sup = Supervisor(dataclasses.replace(inner_cfg, backends=(only,)))
    await outer_sup.start()
    try:
        async with proxy(outer_sup) as client:
            await until(lambda: client.server.app[ROUTER].backends == ["o"], 30)
            async with client.post("/v1/chat/completions", json={
                    "model": "any", "max_tokens": 2,
                    "messages": [{"role": "user", "content": words(20, 700)}]}) as r:
                assert r.status == 200, await r.text()
            async with client.post("/tokenize", json={"content": "hi"}) as r:
                assert r.status == 503  # llama-server's own: no llama-server to ask
    finally:
        await outer_sup.stop()
        await inner.close()
        await inner_sup.stop()
