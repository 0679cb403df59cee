"""Clients that leave: during the prefill, right after the last event, before the
backend answers, on a request the backend runs on, streamed or not. The slot the model
frees must be free on the server, and what it holds must be what the server holds."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import time
from pathlib import Path
from typing import Any

import pytest
from faults import busy_slots, chat_body, fake_behind_proxy, until
from proxy_client import proxy
from texts import words

from backends.info import BackendInfo
from proxy.server.keys import ROUTER

pytestmark = pytest.mark.timeout(240)


async def test_client_leaving_during_the_prefill_leaves_its_prompt_in_a_busy_slot(
        backend_pool: Any) -> None:
    """llama-server goes on with a prefill its client left (it notices after a second
    with no result for any task, then ends the batch; on a busy server, at the first
    token). The model freed and emptied the slot at once: a request sent there waited
    behind the rest of that prefill, and the resent turn (an agent interrupted during a
    long prefill, then resumed) was predicted 0 though the backend held what it had
    prefilled."""
    sup = await backend_pool(n=1, fresh=True)
    body = {"model": "kvroute-demo", "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": words(4000, 430)}]}  # ~3 s of prefill
    async with proxy(sup) as client:
        router = client.server.app[ROUTER]
        req = asyncio.create_task(client.post("/v1/chat/completions", json=body))
        await asyncio.sleep(0.5)
        req.cancel()  # the client leaves during the prefill's first batch
        with contextlib.suppress(asyncio.CancelledError):
            await req
        await asyncio.sleep(0.2)
        slots = router.snapshot()["backends"]["a"]["slots"]
        assert sum(s["busy"] for s in slots) == 1, slots  # the backend is still at it
        assert await busy_slots(sup.ready()[0]) == 1
        await until(lambda: router.snapshot()["inflight"] == 0, 30)
        held = max(s["tokens"] for s in router.snapshot()["backends"]["a"]["slots"])
        assert held >= 2048, held  # at least its first batch
        async with client.post("/v1/chat/completions", json=body) as r:  # resumed
            text = await r.text()
            predicted = int(r.headers["X-Kvroute-Predicted-Cached"])
        usage = [json.loads(line[6:]) for line in text.splitlines()
                 if line.startswith("data: {")][-1]
        reported = usage["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert predicted == reported >= 2047, (predicted, reported, held)


async def test_client_leaving_before_the_slot_launched_keeps_it_busy(
        demo_model: Path, tmp_path: Path) -> None:
    """A client can leave after its request is written and before the answer's head
    (the server still tokenizing or queueing it: a slow machine). The server goes on with
    it as with a launched one: the slot is busy until /slots says idle (freed at once,
    it would take the next request while the server still prefills there), then holds
    what /slots says, the request's prompt so far."""
    async with fake_behind_proxy(tmp_path, demo_model, "stall") as (fake, client):
        router = client.server.app[ROUTER]
        fake.busy_slots, fake.slot_tokens = 1, 40  # the server took it: processing
        await _leave_before_the_head(fake, client, chat_body(230, n_words=300))
        await asyncio.sleep(2.0)  # past the first /slots poll, which sees it processing
        assert router.snapshot()["backends"]["f"]["slots"][0]["busy"]
        fake.busy_slots = 0  # the server noticed and ended the prefill
        await until(lambda: not router.snapshot()["backends"]["f"]["slots"][0]["busy"], 10)
        assert router.snapshot()["backends"]["f"]["slots"][0]["tokens"] == 40
        assert router.snapshot()["inflight"] == 0


async def test_client_leaving_a_request_the_server_never_ran_claims_nothing(
        demo_model: Path, tmp_path: Path) -> None:
    """Left before the head, and /slots never shows the slot processing: the server may
    have refused the request or dropped it queued. The count /slots gives is then the
    slot's earlier task's, not a prefix of this prompt: what the slot holds is unknown
    (recorded as this prompt's first tokens, it would predict the next request a reuse
    the server does not have)."""
    async with fake_behind_proxy(tmp_path, demo_model, "stall") as (fake, client):
        router = client.server.app[ROUTER]
        fake.slot_tokens = 200  # another conversation's tokens; the slot is idle
        await _leave_before_the_head(fake, client, chat_body(231, n_words=300))
        await until(lambda: not router.snapshot()["backends"]["f"]["slots"][0]["busy"], 10)
        assert router.snapshot()["backends"]["f"]["slots"][0]["tokens"] == 0


