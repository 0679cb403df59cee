"""LoRA adapters on the real pinned llama-server: what a slot's cache keeps when the
adapters a request runs under change (the demo model with the two demo adapters,
`lora: [demo, demo1]`: ids 0 and 1).

Each request is a `/completion` with cache_prompt, pinned to slot 0 of a 1-slot server
(--cache-ram 256), 1 token generated; timings.cache_n says what was reused. A request's
adapters are the set `lora: [{"id": 0, "scale": 1.0}]` names (every adapter it does not
list at scale 0); without the field, or with an empty list, the server's global set,
which `/lora-adapters` shows and POST /lora-adapters replaces (unlisted ids: 0 there too).
Adapters are loaded at scale 1, so a request without the field runs under both.

What the server does (server-context.cpp launch_slot_with_task): a request WITH the field
is compared with the set the slot's last request ran under (are_lora_equal: every scale,
exactly); another set clears the slot (cache_n 0), the same set reuses it. A request
WITHOUT the field never clears: the slot takes the global set and keeps its KV, even
KV made under other adapters, so the answer is computed over stale KV. POST
/lora-adapters clears nothing either. The host-RAM cache keys entries by tokens only:
an entry made under one set is restored for a request under another, then cleared or
kept by that same comparison with the slot's last set, not the entry's.
`--lora-init-without-apply` changes nothing a request sees (the global set still starts
at scale 1, and every batch applies its slot's set).

The outputs are the random model's noise, yet each set answers a prompt with its own
token, so an answer tells which KV it was computed over.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest_asyncio
from direct_server import DirectServer

from backends.config import ManagedBackendConfig
from backends.demo_lora import ensure_demo_lora, for_model
from backends.demo_model import DemoModelParams
from backends.supervisor import Supervisor
from proxy.config.load import Config

Lora = list[dict[str, Any]] | None
A0: Lora = [{"id": 0, "scale": 1.0}]  # adapter 0 alone
A1: Lora = [{"id": 1, "scale": 1.0}]  # adapter 1 alone
BOTH: Lora = [{"id": 0, "scale": 1.0}, {"id": 1, "scale": 1.0}]
OFF: Lora = [{"id": 0, "scale": 0.0}]  # every adapter at 0: the base model
HALF: Lora = [{"id": 0, "scale": 0.5}]


def prompt(tag: str) -> str:
    """A prompt of its own (~230 tokens): no other test's is a prefix of it."""
    return " ".join(f"{tag} word{i} token{i * 7}" for i in range(30))


