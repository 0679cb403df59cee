"""Answers broken by their backend: a stream stuck mid-answer or hung whole, malformed
or ended without its end, non-streamed bodies that are not answers, error events in an
assembled stream. Each ends as an error, once, and nothing malformed reaches the client."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from fake_backend import ANSWER
from faults import STALL_HEALTH, app_inflight, chat_body, fake_behind_proxy, until

from proxy.server.keys import HEALTH, ROUTER

pytestmark = pytest.mark.timeout(240)


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
