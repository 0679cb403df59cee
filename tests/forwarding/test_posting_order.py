"""Two requests sent back to back where the second loads what the first one's start
saves to RAM: the server posts a task only once its HTTP thread has tokenized it, so a
long first prompt would be posted, and launched, after a short second one, whose RAM
lookup then finds nothing. The second is held until the first is known posted."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from faults import until
from proxy_client import proxy
from texts import words

from proxy.server.keys import ROUTER

pytestmark = pytest.mark.timeout(240)


def chat(text: str) -> dict[str, Any]:
    return {"model": "kvroute-demo", "max_tokens": 1, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": text}]}


async def ask(client: Any, text: str, **extra: Any) -> tuple[int, int, str]:
    """(predicted, reported reuse, tier predicted) of one request."""
    async with client.post("/v1/chat/completions", json={**chat(text), **extra}) as r:
        assert r.status == 200, await r.text()
        body = await r.text()
        predicted = int(r.headers["X-Kvroute-Predicted-Cached"])
        tier = r.headers["X-Kvroute-Tier"]
    usage = [json.loads(line[6:]) for line in body.splitlines()
             if line.startswith("data: {")][-1]["usage"]
    return predicted, usage["prompt_tokens_details"]["cached_tokens"], tier


def slot_events(log: Path) -> list[tuple[str, str]]:
    """(slot, event) of the server's log: each launch and each end, in order."""
    return re.findall(r"id +(\d+) \| task +\d+ \| (processing task|stop processing)",
                      log.read_text(errors="replace"))


def all_ended(log: Path) -> list[tuple[str, str]]:
    """The log's slot events once each launch in it has its end logged, else []."""
    events = slot_events(log)
    ends = sum(1 for _, e in events if e == "stop processing")
    return events if events and 2 * ends == len(events) else []


def launched_after_an_end(events: list[tuple[str, str]]) -> bool:
    """Whether the last launch came after another slot's end: the events finish with
    an end, then a launch in another slot, then that launch's end."""
    (first_slot, first), (slot, second), (last_slot, last) = events[-3:]
    return ((first, second, last) == ("stop processing", "processing task", "stop processing")
            and first_slot != slot == last_slot)


async def test_a_load_of_what_a_long_start_saves_waits_for_its_posting(
        backend_pool: Any) -> None:
    """Slot 0 holds OTHER, slot 1 CONV (the last to run: no start saved it as an idle
    slot). LONG (unrelated, ~60 KB of text) takes slot 1, its start saving CONV to RAM;
    CONV's next turn, sent as soon as LONG is decided, takes slot 0 and loads CONV from
    RAM. Sent at once, the turn overtook LONG on the server (LONG was still being
    tokenized there), found no CONV in RAM and reused nothing. Both cores are kept busy
    (a slower tokenization there)."""
    sup = await backend_pool(n=1, slots=2, ctx_per_slot=16384, cache_ram_mib=256,
                             fresh=True)
    conv = words(1000, 1)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        async with proxy(sup) as client:
            router = client.server.app[ROUTER]
            await ask(client, words(2000, 2))
            await ask(client, conv)
            long = asyncio.create_task(ask(client, words(10000, 3)))
            await until(lambda: router.snapshot()["inflight"] == 1, 30, step=0.001)
            turn = await ask(client, conv + " " + words(20, 4))
            got = await long
    finally:
        for p in busy:
            p.kill()
            p.wait()
    predicted, reported, tier = turn
    assert tier == "ram" and predicted >= 1000, turn
    assert reported == predicted, (turn, got)
    assert got[0] == got[1], got


async def test_a_start_posted_after_another_slot_ended_saved_that_slot(
        backend_pool: Any) -> None:
    """LONG (a 10k-token system prompt) is in one slot, CONV's first turn runs in the
    other. LONG's next turn comes as CONV's answer takes its last steps: kvroute decides
    it at once (it has the system prompt's ids), but the server's HTTP thread tokenizes
    all of it first, so the server launches it after CONV's end and saves CONV's slot to
    RAM as an idle one (--cache-idle-slots), though kvroute started it while that slot
    was busy. CONV's next turn then runs in its slot, and a fork of CONV (a side
    question on the same history) takes LONG's slot, loading CONV from RAM: predicted so
    only if the model made that save too (LONG's turn was not launched, its answer's
    head had not come, when CONV's end came). On a loaded machine the server may launch
    LONG's turn before CONV's end (its log says which): then nothing saved CONV, and
    the fork waits for CONV's slot instead."""
    sup = await backend_pool(n=1, slots=2, ctx_per_slot=16384, cache_ram_mib=256,
                             fresh=True)
    conv = words(1000, 12)

    def long(question: int) -> dict[str, Any]:
        return {"messages": [{"role": "system", "content": words(10000, 11)},
                             {"role": "user", "content": words(5, question)}]}

    async with proxy(sup) as client:
        await ask(client, "", **long(13))
        body = {**chat(conv), "max_tokens": 3, "ignore_eos": True}
        later: asyncio.Task[tuple[int, int, str]] | None = None
        async with client.post("/v1/chat/completions", json=body) as r:
            async for line in r.content:
                if later is None and b'"content":"' in line:
                    # its first token: its last two steps run now
                    later = asyncio.create_task(ask(client, "", **long(14)))
        assert later is not None
        await later
        log = sup.config.log_dir / f"{sup.ready()[0].name}.log"
        # (the server writes its log from another thread: wait for every launch's end)
        saved = launched_after_an_end(await until(lambda: all_ended(log), 10))
        turn = asyncio.create_task(ask(client, conv + " " + words(20, 14),
                                       max_tokens=200, ignore_eos=True))
        await until(lambda: client.server.app[ROUTER].snapshot()["inflight"] == 1, 30,
                    step=0.001)
        fork = await ask(client, conv + " " + words(20, 15))
        await turn
    predicted, reported, tier = fork
    assert (tier == "ram") == saved and predicted >= 1000, (fork, saved)
    assert reported == predicted, fork