async def _leave_before_the_head(fake: Any, client: Any, body: dict[str, Any]) -> None:
    """Send a streamed `body`; cancel it once the (stalled) backend has it."""
    req = asyncio.create_task(client.post("/v1/chat/completions",
                                          json={**body, "stream": True}))
    await until(lambda: fake.hits >= 1, 5, 0.02)
    req.cancel()  # no head came: the client left before the slot launched
    with contextlib.suppress(asyncio.CancelledError):
        await req


async def test_client_leaving_right_after_the_last_event_still_completes(
        demo_model: Path, tmp_path: Path) -> None:
    """A client that closes its connection as soon as it has a stream's last event (as
    load testers and SDKs do) cancels the proxy's handler while it still waits for the
    backend's end of stream. The backend finished: the router must record what the slot
    now holds (it aborted instead and forgot it; the next turn was predicted 0)."""
    async with fake_behind_proxy(tmp_path, demo_model, "linger") as (_, client):
        body = {**chat_body(200), "stream": True}
        async with client.post("/v1/chat/completions", json=body) as r:
            assert r.status == 200
            async for line in r.content:
                if line.startswith(b"data: [DONE]"):
                    break
            r.close()  # gone before the backend ended its stream
        router = client.server.app[ROUTER]
        await until(lambda: router.completed == 1, 5)
        slot = router.snapshot()["backends"]["f"]["slots"][0]
        assert slot["tokens"] > 0 and not slot["busy"]


async def test_client_leaving_before_the_backend_answers_is_counted_cancelled(
        demo_model: Path, tmp_path: Path) -> None:
    """An agent's user interrupting a turn while the backend has not answered yet (a long
    prefill) is the client's act: counted as `cancelled`, not as a backend `error`."""
    async with fake_behind_proxy(tmp_path, demo_model, "stall") as (fake, client):
        req = asyncio.create_task(client.post("/v1/chat/completions", json=chat_body(210)))
        await until(lambda: fake.hits >= 1, 5, 0.02)
        req.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await req
        async with client.get("/metrics") as m:
            text = await m.text()
    statuses = re.findall(r'kvroute_requests_total\{[^}]*status="(\w+)"\} 1\.0', text)
    assert statuses == ["cancelled"], text


async def test_client_leaving_a_request_its_backend_runs_on_keeps_the_slot_busy(
        demo_model: Path, tmp_path: Path) -> None:
    """A non-streamed request that cannot be assembled from a stream (here n=2) goes to
    the backend as it is, which goes on generating when the client leaves (it does not
    notice: see proxy/forwarding/assemble.py). The slot is busy until the backend answers: freed in
    the model when the client left, the next request was pinned to a slot still at work."""
    async with fake_behind_proxy(tmp_path, demo_model, "stall") as (fake, client):
        router = client.server.app[ROUTER]
        body = chat_body(220, n=2, max_tokens=4000)
        req = asyncio.create_task(client.post("/v1/chat/completions", json=body))
        await until(lambda: fake.hits >= 1, 5, 0.02)
        req.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await req
        await asyncio.sleep(0.3)
        snap = router.snapshot()
        assert snap["inflight"] == 1 and snap["backends"]["f"]["slots"][0]["busy"], snap
        async with client.get("/metrics") as m:  # the client's request: over, cancelled
            text = await m.text()  # ... but the backend's work is not
        assert re.search(r'kvroute_requests_total\{[^}]*status="cancelled"\} 1\.0', text)
        assert 'kvroute_in_flight{backend="f"} 1.0' in text, text
        fake.release.set()  # the backend finishes: the slot is free and holds the prompt
        await until(lambda: router.completed == 1, 5, 0.02)
        slot = router.snapshot()["backends"]["f"]["slots"][0]
        assert not slot["busy"] and slot["tokens"] > 0, slot
        async with client.get("/metrics") as m:
            assert 'kvroute_in_flight{backend="f"} 0.0' in await m.text()


