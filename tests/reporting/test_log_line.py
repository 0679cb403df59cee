"""The one log line of each routed request: where its prefix was, and where its time
went (kvroute's own queue, then the backend)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from faults import chat_body, fake_behind_proxy, until
from structlog.testing import capture_logs

from proxy.server.keys import ROUTER


async def test_the_line_says_what_each_backend_held_and_how_long_kvroute_held_it(
        demo_model: Path, tmp_path: Path) -> None:
    """A turn sent while its conversation's last turn still runs in the only slot waits
    in kvroute for that slot: `sent_ms` is that wait, `matched` the prefix the slot
    held for it."""
    async with fake_behind_proxy(tmp_path, demo_model, "stall") as (fake, client):
        router = client.server.app[ROUTER]
        first = chat_body(240, n_words=300)
        turn = {**first, "messages": [*first["messages"],
                                      {"role": "assistant", "content": "ok"},
                                      {"role": "user", "content": "and then?"}]}
        with capture_logs() as logs:
            sent = asyncio.create_task(client.post("/v1/chat/completions", json=first))
            await until(lambda: fake.hits == 1, 5, 0.02)
            queued = asyncio.create_task(client.post("/v1/chat/completions", json=turn))
            await until(lambda: router.snapshot()["inflight"] == 2, 5, 0.02)
            await asyncio.sleep(0.5)
            assert fake.hits == 1  # held in kvroute, not in the server's queue
            fake.release.set()
            for r in await asyncio.gather(sent, queued):
                assert r.status == 200
        lines = [e for e in logs if e["event"] == "routed"]
        assert [e["status"] for e in lines] == ["200", "200"]
        held, waited = lines
        assert held["matched"] == {"f": 0}
        assert waited["matched"]["f"] > 300  # (the turn's words, its history)
        assert waited["sent_ms"] >= 500, waited
        assert held["sent_ms"] < waited["sent_ms"], (held, waited)