class Server(DirectServer):
    async def adapters(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = await self.get("/lora-adapters")
        return out

    async def run(self, text: str, lora: Lora = None) -> tuple[int, int, str]:
        """(cache_n, prompt_n, the answer) of text under lora (None: no field)."""
        body: dict[str, Any] = {"prompt": text, "n_predict": 1, "temperature": 0,
                                "cache_prompt": True, "id_slot": 0}
        if lora is not None:
            body["lora"] = lora
        out = await self.post("/completion", body)
        return out["timings"]["cache_n"], out["timings"]["prompt_n"], out["content"]

    async def cache_n(self, text: str, lora: Lora = None) -> int:
        return (await self.run(text, lora))[0]


@asynccontextmanager
async def started(pool_config: Callable[..., Config], extra_args: tuple[str, ...] = ()
                  ) -> AsyncIterator[Server]:
    """A 1-slot llama-server of the demo model with both demo adapters."""
    loras = tuple(ensure_demo_lora(for_model(DemoModelParams(), s)) for s in (0, 1))
    cfg = pool_config(n=1, slots=1, ctx_per_slot=2048, cache_ram_mib=256)
    backend = cfg.backends[0]
    assert isinstance(backend, ManagedBackendConfig)
    cfg = dataclasses.replace(cfg, backends=(dataclasses.replace(
        backend, lora=loras, threads=2, extra_args=extra_args),))
    sup = Supervisor(cfg)
    await sup.start()
    try:
        assert len(sup.ready()) == 1, sup.statuses()
        assert sup.statuses()[0]["lora"] == [str(p) for p in loras]
        info = sup.ready()[0]
        async with aiohttp.ClientSession() as session:
            yield Server(session, info.url, str(info.api_key))
    finally:
        await sup.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def server(pool_config: Callable[..., Config]) -> AsyncIterator[Server]:
    async with started(pool_config) as srv:
        yield srv


async def n_of(server: Server, text: str) -> int:
    return len((await server.post("/tokenize", {"content": text}))["tokens"])


async def test_loaded_in_order_at_scale_1(server: Server) -> None:
    got = await server.adapters()
    assert [(a["id"], a["scale"]) for a in got] == [(0, 1.0), (1, 1.0)]
    assert got[0]["path"].endswith("-s0.gguf") and got[1]["path"].endswith("-s1.gguf")


async def test_an_adapter_clears_the_slot_then_is_reused(server: Server) -> None:
    """(a) no field twice: n - 1; (b) adapter 0: cleared; (c) adapter 0 again: n - 1."""
    text = prompt("alpha")
    n = await n_of(server, text)
    assert await server.cache_n(text) == 0
    assert await server.cache_n(text) == n - 1
    assert await server.cache_n(text, A0) == 0
    assert await server.cache_n(text, A0) == n - 1


async def test_no_field_after_an_adapter_keeps_its_kv(server: Server) -> None:
    """(d) no field after adapter 0: nothing cleared, n - 1 reused, and the answer is
    not the one the global set gives fresh (its last token ran over adapter 0's KV);
    an empty list is no field."""
    text = prompt("beta")
    n = await n_of(server, text)
    base = (await server.run(text))[2]
    assert (await server.run(text, A0))[2] != base
    cache_n, prompt_n, stale = await server.run(text)
    assert (cache_n, prompt_n) == (n - 1, 1) and stale != base
    assert await server.run(text, []) == (n - 1, 1, stale)
    # the slot now holds the global set: the same set, named, is reused
    assert await server.cache_n(text, BOTH) == n - 1


async def test_another_scale_or_set_clears(server: Server) -> None:
    """(e) scale 0.5 and 1.0 of adapter 0 are two sets; (f) so are adapter 0, adapter
    1 and both; and all at 0 (the base model) is not the global set (both at 1)."""
    text = prompt("gamma")
    n = await n_of(server, text)
    await server.run(text, A0)
    for lora in (HALF, A0, A1, A0, BOTH, A1, OFF):
        assert await server.cache_n(text, lora) == 0, lora
        assert await server.cache_n(text, lora) == n - 1, lora
    assert await server.cache_n(text) == n - 1  # no field: no clear, whatever was before
    assert await server.cache_n(text, OFF) == 0  # the global set is both at 1, not off


async def test_ram_cache_restores_across_adapters(server: Server) -> None:
    """(g) the RAM cache keys by tokens: a prompt saved under adapter 1 is restored
    for a request under adapter 0 when the slot's last request ran under 0 (n - 1, and
    an answer other than adapter 0's own), and cleared when the slot's last set differs from the
    request's, even if the entry was made under the request's own."""
    text, other = prompt("delta"), prompt("delta-other")
    n = await n_of(server, text)
    under_a0 = (await server.run(text, A0))[2]
    assert await server.cache_n(text, A1) == 0
    assert await server.cache_n(other, A0) == 0  # text goes to the RAM cache
    cache_n, _, answer = await server.run(text, A0)
    assert cache_n == n - 1 and answer != under_a0
    assert await server.cache_n(other, A1) == 0  # text (under 0 now) back to RAM
    assert await server.cache_n(text, A1) == n - 1
    assert await server.cache_n(other, A0) == 0  # text, last run under 1, to RAM
    assert await server.cache_n(text, A1) == 0  # restored, then cleared: the slot's was 0


async def test_global_scales_posted(pool_config: Callable[..., Config]) -> None:
    """(h) with --lora-init-without-apply the adapters still start at scale 1 (what
    /lora-adapters shows and a request without the field runs under). POST
    /lora-adapters replaces the global set (unlisted ids at 0) and clears nothing: the
    next request without the field reuses the slot whatever it was made under, and
    takes the new set; one naming a set is compared with the slot's as ever."""
    async with started(pool_config, ("--lora-init-without-apply",)) as server:
        assert [a["scale"] for a in await server.adapters()] == [1.0, 1.0]
        text = prompt("epsilon")
        n = await n_of(server, text)
        assert await server.cache_n(text) == 0
        assert await server.cache_n(text, BOTH) == n - 1  # the global set is both at 1
        assert await server.post("/lora-adapters", A0) == {"success": True}
        assert [a["scale"] for a in await server.adapters()] == [1.0, 0.0]
        assert await server.cache_n(text) == n - 1  # no clear: the slot takes {0: 1}
        assert await server.cache_n(text, A0) == n - 1
        assert await server.cache_n(text, BOTH) == 0
        await server.post("/lora-adapters", HALF)
        assert await server.cache_n(text) == n - 1  # made under both: kept
        assert await server.cache_n(text, HALF) == n - 1
        assert await server.cache_n(text, A0) == 0
