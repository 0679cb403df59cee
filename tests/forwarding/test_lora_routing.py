"""Requests naming LoRA adapters, through kvroute, on real llama-servers with the two demo
adapters: what each reuses is predicted (a slot whose last request ran under another set
is cleared by the server), conversations under different sets keep their own slots, and
`/lora-adapters` sets the global scales of every server of the pool.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient
from proxy_client import chat_turn, serving
from texts import words

from backends.config import ManagedBackendConfig
from backends.demo_lora import ensure_demo_lora, for_model
from backends.demo_model import DemoModelParams
from proxy.config.load import Config
from proxy.server.keys import SUPERVISOR

pytestmark = pytest.mark.timeout(180)

A0 = [{"id": 0, "scale": 1.0}]
A1 = [{"id": 1, "scale": 1.0}]


@asynccontextmanager
async def with_adapters(pool_config: Callable[..., Config], n: int, slots: int,
                        cache_ram_mib: int) -> AsyncIterator[TestClient[Any, Any]]:
    """kvroute in front of ``n`` fresh demo servers of ``slots`` slots with both demo
    adapters."""
    loras = tuple(ensure_demo_lora(for_model(DemoModelParams(), s)) for s in (0, 1))
    cfg = pool_config(n=n, slots=slots, ctx_per_slot=4096, cache_ram_mib=cache_ram_mib)
    backends = tuple(dataclasses.replace(b, lora=loras) for b in cfg.backends
                     if isinstance(b, ManagedBackendConfig))
    async with serving(dataclasses.replace(cfg, backends=backends)) as c:
        assert all(info.lora == (1.0, 1.0) for info in c.server.app[SUPERVISOR].ready())
        yield c


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def client(pool_config: Callable[..., Config]) -> AsyncIterator[TestClient[Any, Any]]:
    async with with_adapters(pool_config, 2, 2, 64) as c:
        yield c


async def ask(client: TestClient[Any, Any], messages: list[dict[str, Any]],
              lora: list[dict[str, Any]] | None) -> tuple[int, int, str, str]:
    """(predicted, reported, backend, answer) of one chat turn."""
    body: dict[str, Any] = {"model": "kvroute-demo", "max_tokens": 3, "temperature": 0,
                            "messages": messages}
    if lora is not None:
        body["lora"] = lora
    t = await chat_turn(client, body)
    return t.predicted, t.reported, t.backend, t.answer


def close(predicted: int, reported: int) -> bool:
    return abs(predicted - reported) <= 16


async def test_another_set_is_a_cold_start_and_predicted(client: TestClient[Any, Any]
                                                          ) -> None:
    """One prompt under adapter 0, adapter 1, then 0 again: the server clears the slot
    at each change; every turn is predicted, and the router sends the third to the
    slot still holding the prompt under adapter 0 when it can."""
    messages = [{"role": "system", "content": words(200, 1)},
                {"role": "user", "content": words(20, 2)}]
    rows = [await ask(client, messages, lora) for lora in (A0, A0, A1, A0, A1)]
    assert all(close(p, r) for p, r, _, _ in rows), rows
    assert rows[0][1] < 16 and rows[1][1] > 200, rows  # (cold, then reused)
    assert rows[2][1] < rows[1][1] - 200, rows  # another set reuses none of adapter 0's KV
    assert rows[3][1] > 200 and rows[4][1] > 200, rows  # each set's slot kept


async def test_conversations_under_two_sets_and_none(pool_config: Callable[..., Config]
                                                     ) -> None:
    """Three conversations over one system prompt, one per set (adapter 0, adapter 1,
    none named), turns interleaved, on fresh servers (2 x 2 slots: one each): every turn
    predicted, and each conversation's later turns go on from its own history."""
    async with with_adapters(pool_config, 2, 2, 64) as client:
        await _three_conversations(client)


async def _three_conversations(client: TestClient[Any, Any]) -> None:
    system = {"role": "system", "content": words(150, 3)}
    convs: list[tuple[list[dict[str, Any]] | None, list[dict[str, Any]]]] = [
        (A0, [system]), (A1, [system]), (None, [system])]
    rows: list[tuple[int, int, int, str, int]] = []
    for turn in range(4):
        for k, (lora, messages) in enumerate(convs):
            messages.append({"role": "user", "content": words(25, 100 * k + turn)})
            predicted, reported, backend, answer = await ask(client, messages, lora)
            rows.append((turn, predicted, reported, backend, k))
            messages.append({"role": "assistant", "content": answer})
    assert all(close(p, r) for _, p, r, _, _ in rows), rows
    later = [r for t, _, r, _, _ in rows if t >= 2]
    assert min(later) > 150, rows  # each goes on from its own history


