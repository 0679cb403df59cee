"""An activated LoRA (aLoRA) through kvroute, on a real llama-server with the demo plain
adapter (id 0) and the demo aLoRA (id 1, invoked by " certainty check:"): what each
request reuses is predicted, and what the server reports shows its rules
(proxy/routing/cache/lora.py): a conversation under the base model asks the aLoRA
(kept: an aLoRA leaves the KV before its invocation as the base model makes it), goes on
under the base model (cleared), asks the aLoRA without its invocation (kept, and run as
the base model: the slot's set is then the base model's, so the base model's next turn
keeps it too).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient
from proxy_client import chat_turn, serving
from texts import words

from backends.config import ManagedBackendConfig
from backends.demo_lora import DEMO_INVOCATION, DEMO_LORAS, ensure_demo_lora, for_model
from backends.demo_model import DemoModelParams
from proxy.config.load import Config
from proxy.server.keys import SUPERVISOR

pytestmark = pytest.mark.timeout(180)

BASE = [{"id": 0, "scale": 0.0}]  # every adapter at 0
ALORA = [{"id": 1, "scale": 1.0}]
PLAIN = [{"id": 0, "scale": 1.0}]
INVOKE = " certainty check:"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def client(pool_config: Callable[..., Config]) -> AsyncIterator[TestClient[Any, Any]]:
    """kvroute in front of one fresh 1-slot demo server with the plain and the aLoRA
    demo adapters, no RAM tier."""
    loras = tuple(ensure_demo_lora(for_model(DemoModelParams(), DEMO_LORAS[name]))
                  for name in ("demo", "demo-alora"))
    cfg = pool_config(n=1, slots=1, ctx_per_slot=4096, cache_ram_mib=0)
    backends = tuple(dataclasses.replace(b, lora=loras) for b in cfg.backends
                     if isinstance(b, ManagedBackendConfig))
    async with serving(dataclasses.replace(cfg, backends=backends)) as c:
        (info,) = c.server.app[SUPERVISOR].ready()
        assert info.alora == ((), DEMO_INVOCATION), info  # (read from /lora-adapters)
        yield c


async def turn(client: TestClient[Any, Any], messages: list[dict[str, Any]],
               lora: list[dict[str, Any]]) -> tuple[int, int, int, str]:
    """(predicted, reported, prompt tokens, answer) of one chat turn under ``lora``."""
    t = await chat_turn(client, {"model": "kvroute-demo", "max_tokens": 3, "temperature": 0,
                                 "messages": messages, "lora": lora})
    return t.predicted, t.reported, t.prompt_tokens, t.answer


async def test_a_conversation_asks_the_alora_and_goes_on(client: TestClient[Any, Any]
                                                         ) -> None:
    history = [{"role": "system", "content": words(200, 71)},
               {"role": "user", "content": words(30, 72)}]
    first = await turn(client, history, BASE)
    history.append({"role": "assistant", "content": first[3]})
    asked = await turn(client, [*history, {"role": "user", "content": words(10, 73) + INVOKE}],
                       ALORA)
    on = await turn(client, [*history, {"role": "user", "content": words(10, 74)}], BASE)
    rows = [first, asked, on]
    for lora in (ALORA, BASE, PLAIN):  # the same prompt: no invocation in it
        rows.append(await turn(client, [*history, {"role": "user", "content": words(12, 75)}],
                               lora))
    assert [p for p, *_ in rows] == [r for _, r, *_ in rows], rows
    assert rows[1][1] > 230, rows  # base -> aLoRA: kept, up to its invocation
    assert rows[2][1] == 0, rows  # aLoRA -> base: cleared
    assert rows[3][1] > 230, rows  # base -> aLoRA: kept
    assert rows[4][1] > 230, rows  # not invoked: the slot's set is the base model's
    assert rows[5][1] == 0, rows  # base -> plain: cleared


async def test_the_alora_runs_only_from_its_invocation(client: TestClient[Any, Any]
                                                       ) -> None:
    """The same invoking prompt twice: the second reuses only what lies before the
    invocation (the server caps it there, though it holds all of it)."""
    messages = [{"role": "user", "content": words(120, 81) + INVOKE + " " + words(5, 82)}]
    rows = [await turn(client, messages, ALORA) for _ in range(2)]
    assert [p for p, *_ in rows] == [r for _, r, *_ in rows], rows
    n = rows[1][2]
    assert 100 < rows[1][1] < n - 10, rows  # (without the cap: n - 1)
