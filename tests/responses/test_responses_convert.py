"""`responses_to_chat` against what llama-server's `server_chat_convert_responses_to_chatcmpl`
makes of the same bodies (its own dump of the converted request, `-v`), key order
included: the template dumps tools with `tojson`, where order is text."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.errors import BadRequest
from proxy.prompt.chat_request import PromptError
from proxy.responses.convert import responses_to_chat
from proxy.responses.routes import chat_body


def dumped(obj: Any) -> str:
    return json.dumps(obj)  # key order is part of what is compared


def test_string_input_and_fields_passed_through() -> None:
    body = {"input": "hi", "instructions": "sys", "max_output_tokens": 1, "temperature": 0,
            "id_slot": 0, "cache_prompt": True}
    assert dumped(responses_to_chat(body)) == dumped(
        {"temperature": 0, "id_slot": 0, "cache_prompt": True,
         "messages": [{"role": "system", "content": "sys"},
                      {"role": "user", "content": "hi"}],
         "max_tokens": 1})


def test_items_merge_and_tools_as_the_server_converts_them() -> None:
    body = {
        "input": [
            {"role": "user", "content": "a"},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "b", "annotations": []}]},
            {"type": "function_call", "call_id": "call_1", "name": "f",
             "arguments": "{\"x\":1}", "id": "fc_1", "status": "completed"},
            {"type": "function_call", "call_id": "call_2", "name": "g", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "r1"},
            {"type": "function_call_output", "call_id": "call_2",
             "output": [{"type": "input_text", "text": "r2"}]},
            {"role": "developer", "content": [{"type": "input_text", "text": "dev"}],
             "type": "message"}],
        "tools": [{"type": "function", "name": "f", "description": "d", "parameters": {
                      "type": "object", "properties": {"x": {"type": "integer"}}},
                   "strict": False},
                  {"type": "function", "name": "g",
                   "parameters": {"type": "object", "properties": {}}},
                  {"type": "web_search_preview"}],
        "tool_choice": "auto", "parallel_tool_calls": True, "max_output_tokens": 1,
        "reasoning": {"effort": "low"}, "store": False,
        "include": ["reasoning.encrypted_content"], "prompt_cache_key": "abc"}
    before = copy.deepcopy(body)
    server = (  # llama-server's dump of this very body
        '{"tool_choice": "auto", "parallel_tool_calls": true, "store": false, "include": '
        '["reasoning.encrypted_content"], "prompt_cache_key": "abc", "messages": [{"role": '
        '"user", "content": [{"text": "a", "type": "text"}]}, {"role": "assistant", "id": '
        '"msg_1", "content": [{"text": "b", "type": "text"}], "tool_calls": [{"function": '
        '{"arguments": "{\\"x\\":1}", "name": "f"}, "id": "call_1", "type": "function"}, '
        '{"function": {"arguments": "{}", "name": "g"}, "id": "call_2", "type": "function"}]}'
        ', {"content": "r1", "role": "tool", "tool_call_id": "call_1"}, {"content": [{"type":'
        ' "text", "text": "r2"}], "role": "tool", "tool_call_id": "call_2"}, {"role": '
        '"developer", "content": [{"text": "dev", "type": "text"}]}], "tools": [{"type": '
        '"function", "function": {"name": "f", "description": "d", "parameters": {"type": '
        '"object", "properties": {"x": {"type": "integer"}}}, "strict": false}}, {"type": '
        '"function", "function": {"name": "g", "parameters": {"type": "object", '
        '"properties": {}}, "strict": true}}], "max_tokens": 1, "reasoning_effort": "low"}')
    assert dumped(responses_to_chat(body)) == server
    assert body == before  # the client's body is left as it was


def test_reasoning_items_and_assistant_merges() -> None:
    body = {"input": [
        {"type": "reasoning", "summary": [], "id": "rs_1",
         "content": [{"type": "reasoning_text", "text": "t1"}]},
        {"type": "reasoning", "summary": [],
         "content": [{"type": "reasoning_text", "text": "t2"}]},
        {"type": "message", "role": "assistant", "content": "ok"},
        {"type": "message", "role": "assistant", "content": [
            {"type": "refusal", "refusal": "no"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "q"},
                                     {"type": "input_image", "image_url": "data:x"}]}],
        "max_output_tokens": 1, "max_tokens": 3}
    assert dumped(responses_to_chat(body)) == dumped({
        "max_tokens": 1,  # (in the place the client's max_tokens had)
        "messages": [{"role": "assistant", "content": [
                         {"text": "ok", "type": "text"},
                         {"refusal": "no", "type": "refusal"}],
                      "reasoning_content": "t2"},  # the last reasoning item wins
                     {"role": "user", "content": [
                         {"text": "q", "type": "text"},
                         {"image_url": {"url": "data:x"}, "type": "image_url"}]}]})


def test_the_short_form_of_an_assistant_message_is_that_message() -> None:
    # what OpenAI SDK users append to `input` after a turn: role and content, no type
    short = {"input": [{"role": "user", "content": "hi"},
                       {"role": "assistant", "content": "hello"},
                       {"role": "user", "content": "again"}]}
    typed = {"input": [{"role": "user", "content": "hi"},
                       {"type": "message", "role": "assistant",
                        "content": [{"type": "output_text", "text": "hello"}]},
                       {"role": "user", "content": "again"}]}
    assert dumped(responses_to_chat(short)) == dumped(responses_to_chat(typed))
    assert responses_to_chat(short)["messages"][1] == {
        "role": "assistant", "content": [{"text": "hello", "type": "text"}]}


def test_odd_values_the_server_reads_leniently() -> None:
    chat = responses_to_chat({"input": [], "instructions": 5, "reasoning": "high",
                              "tools": [{"type": "web_search"}, "x"]})
    assert chat == {"messages": [{"role": "system", "content": ""}]}


@pytest.mark.parametrize(("body", "message"), [  # llama-server's own messages
    ({}, "'input' is required"),
    ({"input": 5}, "'input' must be a string or array of objects"),
    ({"input": [{"role": "tool", "content": "x"}]}, "Cannot determine type of 'item'"),
    ({"input": [3]}, "Cannot determine type of 'item'"),
    ({"input": [{"type": "reasoning", "summary": [], "content": []}]},
     "item['content'] is empty"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "item['content'] is not an array"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]},
     "'input_file' is not supported by llamacpp at this moment"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
     "'Input text' requires 'text'"),
    ({"input": [{"type": "message", "role": "assistant", "content": [{"type": "x"}]}]},
     "'type' must be one of 'output_text' or 'refusal'"),
    ({"input": "x", "previous_response_id": "resp_1"},
     "llama.cpp does not support 'previous_response_id'."),
    ({"input": "x", "tools": {}}, "'tools' must be an array of objects"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "x"}]}]},
     "Output of tool call should be 'Input text' or 'Input image'"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [1]}]},
     "Output of tool call missing 'type' field"),
])
def test_errors_are_the_servers(body: dict[str, Any], message: str) -> None:
    with pytest.raises(PromptError) as e:
        responses_to_chat(body)
    assert message in str(e.value)
    if isinstance(body.get("input"), list):
        assert str(e.value).startswith("input[0]: ")  # which item it is


def test_upstream_body_and_refused_state() -> None:
    chat = chat_body({"input": "hi", "stream": True, "prompt_cache_key": "conv-1",
                      "stream_options": {"include_obfuscation": False}})
    assert chat["user"] == "conv-1"  # the Forwarder's session hint
    assert chat["stream_options"] == {"include_usage": True}
    assert chat_body({"input": "hi", "user": "u", "prompt_cache_key": "k"})["user"] == "u"
    for body, says in (({"previous_response_id": "resp_1"}, "send the whole conversation"),
                       ({"previous_response_id": 1}, "must be a string"),
                       ({"conversation": {"id": "conv_1"}}, "'conversation' is not"),
                       ({"max_output_tokens": True}, "max_output_tokens"),
                       ({"max_output_tokens": 10, "top_k": 2**40}, "top_k")):
        with pytest.raises(BadRequest) as e:
            chat_body({"input": "hi", **body})
        assert says in e.value.message


# any JSON, biased towards the keys and values the converter looks at
_KEYS = st.sampled_from(["input", "instructions", "tools", "type", "role", "content",
                         "text", "call_id", "name", "arguments", "output", "summary",
                         "reasoning", "effort", "max_output_tokens", "image_url", "strict",
                         "previous_response_id", "conversation", "stream", "refusal"])
_VALUES = st.sampled_from(["message", "assistant", "user", "developer", "function_call",
                           "function_call_output", "reasoning", "input_text", "output_text",
                           "input_image", "refusal", "function", ""])
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.text(max_size=5) | _VALUES,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_KEYS, inner, max_size=5),
    max_leaves=30)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(_KEYS, _JSON, max_size=6))
def test_any_body_converts_or_is_refused_clearly(body: dict[str, Any]) -> None:
    try:
        chat = chat_body(body)
    except BadRequest as e:
        assert e.status == 400 and e.message
        return
    assert isinstance(chat["messages"], list)
