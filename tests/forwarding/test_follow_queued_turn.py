"""A conversation's next turn sent while its previous turn still waits for a slot in the
proxy: it follows that turn, and is served after it in its slot, reusing its prompt."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from faults import until
from proxy_client import proxy
from texts import words

from proxy.server.keys import ROUTER

pytestmark = pytest.mark.timeout(240)


def chat(messages: list[str], max_tokens: int) -> dict[str, Any]:
    return {"model": "kvroute-demo", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": m} for m in messages]}


class Answer:
    """One request's answer: where it ran, what was predicted and reported, when it
    ended."""

    def __init__(self, headers: Any, body: str) -> None:
        self.ended = time.monotonic()
        self.slot = int(headers["X-Kvroute-Slot"])
        self.predicted = int(headers["X-Kvroute-Predicted-Cached"])
        usage = [json.loads(line[6:]) for line in body.splitlines()
                 if line.startswith("data: {")][-1]["usage"]
        self.prompt = usage["prompt_tokens"]
        self.cached = usage["prompt_tokens_details"]["cached_tokens"]


async def ask(client: Any, messages: list[str], max_tokens: int = 1) -> Answer:
    async with client.post("/v1/chat/completions", json=chat(messages, max_tokens)) as r:
        assert r.status == 200, await r.text()
        return Answer(r.headers, await r.text())


async def test_a_turn_sent_while_its_predecessor_waits_follows_it(backend_pool: Any
                                                                  ) -> None:
    """Both slots of one backend busy generating (the first to end long before the
    second); turn A (1,500 words) waits for a slot; its next turn B (A's messages and
    one more) is sent while A waits. A is handed the first slot to free; the second
    frees while A is still generating. Handed that one, B reused nothing of A's prompt,
    which no slot held when B was decided; following A, B waits for A's slot and is
    handed it once A ends, reusing A's prompt there, as predicted."""
    sup = await backend_pool(n=1, slots=2, ctx_per_slot=8192, fresh=True)
    a_text, more = words(1500, 11), words(20, 12)
    async with proxy(sup) as client:
        router = client.server.app[ROUTER]
        for seed in (13, 14):  # (the backend's prefill rate and service time are learned)
            await ask(client, [words(300, seed)])
        long = [asyncio.create_task(ask(client, [words(20, 15 + i)], 100 + 200 * i))
                for i in range(2)]
        await until(lambda: router.snapshot()["inflight"] == 2, 30, step=0.01)
        a = asyncio.create_task(ask(client, [a_text], 500))
        await until(lambda: router.snapshot()["inflight"] == 3, 30, step=0.01)
        b = await ask(client, [a_text, more])
        got_a = await a
        for t in long:
            await t
    assert b.ended > got_a.ended and b.slot == got_a.slot, (vars(b), vars(got_a))
    assert b.cached >= 0.9 * got_a.prompt, (vars(b), vars(got_a))
    assert abs(b.predicted - b.cached) <= max(16, 0.02 * b.cached), vars(b)
