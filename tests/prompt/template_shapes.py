"""Conversation shapes agents send, for the chat-template corpus test
(tests/prompt/test_template_corpus.py): every one is rendered by llama-server and by
kvroute under each template of llama.cpp's `models/templates/`."""

from __future__ import annotations

from typing import Any

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather for a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file from the workspace.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string"}, "limit": {"type": "integer"}},
            "required": ["path"]}}},
]


def _call(cid: str, name: str, args: str) -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


SYSTEM = {"role": "system", "content": "You are a careful coding agent."}
ASK = {"role": "user", "content": "What's the weather in Paris?"}
SINGLE_CALL = [
    ASK,
    {"role": "assistant", "content": "", "tool_calls": [
        _call("call_1", "get_weather", '{"city": "Paris"}')]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
]
PARALLEL_CALLS = [
    {"role": "user", "content": "Weather in Paris and Tokyo, then read notes.txt"},
    {"role": "assistant", "content": "Checking both.",
     "reasoning_content": "Two cities: call the tool twice.", "tool_calls": [
         _call("call_a", "get_weather", '{"city": "Paris", "unit": "celsius"}'),
         _call("call_b", "get_weather", '{"city": "Tokyo"}')]},
    {"role": "tool", "tool_call_id": "call_a", "name": "get_weather", "content": "18C"},
    {"role": "tool", "tool_call_id": "call_b", "name": "get_weather", "content": "25C"},
    {"role": "assistant", "content": "Paris 18C, Tokyo 25C.", "tool_calls": [
        _call("call_c", "read_file", '{"path": "notes.txt", "limit": 10}')]},
    {"role": "tool", "tool_call_id": "call_c", "name": "read_file", "content": "todo: none"},
    {"role": "assistant", "content": "Nothing to do."},
    {"role": "user", "content": "Thanks!"},
]
REASONING_TURNS = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4.", "reasoning_content": "Simple addition."},
    {"role": "user", "content": "And 3+3?"},
]

SHAPES: dict[str, dict[str, Any]] = {
    "user": {"messages": [{"role": "user", "content": "Hello!"}]},
    "system": {"messages": [SYSTEM, {"role": "user", "content": "Hi"}]},
    "multi_system": {"messages": [
        SYSTEM, {"role": "system", "content": "Answer in English."},
        {"role": "user", "content": "Hi"}]},
    "plain_turns": {"messages": [
        SYSTEM, {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6.\n\nAnything else?"},
        {"role": "user", "content": "No."}]},
    "reasoning_kept": {"messages": REASONING_TURNS},
    "reasoning_dropped": {"messages": REASONING_TURNS,
                          "chat_template_kwargs": {"preserve_reasoning": False}},
    "thinking_on": {"messages": [SYSTEM, *REASONING_TURNS],
                    "chat_template_kwargs": {"enable_thinking": True}},
    "thinking_off": {"messages": [SYSTEM, *REASONING_TURNS],
                     "chat_template_kwargs": {"enable_thinking": False}},
    "tools": {"messages": [SYSTEM, ASK], "tools": TOOLS},
    "tools_no_system": {"messages": [ASK], "tools": TOOLS},
    "tool_call": {"messages": [SYSTEM, *SINGLE_CALL], "tools": TOOLS},
    "parallel_tool_calls": {"messages": [SYSTEM, *PARALLEL_CALLS], "tools": TOOLS},
    "tool_calls_thinking_off": {"messages": PARALLEL_CALLS, "tools": TOOLS,
                                "chat_template_kwargs": {"enable_thinking": False}},
    "text_then_tool_results": {"messages": [
        ASK, {"role": "assistant", "content": "Let me check.", "tool_calls": [
            _call("call_1", "get_weather", '{"city": "Paris"}')]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 18}'}],
        "tools": TOOLS},
    "tool_results_out_of_order": {"messages": [
        *PARALLEL_CALLS[:2], PARALLEL_CALLS[3], PARALLEL_CALLS[2]], "tools": TOOLS},
    "developer": {"messages": [{"role": "developer", "content": "Be brief."},
                               {"role": "user", "content": "Hi"}]},
    "reasoning_effort": {"messages": [SYSTEM, *REASONING_TURNS], "reasoning_effort": "low"},
    "prefill": {"messages": [{"role": "user", "content": "Write a haiku"},
                             {"role": "assistant", "content": "Autumn"}]},
    "prefill_reasoning": {"messages": [
        {"role": "user", "content": "Think first"},
        {"role": "assistant", "content": "", "reasoning_content": "Let me see"}]},
    "empty_content": {"messages": [
        {"role": "system", "content": ""}, {"role": "user", "content": ""},
        {"role": "assistant", "content": None}, {"role": "user", "content": "go"}]},
    "content_parts": {"messages": [
        {"role": "system", "content": [{"type": "text", "text": "Part one."},
                                       {"type": "text", "text": "Part two."}]},
        {"role": "user", "content": [{"type": "text", "text": "Look:"},
                                     {"type": "text", "text": "done"}]}]},
}
