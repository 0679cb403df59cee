"""`/v1/messages` through kvroute to real llama-server backends, with the official SDK.

The demo model's text is gibberish: tests assert on format, usage and cache reuse. A
real backend cannot produce a tool call with it (random weights; llama-server refuses a
custom grammar next to tools), so `tool_use` *output* is checked by feeding the relay
chunks in llama-server's exact chat-stream shape and rebuilding the message with the
SDK's own stream accumulator.
"""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import anthropic
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from llama_chunks import chunk, named_events
from proxy_client import ProxyServer
from texts import words

from backends.supervisor import Supervisor
from proxy.anthropic.relay import AnthropicRelay
from proxy.anthropic.routes import chat_body
from proxy.app import create_app
from proxy.config.settings import ProxySettings


def billing(seed: int) -> str:
    # Claude Code's first system line; `cch` changes on every request.
    cch = f"{random.Random(seed).randrange(16**5):05x}"
    return f"x-anthropic-billing-header: cc_version=2.1.197.abc; cc_entrypoint=cli; cch={cch};"


TOOLS = [
    {"name": "Bash", "description": "Run a shell command.", "input_schema": {
        "type": "object", "properties": {"command": {"type": "string"}},
        "required": ["command"]}},
    {"name": "Read", "description": "Read a file.", "input_schema": {
        "type": "object", "properties": {"file_path": {"type": "string"}}}},
]


@asynccontextmanager
async def sdk(sup: Supervisor, settings: ProxySettings | None = None, api_key: str = "x"
              ) -> AsyncIterator[tuple[anthropic.AsyncAnthropic, str]]:
    server = ProxyServer(create_app(sup.config, sup, settings), handler_cancellation=True)
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    client = anthropic.AsyncAnthropic(base_url=url, api_key=api_key, max_retries=0)
    try:
        yield client, url
    finally:
        await client.close()
        await server.close()


def prompt_total(usage: Any) -> int:
    return int(usage.input_tokens) + int(usage.cache_read_input_tokens)


async def test_plain_message_and_stream(backend_pool: Any) -> None:
    sup = await backend_pool()
    msgs = [{"role": "user", "content": words(300, 1)}]
    async with sdk(sup) as (client, _):
        raw = await client.messages.with_raw_response.create(
            model="any", max_tokens=8, messages=msgs)
        assert raw.headers["X-Kvroute-Backend"] in {i.name for i in sup.ready()}
        first = await raw.parse()
        assert first.type == "message" and first.role == "assistant"
        assert [b.type for b in first.content] == ["text"] and first.content[0].text
        assert first.stop_reason == "max_tokens" and first.usage.output_tokens == 8
        n = prompt_total(first.usage)
        assert n > 300

        # the same prompt again, streamed: all but one token come from the slot
        events = [e async for e in await client.messages.create(
            model="any", max_tokens=8, messages=msgs, stream=True)]
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    assert types[1] == "content_block_start" and types[-3] == "content_block_stop"
    assert set(types[2:-3]) == {"content_block_delta"}
    start = events[0].message.usage
    assert start.cache_read_input_tokens == n - 1 and start.input_tokens == 1
    assert events[-2].usage.output_tokens == 8
    assert events[-2].delta.stop_reason == "max_tokens"


async def test_models_in_anthropics_shape(backend_pool: Any) -> None:
    """The Anthropic SDK's models.list got the OpenAI shape (type, display_name and
    created_at missing); models.retrieve was a 404."""
    sup = await backend_pool()
    async with sdk(sup) as (client, _):
        page = await client.models.list()
        assert [(m.type, m.id, m.display_name) for m in page.data] == [
            ("model", "kvroute-demo", "kvroute-demo")]
        assert page.data[0].created_at.year == 1970
        m = await client.models.retrieve("kvroute-demo")
        assert m.id == "kvroute-demo" and m.type == "model"
        with pytest.raises(anthropic.NotFoundError):
            await client.models.retrieve("nope")


