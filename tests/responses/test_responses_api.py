"""`/v1/responses` through kvroute to real llama-server backends, with the official SDK.

The demo model's text is gibberish: tests assert on format, usage and cache reuse. It
cannot produce a tool call (random weights), so function_call *output* is checked in
test_responses_relay.py with llama-server's exact chat-stream shapes; here tools are
declared and function_call / function_call_output items are sent back as input.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import openai
import pytest
from proxy_client import ProxyServer
from texts import words

from backends.supervisor import Supervisor
from proxy.app import create_app

TOOLS: list[Any] = [
    {"type": "function", "name": "shell", "description": "Run a shell command.",
     "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                    "required": ["command"]}},
    {"type": "function", "name": "read_file", "description": "Read a file.",
     "strict": False,
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}},
    {"type": "web_search"},  # not a function: skipped, as the server does
]


@asynccontextmanager
async def sdk(sup: Supervisor) -> AsyncIterator[tuple[openai.AsyncOpenAI, str]]:
    server = ProxyServer(create_app(sup.config, sup), handler_cancellation=True)
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    try:
        yield client, url
    finally:
        await client.close()
        await server.close()


def exact(predicted: int, reused: int) -> bool:
    """The prediction is exact: within max(16 tokens, 2%) of what was reused."""
    return abs(predicted - reused) <= max(16, 0.02 * reused)


async def test_plain_and_streamed(backend_pool: Any) -> None:
    sup = await backend_pool()
    req: dict[str, Any] = {"model": "kvroute-demo", "instructions": words(50, 201),
                           "input": words(250, 202), "max_output_tokens": 8}
    async with sdk(sup) as (client, _):
        raw = await client.responses.with_raw_response.create(**req)
        assert raw.headers["X-Kvroute-Backend"] in {i.name for i in sup.ready()}
        first = raw.parse()
        assert first.object == "response" and first.status == "completed"
        assert first.id.startswith("resp_") and first.model
        assert [o.type for o in first.output] == ["message"] and first.output_text
        n = first.usage.input_tokens
        assert n > 300 and first.usage.output_tokens == 8
        assert first.usage.total_tokens == n + 8
        counted = await client.responses.input_tokens.count(
            model="m", instructions=req["instructions"], input=req["input"])
        assert counted.input_tokens == n

        # the same prompt again, streamed: all but one token come from the slot
        stream = await client.responses.create(**req, stream=True)
        assert stream.response.headers["X-Kvroute-Predicted-Cached"] == str(n - 1)
        events = [e async for e in stream]
        # and through the SDK's stream helper (output_index, content_index, ...)
        async with client.responses.stream(**req) as helper:
            final = await helper.get_final_response()
        # a longer answer is streamed from the backend and assembled (a client that
        # leaves stops it): the same Responses body comes back
        long = await client.responses.create(**{**req, "max_output_tokens": 48})
        assert long.object == "response" and long.usage.input_tokens == n
        assert long.output_text and 0 < long.usage.output_tokens <= 48
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1].response  # type: ignore[union-attr]
    assert done.usage.input_tokens == n and done.usage.input_tokens_details.cached_tokens \
        == n - 1
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert done.output[0].content[0].text == text  # type: ignore[union-attr]
    assert final.output_text and final.usage.input_tokens == n  # type: ignore[union-attr]


async def test_tools_and_a_function_call_round_trip(backend_pool: Any) -> None:
    # A Codex-shaped turn: tools declared, the model's function_call and its output sent
    # back. kvroute's token count must be the backend's own /v1/responses count, and its
    # prompt the very one that endpoint builds (all but one token reused from the slot
    # kvroute's request filled: one slot, no RAM cache).
    sup = await backend_pool(n=1, slots=1, ctx_per_slot=16384, cache_ram_mib=0)
    info = sup.ready()[0]
    body: dict[str, Any] = {
        "model": "kvroute-demo", "instructions": words(60, 210), "tools": TOOLS,
        "tool_choice": "auto", "parallel_tool_calls": False, "store": False,
        "reasoning": {"effort": "low"}, "prompt_cache_key": "conv-tools",
        "max_output_tokens": 4, "temperature": 0,
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": words(30, 211)}]},
            {"type": "reasoning", "summary": [],
             "content": [{"type": "reasoning_text", "text": "look first"}]},
            {"type": "message", "role": "assistant", "status": "completed",
             "content": [{"type": "output_text", "text": words(8, 212)}]},
            {"type": "function_call", "call_id": "call_1", "name": "shell",
             "arguments": json.dumps({"command": "ls"})},
            {"type": "function_call_output", "call_id": "call_1",
             "output": words(40, 213)},
            {"role": "user", "content": words(12, 214)}]}
    headers = {"Authorization": f"Bearer {info.api_key}"}
    async with sdk(sup) as (client, _), aiohttp.ClientSession() as http:
        raw = await client.responses.with_raw_response.create(**body)
        answer = raw.parse()
        n = answer.usage.input_tokens
        counted = await client.responses.input_tokens.count(
            **{k: body[k] for k in ("model", "instructions", "tools", "input")})
        assert counted.input_tokens == n
        async with http.post(f"{info.url}/v1/responses", json=body, headers=headers) as r:
            own = await r.json()
        assert r.status == 200, own
        assert own["usage"]["input_tokens"] == n
        assert own["usage"]["input_tokens_details"]["cached_tokens"] == n - 1

        # the function call's result comes back in the next turn, streamed
        body["input"] += [
            {"type": "function_call", "call_id": "call_2", "name": "read_file",
             "arguments": json.dumps({"path": "a.txt"})},
            {"type": "function_call_output", "call_id": "call_2",
             "output": [{"type": "input_text", "text": words(20, 215)}]}]
        stream = await client.responses.create(**body, stream=True)
        events = [e async for e in stream]
    assert events[-1].type == "response.completed", events[-1]
    usage = events[-1].response.usage  # type: ignore[union-attr]
    assert usage is not None and usage.input_tokens > n
    assert usage.input_tokens_details.cached_tokens >= n - 1


async def test_state_is_refused_clearly(backend_pool: Any) -> None:
    sup = await backend_pool()
    async with sdk(sup) as (client, url), aiohttp.ClientSession() as http:
        with pytest.raises(openai.BadRequestError) as e:
            await client.responses.create(model="m", input="hi", max_output_tokens=2,
                                          previous_response_id="resp_abc")
        err = e.value.body
        assert isinstance(err, dict) and "previous_response_id" in err["message"]
        assert err["type"] == "invalid_request_error"
        with pytest.raises(openai.BadRequestError) as e:
            await client.responses.create(model="m", input="hi", conversation="conv_1")
        assert "conversation" in str(e.value)
        with pytest.raises(openai.NotFoundError) as e:  # nothing is stored to get back
            await client.responses.retrieve("resp_abc")
        assert "keeps no responses" in str(e.value)
        async with http.get(f"{url}/v1/responses") as r:
            assert r.status == 405 and (await r.json())["error"]["message"]


BAD_BODIES: list[Any] = [
    {}, {"input": None}, {"input": 5}, {"input": {"role": "user"}}, {"input": [1]},
    {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
    {"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
    {"input": [{"role": "assistant", "content": "no type: message"}],
     "max_output_tokens": 1},
    {"input": [{"type": "message", "role": "assistant", "content": [{"type": "x"}]}]},
    {"input": [{"type": "reasoning", "summary": [], "content": []}]},
    {"input": [{"type": "function_call_output", "call_id": "c", "output": [{"a": 1}]}]},
    {"input": [{"type": "function_call", "name": "f"}]},
    {"input": "x", "tools": {"type": "function"}},
    {"input": "x", "tools": [None, 3], "max_output_tokens": 1},
    {"input": "x", "max_output_tokens": "many"}, {"input": "x", "max_output_tokens": 2**40},
    {"input": "x", "previous_response_id": 7}, {"input": "x", "temperature": "hot"},
    {"input": "x", "stream": "yes"}, {"input": "x", "instructions": {"a": 1}, "reasoning": 3,
                                       "max_output_tokens": 1},
    {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
    {"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
    {"input": [{"type": "message", "role": "assistant",
                "content": [{"type": "refusal", "refusal": "no"}]}]},
    {"input": [{"role": "user", "content": "x"}], "tool_choice": {"type": "function"},
     "max_output_tokens": 1},
    {"input": "x", "max_output_tokens": 0}, {"input": "x", "id_slot": 99,
                                             "max_output_tokens": 1},
    [], "just a string",
]


async def test_bad_bodies_get_errors_in_the_apis_format(backend_pool: Any) -> None:
    sup = await backend_pool()
    async with sdk(sup) as (_, url), aiohttp.ClientSession() as http:
        for body in BAD_BODIES:
            async with http.post(f"{url}/v1/responses", json=body) as r:
                data = await r.json()
            if r.status == 200:  # (lenient where the server is: a non-string is "")
                assert data["object"] == "response", (body, data)
                continue
            assert 400 <= r.status < 500, (body, r.status, data)
            assert isinstance(data["error"]["message"], str) and data["error"]["message"]
        async with http.post(f"{url}/responses", data=b"{not json") as r:
            assert r.status == 400 and (await r.json())["error"]["type"]
        # an image to a backend without a projector: its server's own answer (a 500)
        image = {"input": [{"type": "function_call_output", "call_id": "c", "output": [
            {"type": "input_image", "image_url": "data:image/png;base64,AA"}]}]}
        async with http.post(f"{url}/v1/responses", json=image) as r:
            assert r.status == 500
            assert "image input is not supported" in (await r.json())["error"]["message"]


async def test_six_turns_reuse_the_previous_prompt_on_one_backend(backend_pool: Any) -> None:
    # A Codex-shaped session: instructions and tools, each turn sends the whole
    # conversation back (the model's message, a function call and its output, the next
    # user message). Every later turn lands on the first turn's backend, reuses >= 95%
    # of the previous prompt, and kvroute predicted that reuse exactly.
    sup = await backend_pool()
    conv = "codex-session-6-turns"
    body: dict[str, Any] = {"model": "kvroute-demo", "instructions": words(400, 220),
                            "tools": TOOLS, "max_output_tokens": 8, "store": False,
                            "prompt_cache_key": conv,
                            "input": [{"role": "user", "content": words(40, 221)}]}
    backends, prev = set(), 0
    async with sdk(sup) as (client, _):
        for turn in range(6):
            if turn % 2:
                stream = await client.responses.create(**body, stream=True)
                events = [e async for e in stream]
                headers = stream.response.headers
                answer = events[-1].response  # type: ignore[union-attr]
            else:
                raw = await client.responses.with_raw_response.create(**body)
                answer, headers = raw.parse(), raw.headers
            backends.add(headers["X-Kvroute-Backend"])
            usage = answer.usage
            reused = usage.input_tokens_details.cached_tokens
            predicted = int(headers["X-Kvroute-Predicted-Cached"])
            if turn:
                assert reused >= 0.95 * prev, (turn, reused, prev)
                assert exact(predicted, reused), (turn, predicted, reused)
            prev = usage.input_tokens
            text = answer.output[0].content[0].text  # type: ignore[union-attr]
            body["input"] += [
                {"type": "message", "role": "assistant", "status": "completed",
                 "content": [{"type": "output_text", "text": text}]},
                {"type": "function_call", "call_id": f"call_{turn}", "name": "shell",
                 "arguments": json.dumps({"command": f"ls {turn}"})},
                {"type": "function_call_output", "call_id": f"call_{turn}",
                 "output": words(60, 230 + turn)},
                {"role": "user", "content": words(15, 240 + turn)}]
    assert len(backends) == 1, backends


async def test_the_backends_own_errors_keep_the_openai_shape(backend_pool: Any) -> None:
    # greedy, so deterministic: a tool-call prefill that the model continues with
    # gibberish fails llama-server's tool-call parser (a 500 of the server's, not ours)
    sup = await backend_pool()
    bad = {"model": "m", "max_output_tokens": 3, "temperature": 0, "tools": TOOLS,
           "input": [{"role": "user", "content": words(20, 70)},
                     {"type": "message", "role": "assistant", "content": [
                         {"type": "output_text", "text": '<tool_call>\n{"name": "shell", '
                          '"arguments": {"command": "ls"}}\n</tool_call>'}]}]}
    async with sdk(sup) as (client, _):
        with pytest.raises(openai.APIStatusError) as e:
            await client.responses.create(**bad)
        assert e.value.status_code == 500 and e.value.message
        stream = await client.responses.create(**bad, stream=True)
        with pytest.raises(openai.APIError) as err:  # the SDK raises the error event
            _ = [ev async for ev in stream]
        assert err.value.message
