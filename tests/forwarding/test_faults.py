"""Faults: a backend killed under load, a backend that hangs, a sick external backend
(circuit breaker), a client that leaves before its first byte, overload.

Real llama-server backends (backend_pool) wherever the fault can be produced on them;
the fake backend (a real aiohttp server) only for hangs and precise-moment faults.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import random
import re
import signal
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient
from fake_backend import ANSWER, FakeBackend
from proxy_client import proxy
from texts import words

from backends.binary import cache_dir
from backends.config import ExternalBackendConfig, SupervisionConfig
from backends.supervisor import BackendInfo, Supervisor
from proxy.config.load import Config, ProxyConfig, RoutingConfig
from proxy.config.settings import HealthSettings, ProxySettings
from proxy.forwarding.health import BackendHealth
from proxy.server.keys import ADMISSION, HEALTH, METRICS, ROUTER

pytestmark = pytest.mark.timeout(240)





def chat_body(seed: int, n_words: int = 60, **extra: Any) -> dict[str, Any]:
    return {"model": "kvroute-demo", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": f"{seed}: " + words(n_words, seed)}],
            **extra}


@asynccontextmanager
async def external(tmp_path: Path, backends: dict[str, tuple[str, str | None]],
                   interval: float = 0.5) -> AsyncIterator[Supervisor]:
    """A Supervisor over external backends {name: (url, api_key)}, probing every
    `interval` s (it drops an external backend at its first failed probe)."""
    cfg = Config(proxy=ProxyConfig(port=1), routing=RoutingConfig(),
                 backends=tuple(ExternalBackendConfig(name=n, url=u, api_key=k)
                                for n, (u, k) in backends.items()),
                 llama_server=None, cache_dir=cache_dir(), log_dir=tmp_path,
                 supervision=SupervisionConfig(health_interval_s=interval))
    sup = Supervisor(cfg)
    await sup.start()
    try:
        yield sup
    finally:
        await sup.stop()


@asynccontextmanager
async def fake_behind_proxy(tmp_path: Path, demo_model: Path, mode: str,
                            health: HealthSettings | None = None
                            ) -> AsyncIterator[tuple[FakeBackend, TestClient[Any, Any]]]:
    """One FakeBackend "f" (1 slot) in `mode`, the only backend of a proxy."""
    fake = FakeBackend(slots=1)
    await fake.start()
    fake.mode = mode
    settings = ProxySettings(tokenizer=demo_model, health=health or FAST_HEALTH)
    try:
        async with external(tmp_path, {"f": (fake.url, None)}) as sup, \
                proxy(sup, settings) as client:
            yield fake, client
    finally:
        await fake.stop()


async def until(cond: Callable[[], Any], timeout: float, step: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if asyncio.iscoroutine(got):
            got = await got
        if got:
            return got
        await asyncio.sleep(step)
    raise AssertionError(f"condition not met within {timeout} s")


async def busy_slots(info: BackendInfo) -> int:
    async with aiohttp.ClientSession() as s, s.get(
            info.url + "/slots", headers={"Authorization": f"Bearer {info.api_key}"},
            timeout=aiohttp.ClientTimeout(total=5)) as r:
        return sum(slot["is_processing"] for slot in await r.json())


FAST_HEALTH = HealthSettings(probe_interval_s=0.2, probe_timeout_s=0.5, breaker_failures=2,
                             open_backoff_s=0.2, open_backoff_max_s=1.0)


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


@asynccontextmanager
async def fake_beside_real(backend_pool: Any, tmp_path: Path, name: str,
                           settings: ProxySettings
                           ) -> AsyncIterator[tuple[FakeBackend, TestClient[Any, Any]]]:
    """A FakeBackend `name` and a real backend "real", both external, behind a proxy."""
    real = (await backend_pool()).ready()[0]
    fake = FakeBackend(n_ctx=real.slot_ctx)
    await fake.start()
    try:
        async with external(tmp_path, {name: (fake.url, None),
                                        "real": (real.url, real.api_key)}) as sup:
            assert len(sup.ready()) == 2
            async with proxy(sup, settings) as client:
                yield fake, client
    finally:
        await fake.stop()


async def all_served_by_real(client: TestClient[Any, Any], seed: int) -> float:
    """Four requests at once, some sent to the faulty backend first: every one answered
    by "real" (retried there); how long they took."""
    t0 = time.monotonic()
    rs = await asyncio.gather(*(client.post("/v1/chat/completions", json=chat_body(seed + i))
                                for i in range(4)))
    for r in rs:
        assert r.status == 200, await r.text()
        assert r.headers["X-Kvroute-Backend"] == "real"
    return time.monotonic() - t0


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


STALL_HEALTH = dataclasses.replace(FAST_HEALTH, stall_timeout_s=1.0)


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


async def test_stream_from_a_backend_stuck_mid_answer_ends_with_an_error(
        demo_model: Path, tmp_path: Path) -> None:
    """A stream whose backend gets stuck after its first event waited read_timeout_s
    (600 s) for the next byte; it now ends with an error event once /slots tells."""
    async with fake_behind_proxy(tmp_path, demo_model, "wedged-mid",
                                 STALL_HEALTH) as (_, client):
        t0 = time.monotonic()
        async with client.post("/v1/chat/completions", json={**chat_body(410), "stream": True},
                               timeout=aiohttp.ClientTimeout(total=30)) as r:
            assert r.status == 200
            text = await r.text()
        assert time.monotonic() - t0 < 20
        assert text.startswith("data: {") and '"content": "ok"' in text, text
        assert 'data: {"error"' in text and "[DONE]" not in text, text
        state = client.server.app[HEALTH].state("f")
        assert state is not None and "stuck" in str(state["last_error"])


async def test_stream_from_a_backend_that_hangs_whole_ends_with_an_error(
        demo_model: Path, tmp_path: Path) -> None:
    """A backend that stops answering anything (/health too) mid-stream: its breaker opens
    on /health, which cut only the requests still waiting for their first byte; the
    stream waited read_timeout_s (600 s). /slots, unanswered, now ends it."""
    async with fake_behind_proxy(tmp_path, demo_model, "wedged-mid",
                                 STALL_HEALTH) as (fake, client):
        t0 = time.monotonic()
        async with client.post("/v1/chat/completions", json={**chat_body(415), "stream": True},
                               timeout=aiohttp.ClientTimeout(total=30)) as r:
            assert r.status == 200
            first = await r.content.readline()
            fake.mode = "hang"  # /health hangs too: the breaker opens on it first
            text = first.decode() + await r.text()
        assert time.monotonic() - t0 < 20
        assert 'data: {"error"' in text and "[DONE]" not in text, text
        health = client.server.app[HEALTH]
        assert "/health" in str(health.state("f")["last_error"])  # type: ignore[index]


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
        await _cancel(req, client.server.app)
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


_FINISH = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
MALFORMED_STREAMS: dict[str, tuple[dict[str, Any] | bytes, ...]] = {
    "not_json": (b"<html>", b"[1, 2]", {"choices": [{"index": 0, "delta": {"content": "ok"}}]},
                 _FINISH),
    "tool_index_list": ({"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": [1], "id": "t", "function": {"name": "f", "arguments": "{}"}}]}}]},
        _FINISH),
    "tool_calls_int": ({"choices": [{"index": 0, "delta": {"tool_calls": 5}}]}, _FINISH),
    "tool_name_int": ({"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": 5, "function": {"name": 7, "arguments": 9}}]}}]}, _FINISH),
    "bad_timings": ({"choices": [{"index": 0, "delta": {"content": "ok"}}]},
                    {**_FINISH, "id_slot": -3, "timings": {
                        "cache_n": -5, "prompt_n": 2**40, "prompt_ms": -1.0,
                        "predicted_n": "x", "predicted_ms": float("nan")},
                     "usage": {"prompt_tokens_details": {"cached_tokens": -1}}}),
}


@pytest.mark.parametrize("name", sorted(MALFORMED_STREAMS))
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
async def test_malformed_stream_from_an_external_backend_is_relayed_safely(
        demo_model: Path, tmp_path: Path, name: str, path: str) -> None:
    """An external backend may send anything: the client's stream still ends as its API
    says, the metrics take no nonsense, the router lets go of the request."""
    async with fake_behind_proxy(tmp_path, demo_model, "ok") as (fake, client):
        fake.streams["chat"] = MALFORMED_STREAMS[name]
        body = {**chat_body(230), "stream": True}
        if path == "/v1/messages":
            body = {"model": "m", "max_tokens": 8, "stream": True,
                    "messages": body["messages"]}
        async with client.post(path, json=body, timeout=aiohttp.ClientTimeout(total=10)) as r:
            assert r.status == 200
            text = await r.text()
        end = "event: message_stop" if path == "/v1/messages" else "data: [DONE]"
        assert end in text, text
        assert "internal error" not in text and '"name":7' not in text
        if path == "/v1/messages":  # every event is Anthropic's, none relayed raw
            assert "<html>" not in text and "[1, 2]" not in text and "choices" not in text
        router = client.server.app[ROUTER]
        await until(lambda: router.snapshot()["inflight"] == 0, 5, 0.02)
        assert router.snapshot()["backends"]["f"]["prefill_tps"] > 0
        async with client.get("/metrics") as m:
            metrics = await m.text()
        assert m.status == 200 and not re.search(r"cached_tokens_total\{[^}]*\} -", metrics)
        async with client.post(path, json={**body, "stream": False}) as r:  # still routed
            assert r.status == 200


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
async def test_stream_ending_without_its_end_ends_with_an_error_and_once(
        demo_model: Path, tmp_path: Path, path: str) -> None:
    """A stream cut short by a clean close is not a whole answer: the client gets an
    error event (it ended silently). And an end sent twice is relayed once (Anthropic
    clients got message_stop twice)."""
    body: dict[str, Any] = {**chat_body(240), "stream": True}
    if path == "/v1/messages":
        body = {"model": "m", "max_tokens": 8, "stream": True, "messages": body["messages"]}
    end = "event: message_stop" if path == "/v1/messages" else "data: [DONE]"
    async with fake_behind_proxy(tmp_path, demo_model, "ok") as (fake, client):
        fake.done_events = 2
        async with client.post(path, json=body) as r:
            text = await r.text()
        assert text.count(end) == 1 and "error" not in text, text
        fake.done_events = 0
        async with client.post(path, json=body) as r:
            assert r.status == 200
            text = await r.text()
        assert end not in text and "ended its stream before the answer did" in text, text
        assert ("event: error" if path == "/v1/messages" else 'data: {"error"') in text


async def test_malformed_non_streamed_answers_are_errors_not_relayed(
        demo_model: Path, tmp_path: Path) -> None:
    """A body that is not JSON went to the client as a 200 (to Anthropic clients too); a
    malformed tool call in a non-streamed answer was a 500 and a traceback."""
    async with fake_behind_proxy(tmp_path, demo_model, "ok") as (fake, client):
        fake.answer = b"<html>not json"
        async with client.post("/v1/chat/completions", json=chat_body(250)) as r:
            assert r.status == 502, await r.text()
        fake.answer_type = "text/plain"  # nor to an Anthropic client, whatever its label
        await until(lambda: client.server.app[HEALTH].state("f")["breaker"] == "closed", 10)
        messages = {"model": "m", "max_tokens": 8, "messages": chat_body(252)["messages"]}
        async with client.post("/v1/messages", json=messages) as r:
            assert r.status == 502 and (await r.json())["type"] == "error", await r.text()
        # an error answer translated to Anthropic's format is labelled JSON, as it is
        fake.answer, fake.answer_status = b"data: overloaded", 503
        fake.answer_type = "text/event-stream"
        await until(lambda: client.server.app[HEALTH].state("f")["breaker"] == "closed", 10)
        async with client.post("/v1/messages", json=messages) as r:
            assert r.status == 503 and r.content_type == "application/json"
            assert (await r.json())["type"] == "error"
        fake.answer_status, fake.answer_type = 200, "application/json"
        bad_calls = {**ANSWER, "choices": [{"index": 0, "finish_reason": "tool_calls",
                                            "message": {"role": "assistant", "tool_calls": [
                                                5, {"function": "f"}, {"function": {
                                                    "name": "ok", "arguments": "{}"}}]}}]}
        fake.answer = json.dumps(bad_calls).encode()
        await until(lambda: client.server.app[HEALTH].state("f")["breaker"] == "closed", 10)
        body = {"model": "m", "max_tokens": 8, "messages": chat_body(251)["messages"]}
        async with client.post("/v1/messages", json=body) as r:
            assert r.status == 200, await r.text()
            content = (await r.json())["content"]
        assert [c["name"] for c in content if c["type"] == "tool_use"] == ["ok"]


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


async def test_error_event_in_an_assembled_stream_is_an_error_answer(
        tmp_path: Path, demo_model: Path) -> None:
    """A non-streamed request is streamed upstream and assembled (proxy/forwarding/assemble.py); an
    error event in that stream reaches its client as the error answer llama-server would
    have sent without a stream: its status, its body."""
    async with fake_behind_proxy(tmp_path, demo_model, "error-event") as (fake, client):
        r = await client.post("/v1/chat/completions", json=chat_body(1, max_tokens=100))
        assert r.status == 500
        assert (await r.json())["error"]["message"] == "boom"
        assert json.loads(fake.requests[-1][2])["stream"] is True
        fake.mode = "ok"
        r = await client.post("/v1/chat/completions", json=chat_body(2, max_tokens=100))
        assert r.status == 200
        assert (await r.json())["choices"][0]["message"]["content"] == "ok"
        assert app_inflight(client) == 0


def app_inflight(client: TestClient[Any, Any]) -> int:
    return int(client.server.app[ROUTER].snapshot()["inflight"])


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


async def test_overload_is_429_with_retry_after_in_each_api_format(
        demo_model: Path, tmp_path: Path) -> None:
    fake = FakeBackend()
    await fake.start()
    settings = ProxySettings(tokenizer=demo_model, max_in_flight=1, max_queue=1,
                             queue_timeout_s=1.0)
    try:
        async with external(tmp_path, {"f": (fake.url, None)}) as sup, \
                proxy(sup, settings) as client:
            fake.mode = "stall"
            first = asyncio.create_task(client.post("/v1/chat/completions",
                                                    json=chat_body(1)))
            await until(lambda: fake.hits == 1, 5)
            queued = asyncio.create_task(client.post("/v1/chat/completions",
                                                     json=chat_body(2)))
            await until(lambda: _queued(client) == 1, 5)
            async with client.post("/v1/chat/completions", json=chat_body(3)) as r:
                assert r.status == 429 and r.headers["Retry-After"] == "1"
                err = (await r.json())["error"]
                assert err["type"] == "rate_limit_error" and err["code"] == "overloaded"
            body = {"model": "m", "max_tokens": 4,
                    "messages": [{"role": "user", "content": "hi"}]}
            async with client.post("/v1/messages", json=body) as r:
                assert r.status == 429 and "Retry-After" in r.headers
                data = await r.json()
                assert data["type"] == "error"
                assert data["error"]["type"] == "rate_limit_error"
            r2 = await asyncio.wait_for(queued, 5)  # waited past queue_timeout_s
            assert r2.status == 429
            async with client.get("/health") as h:  # reads are never queued
                assert h.status == 200
            fake.release.set()
            r1 = await asyncio.wait_for(first, 5)
            assert r1.status == 200
            async with client.post("/v1/chat/completions", json=chat_body(4)) as r:
                assert r.status == 200
    finally:
        await fake.stop()


def _queued(client: TestClient[Any, Any]) -> int:
    return client.server.app[ADMISSION].queued