async def test_the_stop_sequence_that_matched_is_reported(backend_pool: Any) -> None:
    """The chat answer kvroute translates does not say which stop sequence matched: it
    was always `stop_sequence: null`, `stop_reason: end_turn` (Anthropic's API gives the
    string and "stop_sequence"; llama-server's own endpoint gives the string)."""
    sup = await backend_pool()
    msgs = [{"role": "user", "content": words(50, 3)}]
    greedy = {"temperature": 0}
    async with sdk(sup) as (client, _):
        m = await client.messages.create(model="any", max_tokens=12, messages=msgs,
                                         extra_body=greedy)  # none: as before
        assert m.stop_reason == "max_tokens" and m.stop_sequence is None
        text = m.content[0].text  # type: ignore[union-attr]
        stops = ["\u2603never", text[len(text) // 2:len(text) // 2 + 2]]  # one it will say
        for max_tokens in (16, 64):  # the plain path, and the one assembled from a stream
            m = await client.messages.create(model="any", max_tokens=max_tokens,
                                             messages=msgs, stop_sequences=stops,
                                             extra_body=greedy)
            assert m.stop_reason == "stop_sequence" and m.stop_sequence == stops[1], m
        async with client.messages.stream(model="any", max_tokens=64, messages=msgs,
                                          stop_sequences=stops, extra_body=greedy) as st:
            final = await st.get_final_message()
        assert final.stop_reason == "stop_sequence" and final.stop_sequence == stops[1]


async def test_agent_turns_with_tools_reuse_the_slot(backend_pool: Any) -> None:
    # A Claude-Code-shaped conversation: billing line with a rotating cch, tools, an
    # assistant tool_use answered by a tool_result. Each turn must reuse all of the
    # previous turn's prompt: the cch rewrite happens before templating on the backend,
    # and kvroute must route by those very tokens.
    sup = await backend_pool()
    system = [{"type": "text", "text": billing(0)},
              {"type": "text", "text": words(400, 2), "cache_control": {"type": "ephemeral"}}]
    msgs: list[dict[str, Any]] = [{"role": "user", "content": words(60, 3)}]
    session = {"X-Claude-Code-Session-Id": "3f1c9a52-test-agent-turns"}
    prev = 0
    backends = set()
    async with sdk(sup) as (client, _):
        for turn in range(4):
            system[0]["text"] = billing(turn + 10)
            req = {"model": "kvroute-demo", "max_tokens": 6, "system": system,
                   "tools": TOOLS, "messages": msgs, "extra_headers": session,
                   "metadata": {"user_id": "user_abc_account__session_3f1c9a52"}}
            counted = await client.messages.count_tokens(
                model="m", system=system, tools=TOOLS, messages=msgs)
            if turn % 2:
                async with client.messages.stream(**req) as s:
                    answer = await s.get_final_message()
                    backend = s.response.headers["X-Kvroute-Backend"]
            else:
                raw = await client.messages.with_raw_response.create(**req)
                answer, backend = await raw.parse(), raw.headers["X-Kvroute-Backend"]
            backends.add(backend)
            assert prompt_total(answer.usage) == counted.input_tokens
            if turn:
                assert answer.usage.cache_read_input_tokens >= prev, (turn, answer.usage)
            prev = prompt_total(answer.usage)
            msgs.append({"role": "assistant", "content": [
                {"type": "text", "text": answer.content[0].text},
                {"type": "tool_use", "id": f"toolu_{turn}", "name": "Bash",
                 "input": {"command": f"ls {turn}"}}]})
            msgs.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": f"toolu_{turn}",
                 "content": words(40, 50 + turn)},
                {"type": "text", "text": words(10, 60 + turn)}]})
    assert len(backends) == 1


async def test_tokens_equal_the_backends_own_messages_endpoint(backend_pool: Any) -> None:
    # The backend's own /v1/messages (its converter, its cch rewrite, its template) must
    # report exactly as many prompt tokens as kvroute routes by.
    sup = await backend_pool()
    info = sup.ready()[0]
    body = {"model": "m", "max_tokens": 1,
            "system": [{"type": "text", "text": billing(7)},
                       {"type": "text", "text": "You are Claude Code. " + words(50, 8)}],
            "tools": TOOLS,
            "messages": [
                {"role": "user", "content": words(30, 9)},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "look first", "signature": "s"},
                    {"type": "tool_use", "id": "toolu_1", "name": "Read",
                     "input": {"file_path": "/etc/hosts"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1",
                     "content": [{"type": "text", "text": "127.0.0.1 localhost"}]}]}]}
    headers = {"Authorization": f"Bearer {info.api_key}"}
    async with sdk(sup) as (_, url), aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/messages/count_tokens?beta=true", json=body) as r:
            ours = (await r.json())["input_tokens"]
        async with http.post(f"{info.url}/v1/messages/count_tokens", json=body,
                             headers=headers) as r:
            assert (await r.json())["input_tokens"] == ours
        for cch_seed in (11, 12):  # the rotating value changes nothing
            body["system"][0]["text"] = billing(cch_seed)  # type: ignore[index]
            async with http.post(f"{info.url}/v1/messages", json=body, headers=headers) as r:
                usage = (await r.json())["usage"]
            assert usage["input_tokens"] + usage["cache_read_input_tokens"] == ours


