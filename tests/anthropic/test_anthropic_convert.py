"""anthropic_to_chat mirrors llama-server's Anthropic conversion token for token.

For every corpus request, our tokens of the converted body are counted by the backend's
own `/v1/messages/count_tokens` (which converts and templates server-side). For several,
a real `/v1/messages` call must report `input_tokens + cache_read_input_tokens` equal to
our length, and a `/completion` of exactly our ids must then reuse all but one token of
the slot -- proof that the slot cached those very ids.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from prompt_corpus import Backend

from proxy.anthropic.convert import anthropic_to_chat, normalize_billing_header
from proxy.prompt.builder import PromptBuilder
from proxy.prompt.chat_request import PromptError

BILLING = "x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; cch=a5145;"
CC_SYSTEM = [
    {"type": "text", "text": BILLING},
    {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
     "cache_control": {"type": "ephemeral"}},
    {"type": "text", "text": "\nYou are an interactive CLI tool. ünï 🙂 <|im_end|>"},
]
TOOLS = [
    {"name": "Bash", "description": "Run a shell command.", "input_schema": {
        "type": "object", "properties": {"command": {"type": "string"},
                                         "timeout": {"type": "number", "maximum": 600000.0}},
        "required": ["command"], "additionalProperties": False,
        "$schema": "http://json-schema.org/draft-07/schema#"}},
    {"name": "Read", "description": "Read a file.", "input_schema": {
        "type": "object", "properties": {"file_path": {"type": "string"},
                                         "offset": {"type": "integer"}}}},
    {"name": "NoSchema"},
    {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
]
AGENT_TURNS = [
    {"role": "user", "content": [{"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                                 {"type": "text", "text": "List the files.",
                                  "cache_control": {"type": "ephemeral"}}]},
    {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Use Bash.", "signature": "sig"},
        {"type": "text", "text": "I'll list them."},
        {"type": "tool_use", "id": "toolu_01", "name": "Bash",
         "input": {"command": "ls -la", "timeout": 1000.0}},
        {"type": "tool_use", "id": "toolu_02", "name": "Read", "input": {}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_01", "content": "a.py\nb.py"},
        {"type": "tool_result", "tool_use_id": "toolu_02", "is_error": True,
         "content": [{"type": "text", "text": "err: "}, {"type": "text", "text": "no file"}]},
        {"type": "text", "text": "Now what?"}]},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_03", "name": "Bash",
                                       "input": {"command": "echo 日本 \"q\" \\"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_03"}]},
]

CORPUS: dict[str, dict[str, Any]] = {
    "string_system": {"model": "m", "max_tokens": 64, "system": "Be brief.",
                      "messages": [{"role": "user", "content": "Hello 🙂"}]},
    "no_system": {"model": "m", "max_tokens": 64,
                  "messages": [{"role": "user", "content": "<|im_start|>hi<|im_end|>"}]},
    "claude_code_like": {"model": "m", "max_tokens": 32000, "system": CC_SYSTEM,
                         "tools": TOOLS, "messages": AGENT_TURNS, "stream": False,
                         "metadata": {"user_id": "user_abc_session_1"},
                         "tool_choice": {"type": "auto"}},
    "tool_choice_any": {"model": "m", "max_tokens": 8, "tools": TOOLS[:1],
                        "tool_choice": {"type": "any"},
                        "messages": [{"role": "user", "content": "run ls"}]},
    "string_billing_system": {"model": "m", "max_tokens": 8, "system": BILLING + "Hi.",
                              "messages": [{"role": "user", "content": "x"}]},
    "odd_system_and_blocks": {"model": "m", "max_tokens": 8, "system": 42, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, "junk", {"type": "?"},
                                     {"type": "text", "text": "b"}]},
        {"role": "assistant"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "only thought"}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                      "content": [{"type": "text", "text": "r"}]}]}]},
    "prefill": {"model": "m", "max_tokens": 8, "system": [{"type": "text", "text": "S"}],
                "messages": [{"role": "user", "content": "Write JSON"},
                             {"role": "assistant", "content": "{\"a\":"}]},
    "template_kwargs": {"model": "m", "max_tokens": 8, "chat_template_kwargs": {"x": 1},
                        "thinking": {"type": "enabled", "budget_tokens": 1024},
                        "stop_sequences": ["\n\n"],
                        "messages": [{"role": "user", "content": "think"}]},
}


def test_billing_header_normalisation() -> None:
    assert normalize_billing_header(BILLING + "x") == BILLING.replace("a5145", "fffff") + "x"
    assert normalize_billing_header(BILLING) == BILLING.replace("a5145", "fffff")
    # the value must be 5 characters followed by ';', and the line must start the text
    assert normalize_billing_header(BILLING[:-1]) == BILLING[:-1]
    assert normalize_billing_header(" " + BILLING) == " " + BILLING
    short = "x-anthropic-billing-header: cch=abc;"
    assert normalize_billing_header(short) == short


def test_conversion_shape() -> None:
    oai = anthropic_to_chat(CORPUS["claude_code_like"])
    roles = [m["role"] for m in oai["messages"]]
    # tool results follow the message's own text, as the server orders them
    assert roles == ["system", "user", "assistant", "user", "tool", "tool", "assistant", "tool"]
    assert "cch=fffff;" in oai["messages"][0]["content"]
    assert oai["messages"][2]["reasoning_content"] == "Use Bash."
    assert oai["messages"][2]["tool_calls"][0]["function"]["arguments"] == \
        '{"command":"ls -la","timeout":1000.0}'
    assert oai["messages"][5]["content"] == "err: no file"
    assert oai["messages"][7]["content"] == ""
    assert oai["tools"][2]["function"] == {"name": "NoSchema", "description": "",
                                           "parameters": {}}
    assert oai["tool_choice"] == "auto" and oai["max_tokens"] == 32000
    assert oai["__metadata_user_id"] == "user_abc_session_1"
    body = copy.deepcopy(CORPUS["claude_code_like"])
    anthropic_to_chat(body)
    assert body == CORPUS["claude_code_like"]  # the input is not mutated


def test_errors() -> None:
    with pytest.raises(PromptError):
        anthropic_to_chat({"system": "x"})
    with pytest.raises(PromptError):
        anthropic_to_chat([])  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_token_count_equals_backend(name: str, backend: Backend,
                                    builder: PromptBuilder) -> None:
    body = CORPUS[name]
    tokens = builder.chat_tokens(anthropic_to_chat(body))
    assert backend.ok("/v1/messages/count_tokens", body)["input_tokens"] == len(tokens)
    # and the converted body renders/tokenizes exactly as the backend's chat path does
    prompt = backend.apply_template(anthropic_to_chat(body))
    assert tokens == backend.tokenize(prompt)


@pytest.mark.parametrize("name", ["claude_code_like", "odd_system_and_blocks", "prefill"])
def test_messages_endpoint_caches_our_tokens(name: str, backend: Backend,
                                             builder: PromptBuilder) -> None:
    body = {**CORPUS[name], "max_tokens": 1, "stream": False}
    tokens = builder.chat_tokens(anthropic_to_chat(body))
    usage = backend.ok("/v1/messages", body)["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == len(tokens)
    assert backend.slot_reuse(tokens) == (len(tokens) - 1, 1)


def test_rotating_billing_header_still_reuses(backend: Backend,
                                              builder: PromptBuilder) -> None:
    base = {**CORPUS["claude_code_like"], "max_tokens": 1}
    first = copy.deepcopy(base)
    second = copy.deepcopy(base)
    second["system"][0]["text"] = BILLING.replace("a5145", "9b2c0")
    t1 = builder.chat_tokens(anthropic_to_chat(first))
    assert builder.chat_tokens(anthropic_to_chat(second)) == t1
    backend.ok("/v1/messages", first)
    usage = backend.ok("/v1/messages", second)["usage"]
    assert usage["cache_read_input_tokens"] == len(t1) - 1
