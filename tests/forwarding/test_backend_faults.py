"""Backends that fail: killed under load, hung, stalling, stuck while answering health,
sick (circuit breaker), stale keep-alive connections, timeouts together. Requests that got
nothing back are retried elsewhere; the client never sees the failure.

Real llama-server backends (backend_pool) wherever the fault can be produced on them;
the fake backend (a real aiohttp server) only for hangs and precise-moment faults."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from fake_backend import FakeBackend
from faults import (
    FAST_HEALTH,
    STALL_HEALTH,
    all_served_by_real,
    chat_body,
    external,
    fake_behind_proxy,
    fake_beside_real,
    until,
)
from proxy_client import proxy
from texts import words

from backends.info import BackendInfo
from proxy.config.settings import HealthSettings, ProxySettings
from proxy.forwarding.health import BackendHealth
from proxy.server.keys import HEALTH, METRICS, ROUTER

pytestmark = pytest.mark.timeout(240)


async def test_killed_backend_retries_pending_requests_and_ends_its_streams(
        backend_pool: Any) -> None:
    sup = await backend_pool(fresh=True)
    async with proxy(sup) as client:
        app = client.server.app
        stream = await client.post("/v1/chat/completions", json=chat_body(
            1, max_tokens=3000, ignore_eos=True, stream=True))
        assert stream.status == 200
        victim = stream.headers["X-Kvroute-Backend"]
        await stream.content.readline()
        old_pid = sup.pid(victim)
        assert old_pid is not None
        # slow non-streaming requests: spread over both backends, queued or running
        pending = [asyncio.create_task(client.post("/v1/chat/completions", json=chat_body(
            10 + i, max_tokens=48, ignore_eos=True))) for i in range(6)]
        await until(lambda: app[ROUTER].snapshot()["inflight"] >= 7, 10)
        on_victim = app[ROUTER].snapshot()["backends"][victim]["inflight"]
        os.kill(old_pid, signal.SIGKILL)

        # the stream in flight ends with an error event in OpenAI's format
        rest = (await asyncio.wait_for(stream.read(), 30)).decode()
        last = [ln for ln in rest.splitlines() if ln.startswith("data:")][-1]
        err = json.loads(last[5:])["error"]
        assert err["type"] == "server_error" and victim in err["message"]
        # the tree forgot what the victim held (until its restart rejoins it, empty)
        assert victim not in app[ROUTER].snapshot()["backends"]
        # every request not yet streaming succeeds elsewhere
        for t in pending:
            r = await asyncio.wait_for(t, 60)
            assert r.status == 200, await r.text()
            assert r.headers["X-Kvroute-Backend"] != victim
            r.release()
        if on_victim > 1:  # more than the stream was there: some were retried
            retries = app[METRICS].retries.labels("chat", "unreachable")._value.get()
            assert retries >= 1

        # restarted by the supervisor, then routed to again, fresh
        await until(lambda: sup.get(victim) is not None and sup.pid(victim) != old_pid, 90)
        await until(lambda: victim in app[ROUTER].snapshot()["backends"], 10)
        fresh = app[ROUTER].snapshot()["backends"][victim]
        assert all(s["tokens"] == 0 for s in fresh["slots"])
        used = set()
        for rnd in range(3):
            rs = await asyncio.gather(*(client.post("/v1/chat/completions", json=chat_body(
                100 + 10 * rnd + i)) for i in range(4)))
            for r in rs:
                assert r.status == 200
                used.add(r.headers["X-Kvroute-Backend"])
                r.release()
            if victim in used:
                break
        assert victim in used
    await sup.stop()


async def test_hung_backend_is_tripped_and_its_requests_rerouted(
        backend_pool: Any, demo_model: Path, tmp_path: Path) -> None:
    settings = ProxySettings(tokenizer=demo_model, health=FAST_HEALTH)
    async with fake_beside_real(backend_pool, tmp_path, "hang", settings) as (fake, client):
        fake.mode = "hang"  # accepts connections, answers nothing, /health included
        elapsed = await all_served_by_real(client, 200)
        assert fake.hits >= 1, "no request went to the hung backend"
        assert elapsed < 15, elapsed
        state = client.server.app[HEALTH].state("hang")
        assert state is not None and state["breaker"] == "open"
        async with client.get("/health") as h:
            assert (await h.json())["backends_ready"] == 1


async def test_backend_stalling_completions_hits_the_first_byte_timeout(
        backend_pool: Any, demo_model: Path, tmp_path: Path) -> None:
    # /health stays fine: only the first-byte timeout can tell
    settings = ProxySettings(tokenizer=demo_model, first_byte_timeout_s=1.5,
                             health=FAST_HEALTH)
    async with fake_beside_real(backend_pool, tmp_path, "stall", settings) as (fake, client):
        fake.mode = "stall"
        await all_served_by_real(client, 300)
        assert fake.hits >= 1
        app = client.server.app
        assert app[METRICS].retries.labels("chat", "timeout")._value.get() >= 1


async def test_stuck_backend_that_answers_health_is_tripped_and_its_requests_rerouted(
        backend_pool: Any, demo_model: Path, tmp_path: Path) -> None:
    """llama-server answers /health even when its main loop is stuck (upstream #13281):
    completions hang behind a 200. Requests sent there waited the whole first-byte
    timeout (600 s by default) while another backend was free. /slots, answered by that
    loop, tells: the backend is tripped, its requests go elsewhere, and it stays out
    until /slots answers again."""
    settings = ProxySettings(tokenizer=demo_model, health=STALL_HEALTH)
    async with fake_beside_real(backend_pool, tmp_path, "stuck", settings) as (fake, client):
        fake.mode = "wedged"
        elapsed = await all_served_by_real(client, 400)
        assert fake.hits >= 1, "no request went to the stuck backend"
        assert elapsed < 20, elapsed
        health = client.server.app[HEALTH]
        state = health.state("stuck")
        assert state is not None and state["breaker"] == "open", state
        assert "stuck: /slots unanswered" in str(state["last_error"])
        async with client.get("/kvroute/status") as st:  # the process serves /health,
            rows = {b["name"]: b for b in (await st.json())["backends"]}
        assert rows["stuck"]["healthy"] and not rows["stuck"]["routed"]  # but is out
        await asyncio.sleep(1.5)  # half-open probes: /health 200, /slots still hangs
        assert health.state("stuck")["breaker"] == "open"  # type: ignore[index]
        # back, but still running what it ran when taken out: the model would rejoin
        # it with idle slots and pin new requests behind those
        fake.busy_slots, fake.mode = 1, "ok"
        fake.release.set()
        await asyncio.sleep(1.5)
        state = health.state("stuck")
        assert state is not None and state["breaker"] == "open", state
        assert "still busy" in str(state["last_error"])
        fake.busy_slots = 0
        await until(lambda: health.state("stuck")["breaker"] == "closed", 10)  # type: ignore[index]


async def test_slots_answers_between_batches_of_a_long_prefill(backend_pool: Any) -> None:
    """What the stall check relies on: llama-server answers /slots from its main loop
    between two batches, so a long prefill (here ~4-8 s) does not hold it; and the
    proxy does not call such a backend stuck."""
    sup = await backend_pool(fresh=True)
    info = sup.ready()[0]
    headers = {"Authorization": f"Bearer {info.api_key}"}
    prompt = words(5000, 420)  # ~5k tokens: 3 batches of 2048
    async with aiohttp.ClientSession() as s:
        async def prefill() -> float:
            t = time.monotonic()
            async with s.post(info.url + "/completion", headers=headers, json={
                    "prompt": prompt, "n_predict": 1}) as r:
                assert r.status == 200, await r.text()
                return time.monotonic() - t

        task = asyncio.create_task(prefill())
        await asyncio.sleep(0.3)
        waits = []
        while not task.done():
            t = time.monotonic()
            async with s.get(info.url + "/slots", headers=headers) as r:
                assert r.status == 200
                busy = any(slot["is_processing"] for slot in await r.json())
            if busy:
                waits.append(time.monotonic() - t)
            await asyncio.sleep(0.1)
        took = await task
    assert took > 3 and len(waits) >= 2, (took, waits)
    assert max(waits) < took / 2, (took, waits)  # not held until the prompt was done


async def test_stale_keep_alive_connection_is_retried_on_the_same_backend(
        demo_model: Path, tmp_path: Path) -> None:
    """llama-server closes idle keep-alive connections after 5 s; one closed just as the
    proxy reuses it fails before any answer. That is no reason to call the backend down:
    the request is sent again on a fresh connection (it was a 502, or a retry elsewhere
    with the backend's breaker opened)."""
    async with fake_behind_proxy(tmp_path, demo_model, "drop-reused") as (fake, client):
        for i in range(3):
            r = await client.post("/v1/chat/completions", json=chat_body(i))
            assert r.status == 200, await r.text()
        assert fake.mode == "ok" and fake.hits == 4  # one was cut and sent again
        assert client.server.app[HEALTH].state("f")["breaker"] == "closed"


async def test_requests_timing_out_together_all_retry() -> None:
    """Several requests waiting on one backend time out in the same loop turn: the first
    one's failure trips the breaker, which must not try to move the others' timeouts,
    already expiring (it raised RuntimeError there: a 500 instead of a retry)."""
    from proxy.observability.logging import get_logger
    from proxy.observability.metrics import ProxyMetrics
    from proxy.routing.router import Router

    health = BackendHealth(Router(), {}, ProxyMetrics(), HealthSettings(), get_logger())
    health.backend_up(BackendInfo("b", "http://127.0.0.1:9", None, 1, 512, 0, 1024, "m", False))
    deadline = asyncio.get_running_loop().time() + 0.05

    async def waiter() -> str:
        try:
            async with asyncio.timeout_at(deadline) as t:
                with health.waiting("b", t):
                    await asyncio.sleep(5)
        except TimeoutError:
            health.failed("b", "no answer")  # what Forwarder._attempt does
            return "retry"
        return "answered"

    assert await asyncio.gather(*(waiter() for _ in range(3))) == ["retry"] * 3
    assert health.state("b")["breaker"] == "open"


async def test_sick_external_backend_opens_the_breaker_and_a_probe_closes_it(
        demo_model: Path, tmp_path: Path) -> None:
    a, b = FakeBackend(), FakeBackend()
    await a.start()
    await b.start()
    settings = ProxySettings(tokenizer=demo_model, health=FAST_HEALTH)
    try:
        # the supervisor probes rarely here: the proxy's own breaker is under test
        async with external(tmp_path, {"a": (a.url, None), "b": (b.url, None)},
                            interval=60) as sup, \
                proxy(sup, settings) as client:
            health = client.server.app[HEALTH]
            a.mode = "sick"
            await until(lambda: (health.state("a") or {}).get("breaker") == "open", 5)
            assert health.state("a")["failures"] >= FAST_HEALTH.breaker_failures
            before = a.hits
            for i in range(4):
                async with client.post("/v1/chat/completions", json=chat_body(i)) as r:
                    assert r.status == 200 and r.headers["X-Kvroute-Backend"] == "b"
            assert a.hits == before
            a.mode = "ok"  # half-open probe succeeds: back in the Router
            await until(lambda: health.state("a")["breaker"] == "closed", 5)
            assert "a" in client.server.app[ROUTER].snapshot()["backends"]
            assert client.server.app[METRICS].breaker_trips.labels("a")._value.get() >= 1
    finally:
        await a.stop()
        await b.stop()