async def test_errors_are_in_anthropics_format(backend_pool: Any) -> None:
    sup = await backend_pool()
    async with sdk(sup) as (client, url), aiohttp.ClientSession() as http:
        try:
            await client.messages.create(model="m", max_tokens=4, messages=[])
            raise AssertionError("accepted an empty messages array")
        except anthropic.BadRequestError as e:
            assert e.body["type"] == "error"  # type: ignore[index]
            assert e.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
        async with http.post(f"{url}/v1/messages", data=b"{not json") as r:
            data = await r.json()
            assert r.status == 400 and data["type"] == "error"
            assert data["error"]["type"] == "invalid_request_error"
        async with http.get(f"{url}/v1/messages") as r:
            assert r.status == 405 and (await r.json())["type"] == "error"

        # the backend's own errors, before and during a stream (greedy: deterministic): a
        # tool-call prefill that the model continues with gibberish fails llama-server's
        # tool-call parser
        bad = {"model": "m", "max_tokens": 3, "temperature": 0, "tools": TOOLS, "messages": [
            {"role": "user", "content": words(20, 70)},
            {"role": "assistant", "content": '<tool_call>\n{"name": "Bash", "arguments": '
                                             '{"command": "ls"}}\n</tool_call>'}]}
        async with http.post(f"{url}/v1/messages", json=bad) as r:
            data = await r.json()
            assert r.status == 500 and data["type"] == "error", data
            assert data["error"]["type"] == "api_error" and data["error"]["message"]
        async with http.post(f"{url}/v1/messages", json={**bad, "stream": True}) as r:
            text = await r.text()
        assert r.status == 200
        names = [ln[7:] for ln in text.splitlines() if ln.startswith("event: ")]
        assert names[0] == "message_start" and names[-1] == "error", names
        err = json.loads(text.strip().splitlines()[-1][5:])
        assert err["type"] == "error" and err["error"]["message"]


# What Anthropic's API refuses and llama-server's converter took: a shapeless image, a
# tool named 5, a tool_result answering no tool_use, no max_tokens (it defaulted to 4096).
REFUSED = [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": 5}]}]},
     "messages.0.content.0.source: expected an object"),
    ({"tools": [{"name": 5, "input_schema": {"type": "object"}}]},
     "tools.0.name: expected a string"),
    ({"messages": [
        {"role": "user", "content": "run ls"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Bash",
                                           "input": {"command": "ls"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_7",
                                      "content": "a.py"}]}]},
     "messages.2.content.0: unexpected `tool_use_id` found in `tool_result` blocks: toolu_7"),
    ({"max_tokens": None}, "max_tokens: Field required"),
]


async def test_what_anthropic_refuses_is_a_400(backend_pool: Any) -> None:
    sup = await backend_pool()
    base = {"model": "m", "max_tokens": 4, "tools": TOOLS,
            "messages": [{"role": "user", "content": words(10, 90)}]}
    async with sdk(sup) as (_, url), aiohttp.ClientSession() as http:
        for change, message in REFUSED:
            body = {k: v for k, v in {**base, **change}.items() if v is not None}
            for stream in (False, True):
                async with http.post(f"{url}/v1/messages", json={**body, "stream": stream}) as r:
                    data = await r.json()
                assert r.status == 400 and data == {"type": "error", "error": {
                    "type": "invalid_request_error", "message": data["error"]["message"]}}
                assert data["error"]["message"].startswith(message), data
        # the valid body it was made from is served
        async with http.post(f"{url}/v1/messages", json=base) as r:
            assert r.status == 200 and (await r.json())["stop_reason"] == "max_tokens"


async def test_keys_beta_and_version_headers(backend_pool: Any) -> None:
    sup = await backend_pool()
    msgs = [{"role": "user", "content": words(20, 80)}]
    settings = ProxySettings(api_keys=("sekrit",))
    async with sdk(sup, settings, api_key="sekrit") as (client, url):
        # SDK: x-api-key, anthropic-version; beta: ?beta=true and anthropic-beta
        got = await client.beta.messages.create(model="m", max_tokens=2, messages=msgs,
                                                betas=["interleaved-thinking-2025-05-14"])
        assert got.type == "message"
        bearer = anthropic.AsyncAnthropic(base_url=url, auth_token="sekrit", max_retries=0)
        assert (await bearer.messages.create(model="m", max_tokens=2, messages=msgs)).content
        await bearer.close()
        wrong = anthropic.AsyncAnthropic(base_url=url, api_key="nope", max_retries=0)
        try:
            await wrong.messages.create(model="m", max_tokens=2, messages=msgs)
            raise AssertionError("wrong key accepted")
        except anthropic.AuthenticationError as e:
            assert e.body["error"]["type"] == "authentication_error"  # type: ignore[index]
        finally:
            await wrong.close()