async def test_global_scales_are_set_on_every_server(client: TestClient[Any, Any]) -> None:
    """POST /lora-adapters reaches both servers; a request naming no adapters then runs
    under adapter 0 alone, so one naming adapter 0 goes on from its slot (predicted)."""
    async with client.get("/lora-adapters") as r:
        assert [(a["id"], a["scale"]) for a in await r.json()] == [(0, 1.0), (1, 1.0)]
    async with client.post("/lora-adapters", data=b'{"id": 0}') as r:
        assert r.status == 400 and "must be an array" in (await r.json())["error"]["message"]
    async with client.post("/lora-adapters", json=A0) as r:
        assert r.status == 200, await r.text()
    try:
        async with client.get("/kvroute/status") as r:
            scales = [b["lora_scales"] for b in (await r.json())["backends"]]
        assert scales == [[1.0, 0.0], [1.0, 0.0]]
        sup = client.server.app[SUPERVISOR]
        async with aiohttp.ClientSession() as session:
            for info in sup.ready():
                async with session.get(info.url + "/lora-adapters", headers={
                        "Authorization": f"Bearer {info.api_key}"}) as r:
                    assert [a["scale"] for a in await r.json()] == [1.0, 0.0], info.name
        messages = [{"role": "system", "content": words(180, 7)},
                    {"role": "user", "content": words(20, 8)}]
        rows = [await ask(client, messages, lora) for lora in (None, A0, A1, None)]
        assert all(close(p, r) for p, r, _, _ in rows), rows
        assert rows[1][1] > 180, rows  # the set the unnamed request ran under: reused
    finally:
        async with client.post("/lora-adapters", json=[{"id": 0, "scale": 1.0},
                                                       {"id": 1, "scale": 1.0}]) as r:
            assert r.status == 200


async def test_scales_set_behind_kvroutes_back_are_found(client: TestClient[Any, Any]
                                                         ) -> None:
    """Scales POSTed to one server itself are read back within seconds (the watch),
    and are what kvroute names for that server from then on."""
    sup = client.server.app[SUPERVISOR]
    info = next(i for i in sup.ready() if i.name == "a")
    headers = {"Authorization": f"Bearer {info.api_key}"}

    async def scales() -> list[list[float]]:
        async with client.get("/kvroute/status") as r:
            return [b["lora_scales"] for b in (await r.json())["backends"]]

    async with aiohttp.ClientSession() as session:
        async with session.post(info.url + "/lora-adapters", json=A1, headers=headers) as r:
            assert r.status == 200
        try:
            for _ in range(40):
                if await scales() == [[0.0, 1.0], [1.0, 1.0]]:
                    break
                await asyncio.sleep(0.25)
            assert await scales() == [[0.0, 1.0], [1.0, 1.0]]
        finally:
            async with session.post(info.url + "/lora-adapters", headers=headers, json=[
                    {"id": 0, "scale": 1.0}, {"id": 1, "scale": 1.0}]) as r:
                assert r.status == 200


async def test_what_the_server_refuses_is_sent_as_it_is(client: TestClient[Any, Any]
                                                        ) -> None:
    """A `lora` the server refuses (not a list) gets its answer: kvroute names no
    scales in its place."""
    body = {"model": "kvroute-demo", "max_tokens": 1, "lora": {"id": 0},
            "messages": [{"role": "user", "content": "hi"}]}
    async with client.post("/v1/chat/completions", json=body) as r:
        assert r.status in (400, 500), await r.text()
        assert "lora" in (await r.json())["error"]["message"]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def one_slot(pool_config: Callable[..., Config]
                   ) -> AsyncIterator[TestClient[Any, Any]]:
    async with with_adapters(pool_config, 1, 1, 0) as c:
        yield c


async def test_a_request_naming_no_adapters_never_runs_over_anothers_kv(
        one_slot: TestClient[Any, Any]) -> None:
    """One slot: a prompt without `lora`, the same under adapter 0, then again without:
    the server alone would reuse adapter 0's KV for the third and answer otherwise than
    the first; through kvroute it is cleared (as predicted) and answers as the first."""
    messages = [{"role": "user", "content": words(60, 91)}]
    first = await ask(one_slot, messages, None)
    under_a0 = await ask(one_slot, messages, A0)
    third = await ask(one_slot, messages, None)
    assert under_a0[3] != first[3], (first, under_a0)  # (each set answers its own)
    assert third[:2] == (0, 0) and third[3] == first[3], (first, third)


async def test_a_ram_entry_made_under_another_set_is_never_run_over(
        pool_config: Callable[..., Config]) -> None:
    """One server, two slots, a RAM tier. A conversation under adapter 1 leaves its
    state in RAM (saved as an idle slot when the next request starts); slot 1 last ran
    under adapter 0. The conversation's system prompt under adapter 0 then: a slot of
    adapter 1 is cleared for it, and the server would load the entry into slot 1 and
    run over adapter 1's KV (its tokens alone match). It is recomputed instead (sent
    with cache_prompt false): it reuses only the template's first tokens, as predicted,
    and answers as when computed alone."""
    system = {"role": "system", "content": words(300, 61)}
    async with with_adapters(pool_config, 1, 2, 64) as client:
        await ask(client, [system, {"role": "user", "content": words(20, 62)}], A1)
        await ask(client, [{"role": "user", "content": words(200, 63)}], A0)
        messages = [system, {"role": "user", "content": words(20, 64)}]
        predicted, reported, _, answer = await ask(client, messages, A0)
        alone = await chat_turn(client, {
            "model": "kvroute-demo", "max_tokens": 3, "temperature": 0, "lora": A0,
            "cache_prompt": False, "messages": messages})
    assert answer == alone.answer, (answer, alone)
    assert predicted == reported <= 8, (predicted, reported)
