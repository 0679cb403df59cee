"""Model pools: two models in one kvroute (the demo model on two backends, the
demo-coder model, another vocabulary and template, on a third), each request routed in
the pool its `model` names, tokenized with that pool's GGUF and predicted exactly there;
a name no pool serves is a 404 listing those they do; with one pool any name works."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from proxy_client import proxy
from texts import words

from backends.config import ExternalBackendConfig
from backends.demo_model import ensure_demo_model
from backends.process import free_port
from backends.supervisor import Supervisor
from proxy.config.load import Config
from proxy.config.pools import derive_pools
from proxy.server.keys import POOLS

pytestmark = pytest.mark.timeout(240)
DEMO, CODER = "kvroute-demo", "kvroute-demo-coder"


async def turn(client: TestClient[Any, Any], model: str, messages: list[dict[str, str]]
               ) -> tuple[int, str, int, int]:
    """(status, backend, predicted, reused) of one chat turn."""
    async with client.post("/v1/chat/completions", json={
            "model": model, "max_tokens": 2, "messages": messages}) as r:
        body = await r.json()
        if r.status != 200:
            return r.status, "", 0, 0
        messages.append({"role": "assistant", "content": "Noted."})
        return (200, r.headers["X-Kvroute-Backend"],
                int(r.headers["X-Kvroute-Predicted-Cached"]), body["timings"]["cache_n"])


async def test_two_pools_route_and_predict_each_on_its_own(
        pool_config: Callable[..., Config]) -> None:
    base = pool_config(n=3, slots=2, cache_ram_mib=0)
    a, b, c = base.backends
    coder = dataclasses.replace(c, model=ensure_demo_model(kind="demo-coder"), alias=CODER,
                                aliases=("coder",))
    ghost = ExternalBackendConfig(name="g", url=f"http://127.0.0.1:{free_port()}",
                                  alias="ghost")  # nothing listens there
    cfg = dataclasses.replace(base, backends=(a, b, coder, ghost))
    assert [(p.name, p.backends) for p in cfg.pools()] == \
        [(DEMO, ("a", "b")), (CODER, ("c",)), ("ghost", ("g",))]
    sup = Supervisor(cfg)
    await sup.start()
    try:
        async with proxy(sup) as client:
            pools = client.server.app[POOLS]
            # each pool's own vocabulary: the same text, other ids
            assert pools.first.tok.prompt is not None
            assert pools.of_backend("c").tok.prompt.tokenizer.n_vocab != \
                pools.first.tok.prompt.tokenizer.n_vocab  # type: ignore[union-attr]
            convs = {m: [{"role": "system", "content": words(200, 600)},
                         {"role": "user", "content": words(30, 601)}]
                     for m in (DEMO, CODER, "coder")}
            seen: dict[str, list[tuple[int, str, int, int]]] = {m: [] for m in convs}
            for k in range(3):
                for m, conv in convs.items():
                    seen[m].append(await turn(client, m, conv))
                    conv.append({"role": "user", "content": words(10, 610 + k)})
            async with client.post("/v1/chat/completions", json={
                    "model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}) as r:
                unknown = (r.status, await r.json())
            async with client.get("/v1/models") as r:
                listed = {m["id"] for m in (await r.json())["data"]}
            for path, fmt in (("/v1/chat/completions", "server_error"),
                              ("/v1/messages", "overloaded_error")):
                async with client.post(path, json={
                        "model": "ghost", "max_tokens": 2,
                        "messages": [{"role": "user", "content": "hi"}]}) as r:
                    err = await r.json()
                    assert r.status == 503 and "ghost" in str(err), err
                    assert err["error"]["type"] == fmt, err
            async with client.get("/metrics") as r:
                text = await r.text()
            async with client.get("/health") as r:
                assert (await r.json())["pools"] == {DEMO: 2, CODER: 1, "ghost": 0}
            assert f'kvroute_pool_backends{{pool="{DEMO}"}} 2.0' in text
            assert f'kvroute_pool_backends{{pool="{CODER}"}} 1.0' in text
            async with client.get("/kvroute/status") as r:
                status = await r.json()
            assert [(p["name"], p["backends"]) for p in status["pools"]] == \
                [(DEMO, ["a", "b"]), (CODER, ["c"]), ("ghost", ["g"])]
            assert {b["name"]: b["pool"] for b in status["backends"]} == \
                {"a": DEMO, "b": DEMO, "c": CODER, "g": "ghost"}
            async with client.post("/completion", json={
                    "model": "coder", "prompt": words(40, 620), "n_predict": 2}) as r:
                assert r.status == 200 and r.headers["X-Kvroute-Backend"] == "c"
    finally:
        await sup.stop()
    for m, turns in seen.items():
        assert all(t[0] == 200 for t in turns), (m, turns)
        where = {t[1] for t in turns}
        assert where <= ({"a", "b"} if m == DEMO else {"c"}), (m, turns)
        for _, _, predicted, reused in turns[1:]:
            assert reused > 0 and abs(predicted - reused) <= 1, (m, turns)
    assert unknown[0] == 404 and unknown[1]["error"]["code"] == "model_not_found"
    assert "kvroute-demo-coder" in unknown[1]["error"]["message"]
    assert {DEMO, CODER, "coder"} <= listed


async def test_with_one_pool_any_model_name_is_served(backend_pool: Any) -> None:
    sup: Supervisor = await backend_pool()
    async with proxy(sup) as client:
        for model in ("gpt-4o", "claude-sonnet-4-5", ""):
            async with client.post("/v1/chat/completions", json={
                    "model": model, "max_tokens": 1,
                    "messages": [{"role": "user", "content": "hi"}]}) as r:
                assert r.status == 200, await r.text()


def test_a_pool_of_two_ggufs_is_a_config_error(pool_config: Callable[..., Config]) -> None:
    base = pool_config(n=2)
    a, b = base.backends
    other = dataclasses.replace(b, model=ensure_demo_model(kind="demo-coder"))
    with pytest.raises(ValueError, match=r"backends\[0\] and backends\[1\]: both serve "
                                         r"'kvroute-demo' but run different GGUFs"):
        derive_pools((a, other))