def test_session_hint_and_upstream_body() -> None:
    body = {"model": "m", "max_tokens": 5, "stream": True,
            "metadata": {"user_id": "user_1_account__session_9"},
            "messages": [{"role": "user", "content": "hi"}]}
    chat = chat_body(body)
    assert chat["user"] == "user_1_account__session_9"  # the Forwarder's session hint
    assert "__metadata_user_id" not in chat and "model" not in chat
    assert chat["stream_options"] == {"include_usage": True} and chat["timings_per_token"]


# ------------------------------------------- tool_use output: llama-server chunk shapes
def test_relay_stream_with_thinking_text_and_tool_calls() -> None:
    t = {"cache_n": 100, "prompt_n": 20, "predicted_n": 1}
    call = {"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "Bash", "arguments": ""}}
    chunks = [
        chunk({"role": "assistant", "content": None}),
        chunk({"reasoning_content": "think"}, timings=t),
        chunk({"content": "ok"}, timings=t),
        chunk({"tool_calls": [call]}, timings=t),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"command":'}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": ' "ls"}'}}]}),
        chunk({"tool_calls": [{**call, "index": 1, "id": "call_2",
                                "function": {"name": "Read", "arguments": "{}"}}]}),
        chunk({}, finish="tool_calls"),
        chunk(None, usage=True, timings={**t, "predicted_n": 9}),
    ]
    relay = AnthropicRelay("m")
    raw: list[bytes] = []
    for c in chunks:
        raw += relay.event(c) or []
    raw += relay.done() or []
    events = named_events(raw)
    assert events[0]["message"]["usage"] == {"cache_read_input_tokens": 100,
                                             "input_tokens": 20, "output_tokens": 0}
    snap = None
    bufs: dict[int, bytes] = {}
    for ev in events:
        snap = accumulate_event(event=ev, current_snapshot=snap, json_bufs=bufs)  # type: ignore[arg-type]
    assert snap is not None
    assert [b.type for b in snap.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert snap.content[0].thinking == "think" and snap.content[1].text == "ok"
    assert snap.content[2].name == "Bash" and snap.content[2].input == {"command": "ls"}
    assert snap.content[3].id == "call_2" and snap.content[3].input == {}
    assert snap.stop_reason == "tool_use" and snap.usage.output_tokens == 9
    # every block is closed before the next one starts, indices in order
    opened: list[int] = []
    for ev in events:
        if ev["type"] == "content_block_start":
            assert not opened or opened[-1] == -1
            opened.append(ev["index"])
        elif ev["type"] == "content_block_stop":
            assert opened[-1] == ev["index"]
            opened.append(-1)
    assert [i for i in opened if i >= 0] == [0, 1, 2, 3]


def test_relay_body_with_tool_calls() -> None:
    body = {"id": "chatcmpl-y", "model": "kvroute-demo", "object": "chat.completion",
            "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                "role": "assistant", "content": "", "reasoning_content": "hmm",
                "tool_calls": [{"type": "function", "id": "c1", "function": {
                    "name": "Bash", "arguments": '{"command":"ls"}'}},
                               {"type": "function", "id": "c2", "function": {
                                   "name": "Read", "arguments": "not json"}}]}}],
            "usage": {"completion_tokens": 7, "prompt_tokens": 50, "total_tokens": 57,
                      "prompt_tokens_details": {"cached_tokens": 40}},
            "timings": {"cache_n": 40, "prompt_n": 10, "predicted_n": 7}}
    out = AnthropicRelay("m").body(body)
    msg = anthropic.types.Message.model_validate(out)
    assert [b.type for b in msg.content] == ["thinking", "tool_use", "tool_use"]
    assert msg.content[1].input == {"command": "ls"} and msg.content[2].input == {}
    assert msg.stop_reason == "tool_use" and msg.model == "kvroute-demo"
    assert msg.usage.cache_read_input_tokens == 40 and msg.usage.input_tokens == 10
    assert msg.usage.output_tokens == 7