async def test_client_leaving_frees_the_slot(backend_pool: Any) -> None:
    sup = await backend_pool()
    infos = sup.ready()
    async with proxy(sup) as client:
        app = client.server.app
        # mid-stream (Anthropic format; the OpenAI one is in test_proxy_e2e)
        body = {"model": "m", "max_tokens": 2000, "stream": True,
                "messages": [{"role": "user", "content": words(40, 77)}]}
        r = await client.post("/v1/messages", json=body)
        assert r.status == 200
        await r.content.readline()
        r.close()
        t0 = time.monotonic()
        await until(lambda: _none_busy(infos), 1.0, 0.05)
        assert time.monotonic() - t0 <= 1.0
        assert app[ROUTER].snapshot()["inflight"] == 0

        # before the first byte: a cold ~1.5k-token prompt takes a second or more
        req = asyncio.create_task(client.post("/v1/chat/completions", json=chat_body(
            random.randrange(10**9), n_words=1500, stream=True, max_tokens=2000,
            ignore_eos=True)))
        await until(lambda: _any_busy(infos), 20, 0.05)
        # the client goes away before its first byte. llama-server only notices a closed
        # connection when it next writes (its first chunk, after the prompt is processed;
        # measured on the pinned build), not after the 2,000 tokens it was asked for. The
        # router keeps the slot busy until then (it asks /slots), and no longer
        req.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await req
        t0 = time.monotonic()
        await until(lambda: _none_busy(infos), 15, 0.05)
        took = time.monotonic() - t0
        await until(lambda: app[ROUTER].snapshot()["inflight"] == 0, 2.0, 0.02)
        print(f"slot freed {took:.2f} s after a pre-first-byte disconnect")


async def _leave(req: asyncio.Task[Any], app: Any, infos: list[BackendInfo],
                 within: float) -> float:
    """Cancel the client's request `req`: the proxy must let go at once (its upstream
    connection closed) and the backends' slots be free `within` s; how long that took."""
    t0 = await _cancel(req, app)
    await until(lambda: _none_busy(infos), within, 0.05)
    return time.monotonic() - t0


async def _cancel(req: asyncio.Task[Any], app: Any) -> float:
    """Cancel `req`; the proxy must let go of it at once. Returns when it was cancelled."""
    req.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await req
    t0 = time.monotonic()
    await until(lambda: app[ROUTER].snapshot()["inflight"] == 0, 0.5, 0.02)
    return t0


async def test_client_leaving_a_non_streamed_request_frees_the_slot(backend_pool: Any
                                                                    ) -> None:
    """A non-streamed answer is written only at the end, and llama-server's poll of the
    connection meanwhile runs only after a second with no result for any task (pinned
    build): the /slots queries of this test, like any other slot's stream on a busy
    server, starve it, and without the proxy the generation runs on to its 2,000 tokens
    (~30 s; seen before proxy/forwarding/assemble.py). The proxy streams it upstream, so the server
    stops at its next token once the proxy drops the connection."""
    sup = await backend_pool()
    infos = sup.ready()
    async with proxy(sup) as client:
        app = client.server.app
        req = asyncio.create_task(client.post("/v1/chat/completions", json=chat_body(
            random.randrange(10**9), n_words=40, max_tokens=2000, ignore_eos=True)))
        await until(lambda: _any_busy(infos), 20, 0.05)
        await asyncio.sleep(1.0)  # past the prompt: generating, nothing written yet
        assert not req.done()
        took = await _leave(req, app, infos, 5)
        print(f"slot freed {took:.2f} s after a non-streamed client left")


async def _any_busy(infos: list[BackendInfo]) -> bool:
    return any([await busy_slots(i) for i in infos])


async def _none_busy(infos: list[BackendInfo]) -> bool:
    return not await _any_busy(infos)
