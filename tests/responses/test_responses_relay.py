"""`ResponsesRelay` on llama-server's exact chat answer shapes (what the demo model cannot
produce: reasoning and tool calls), read back with the OpenAI SDK's own stream state."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from llama_chunks import chunk, named_events
from openai import omit
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent

from proxy.responses.relay import ResponsesRelay


def test_stream_with_reasoning_text_and_tool_calls() -> None:
    t = {"cache_n": 100, "prompt_n": 20, "predicted_n": 1}
    call = {"index": 0, "id": "abc", "type": "function",
            "function": {"name": "shell", "arguments": ""}}
    chunks = [
        chunk({"role": "assistant", "content": None}),
        chunk({"reasoning_content": "think"}),
        chunk({"reasoning_content": " more"}),
        chunk({"content": "ok"}),
        chunk({"tool_calls": [call]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"command":'}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": ' "ls"}'}}]}),
        chunk({"tool_calls": [{**call, "index": 1, "id": "def",
                                "function": {"name": "read_file", "arguments": "{}"}}]}),
        chunk({}, finish="tool_calls", timings={**t, "predicted_n": 9}),
        chunk(None, usage=True, timings={**t, "predicted_n": 9}),
    ]
    relay = ResponsesRelay("m")
    raw: list[bytes] = []
    for c in chunks:
        raw += relay.event(c) or []
    raw += relay.done() or []
    events = named_events(raw)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    types = [e["type"] for e in events]
    assert types[:3] == ["response.created", "response.in_progress",
                         "response.output_item.added"]
    assert types[-1] == "response.completed"
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=[], text_format=omit)
    for e in events:  # the SDK's own accumulation must accept every event
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=e))  # type: ignore[arg-type]
    final = events[-1]["response"]
    assert final["id"] == events[0]["response"]["id"] and final["id"].startswith("resp_")
    assert [o["type"] for o in final["output"]] == [
        "reasoning", "message", "function_call", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "think more"
    assert final["output"][1]["content"][0]["text"] == "ok"
    assert final["output"][2] == {"id": "fc_abc", "type": "function_call",
                                  "status": "completed", "arguments": '{"command": "ls"}',
                                  "call_id": "call_abc", "name": "shell"}
    assert final["output"][3]["call_id"] == "call_def" and final["output"][3]["arguments"] \
        == "{}"
    assert final["usage"] == {"input_tokens": 120, "output_tokens": 9, "total_tokens": 129,
                              "input_tokens_details": {"cached_tokens": 100}}
    assert events[-1]["timings"]["cache_n"] == 100  # as the server's own event has them


def test_empty_stream_still_completes_and_errors_pass_as_the_server_writes_them() -> None:
    relay = ResponsesRelay("m")
    assert relay.event({"error": {"code": 500, "message": "boom"}}) is None  # relayed raw
    events = named_events(relay.done() or [])
    assert [e["type"] for e in events] == ["response.created", "response.in_progress",
                                           "response.completed"]
    assert events[-1]["response"]["output"] == []


def test_body_with_reasoning_and_tool_calls() -> None:
    body = {"id": "chatcmpl-y", "model": "kvroute-demo", "object": "chat.completion",
            "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                "role": "assistant", "content": "", "reasoning_content": "hmm",
                "tool_calls": [{"type": "function", "id": "c1", "function": {
                    "name": "shell", "arguments": '{"command":"ls"}'}},
                               {"type": "function", "id": "c2", "function": {
                                   "name": "read_file", "arguments": {"path": "a"}}},
                               {"type": "function", "id": "c3", "function": None}]}}],
            "usage": {"completion_tokens": 7, "prompt_tokens": 50, "total_tokens": 57,
                      "prompt_tokens_details": {"cached_tokens": 40}},
            "timings": {"cache_n": 40, "prompt_n": 10, "predicted_n": 7}}
    out = ResponsesRelay("m").body(body)
    assert out is not None
    resp = construct_type(type_=Response, value=out)
    assert isinstance(resp, Response) and resp.status == "completed"
    assert [o.type for o in resp.output] == ["reasoning", "function_call", "function_call"]
    assert resp.output[1].call_id == "call_c1" and resp.output[1].id == "fc_c1"  # type: ignore[union-attr]
    assert resp.output[2].arguments == '{"path": "a"}'  # type: ignore[union-attr]
    assert resp.model == "kvroute-demo" and resp.usage is not None
    assert resp.usage.input_tokens == 50 and resp.usage.output_tokens == 7
    assert resp.usage.input_tokens_details.cached_tokens == 40
    assert ResponsesRelay("m").body({"choices": "junk"}) is not None  # never raises


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(
        ["choices", "delta", "message", "content", "reasoning_content", "tool_calls",
         "index", "id", "function", "name", "arguments", "usage", "timings", "model",
         "prompt_tokens", "cache_n", "completion_tokens"]), inner, max_size=4),
    max_leaves=25)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.dictionaries(st.sampled_from(["choices", "usage", "timings", "model"]),
                                _JSON, max_size=4), max_size=5))
def test_an_external_backends_odd_chunks_never_break_the_relay(chunks: list[Any]) -> None:
    relay = ResponsesRelay("m")
    for c in chunks:
        relay.event(c)
        relay.body(c)
    assert named_events(relay.done() or [])[-1]["type"] == "response.completed"
