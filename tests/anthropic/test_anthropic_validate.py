"""`/v1/messages` bodies checked as Anthropic's API checks them (proxy/anthropic/validate.py).

Pure: each refused body names the field's path; the Claude-Code-shaped bodies of the
converter's corpus (and the shapes kvroute's own answers come back in) pass.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from test_anthropic_convert import AGENT_TURNS, CC_SYSTEM, CORPUS, TOOLS

from proxy.anthropic.validate import validate
from proxy.errors import BadRequest

USER = {"role": "user", "content": "hi"}
BASE: dict[str, Any] = {"model": "m", "max_tokens": 16, "messages": [USER]}
CC_TOOLS = [t for t in TOOLS if t["name"] != "NoSchema"]  # (a converter-only shape)
CC_BODY: dict[str, Any] = {**CORPUS["claude_code_like"], "tools": CC_TOOLS}
# Claude Code 2.1.331's second turn (`claude -p`, after a Bash tool_use), long strings cut
RECORDED = json.loads((Path(__file__).with_name("claude_code_request.json")).read_text())


def image(source: Any) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "image", "source": source}]}


def use(*ids: str) -> dict[str, Any]:
    return {"role": "assistant", "content": [
        {"type": "tool_use", "id": i, "name": "Bash", "input": {"command": "ls"}} for i in ids]}


def result(tool_use_id: Any, **extra: Any) -> dict[str, Any]:
    return {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": tool_use_id, "content": "ok", **extra}]}


def tool(**fields: Any) -> dict[str, Any]:
    return {"name": "Bash", "input_schema": {"type": "object"}, **fields}


# (what the body changes, the error's start)
REFUSED: list[tuple[str, dict[str, Any], str]] = [
    # the four the operator reported
    ("image source 5", {"messages": [image(5)]},
     "messages.0.content.0.source: expected an object"),
    ("tool name 5", {"tools": [tool(name=5)]}, "tools.0.name: expected a string"),
    ("tool_result without tool_use", {"messages": [USER, use("toolu_1"), result("toolu_2")]},
     "messages.2.content.0: unexpected `tool_use_id` found in `tool_result` blocks: toolu_2"),
    ("max_tokens missing", {"max_tokens": None}, "max_tokens: Field required"),
    # max_tokens
    ("max_tokens -1", {"max_tokens": -1}, "max_tokens: expected an integer >= 1, got -1"),
    ("max_tokens 0", {"max_tokens": 0}, "max_tokens: expected an integer >= 1"),
    ("max_tokens 8.5", {"max_tokens": 8.5}, "max_tokens: expected an integer"),
    ("max_tokens true", {"max_tokens": True}, "max_tokens: expected an integer"),
    ("max_tokens '8'", {"max_tokens": "8"}, "max_tokens: expected an integer"),
    # messages
    ("messages missing", {"messages": None}, "messages: expected a non-empty array"),
    ("messages empty", {"messages": []}, "messages: expected a non-empty array"),
    ("message not an object", {"messages": ["hi"]}, "messages.0: expected an object"),
    ("role missing", {"messages": [{"content": "x"}]}, "messages.0.role: Field required"),
    ("role 5", {"messages": [{"role": 5, "content": "x"}]},
     "messages.0.role: expected a string"),
    ("content missing", {"messages": [{"role": "user"}]},
     "messages.0.content: Field required"),
    ("content 5", {"messages": [{"role": "user", "content": 5}]},
     "messages.0.content: expected a string or an array"),
    ("block not an object", {"messages": [{"role": "user", "content": ["x"]}]},
     "messages.0.content.0: expected an object"),
    ("block without type", {"messages": [{"role": "user", "content": [{"text": "x"}]}]},
     "messages.0.content.0.type: Field required"),
    ("text block without text", {"messages": [{"role": "user", "content": [
        {"type": "text"}]}]}, "messages.0.content.0.text: Field required"),
    ("text block text 5", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": 5}]}]}, "messages.0.content.0.text: expected a string"),
    # images
    ("image without source", {"messages": [{"role": "user", "content": [{"type": "image"}]}]},
     "messages.0.content.0.source: Field required"),
    ("image source type", {"messages": [image({"type": "svg", "data": "x"})]},
     "messages.0.content.0.source.type: expected 'base64', 'url' or 'file'"),
    ("image media type", {"messages": [image({"type": "base64", "media_type": "image/bmp",
                                              "data": "x"})]},
     "messages.0.content.0.source.media_type: expected one of image/jpeg"),
    ("image data missing", {"messages": [image({"type": "base64",
                                                "media_type": "image/png"})]},
     "messages.0.content.0.source.data: Field required"),
    ("image url 5", {"messages": [image({"type": "url", "url": 5})]},
     "messages.0.content.0.source.url: expected a string"),
    # tool_use / tool_result / thinking
    ("tool_use without id", {"messages": [USER, {"role": "assistant", "content": [
        {"type": "tool_use", "name": "Bash", "input": {}}]}]},
     "messages.1.content.0.id: Field required"),
    ("tool_use input a string", {"messages": [USER, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "Bash", "input": "ls"}]}]},
     "messages.1.content.0.input: expected an object"),
    ("tool_result id 5", {"messages": [USER, use("t"), result(5)]},
     "messages.2.content.0.tool_use_id: expected a string"),
    ("tool_result first", {"messages": [result("t")]},
     "messages.0.content.0: unexpected `tool_use_id`"),
    ("tool_result two turns late", {"messages": [USER, use("t"), result("t"),
                                                 {"role": "assistant", "content": "ok"},
                                                 result("t")]},
     "messages.4.content.0: unexpected `tool_use_id`"),
    # consecutive messages of one role are one turn: a tool_result answers the assistant
    # turn just before its own user turn, not an earlier one
    ("tool_result answering an earlier assistant turn", {"messages": [
        USER, use("a"), result("a"), use("b"), result("b"), result("a")]},
     "messages.5.content.0: unexpected `tool_use_id` found in `tool_result` blocks: a"),
    ("tool_result after a later assistant turn", {"messages": [
        USER, use("a"), USER, {"role": "assistant", "content": "ok"}, result("a")]},
     "messages.4.content.0: unexpected `tool_use_id`"),
    ("tool_result after user turns only", {"messages": [USER, USER, result("a")]},
     "messages.2.content.0: unexpected `tool_use_id`"),
    ("tool_result in the assistant's turn", {"messages": [USER, {
        "role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
     "messages.1.content.0: a tool_result block can only be in a user message"),
    ("tool_result content 5", {"messages": [USER, use("t"), result("t", content=5)]},
     "messages.2.content.0.content: expected a string or an array"),
    ("tool_result image without source", {"messages": [USER, use("t"), result(
        "t", content=[{"type": "image"}])]},
     "messages.2.content.0.content.0.source: Field required"),
    ("tool_result is_error 'yes'", {"messages": [USER, use("t"), result("t", is_error="y")]},
     "messages.2.content.0.is_error: expected a boolean"),
    ("thinking without text", {"messages": [USER, {"role": "assistant", "content": [
        {"type": "thinking", "signature": "s"}]}]},
     "messages.1.content.0.thinking: Field required"),
    # system, tools, tool_choice, the rest
    ("system 42", {"system": 42}, "system: expected a string or an array of text blocks"),
    ("system image block", {"system": [{"type": "image", "source": {}}]},
     "system.0.type: expected 'text'"),
    ("tools not an array", {"tools": {"name": "Bash"}}, "tools: expected an array"),
    ("tool name with a space", {"tools": [tool(name="run shell")]},
     "tools.0.name: String should match pattern '^[a-zA-Z0-9_-]{1,128}$'"),
    ("tool name too long", {"tools": [tool(name="x" * 129)]}, "tools.0.name: String should"),
    ("tool name missing", {"tools": [{"input_schema": {"type": "object"}}]},
     "tools.0.name: Field required"),
    ("tool without input_schema", {"tools": [{"name": "Bash"}]},
     "tools.0.input_schema: Field required"),
    ("tool input_schema of a string", {"tools": [tool(input_schema={"type": "string"})]},
     "tools.0.input_schema.type: expected 'object'"),
    ("tool description 5", {"tools": [tool(description=5)]},
     "tools.0.description: expected a string"),
    ("tool_choice 'auto'", {"tool_choice": "auto"}, "tool_choice: expected an object"),
    ("tool_choice type", {"tool_choice": {"type": "required"}},
     "tool_choice.type: expected one of auto, any, tool, none"),
    ("tool_choice tool without name", {"tool_choice": {"type": "tool"}},
     "tool_choice.name: Field required"),
    ("stop_sequences string", {"stop_sequences": "\n"}, "stop_sequences: expected an array"),
    ("stop_sequences [1]", {"stop_sequences": [1]}, "stop_sequences.0: expected a string"),
    ("thinking without budget", {"thinking": {"type": "enabled"}},
     "thinking.budget_tokens: Field required"),
    ("metadata user_id 5", {"metadata": {"user_id": 5}},
     "metadata.user_id: expected a string"),
    ("model 5", {"model": 5}, "model: expected a string"),
]


@pytest.mark.parametrize(("change", "needle"), [(c, n) for _, c, n in REFUSED],
                         ids=[r[0] for r in REFUSED])
def test_refused_naming_the_field(change: dict[str, Any], needle: str) -> None:
    body = {k: v for k, v in {**BASE, **change}.items() if v is not None}
    with pytest.raises(BadRequest) as e:
        validate(body)
    assert e.value.status == 400 and e.value.type == "invalid_request_error"
    assert e.value.message.startswith(needle), e.value.message


ACCEPTED: list[tuple[str, dict[str, Any]]] = [
    ("Claude Code, recorded", RECORDED),
    ("Claude Code agent turns", CC_BODY),
    ("Claude Code, streamed with thinking", {
        **CC_BODY, "stream": True, "thinking": {"type": "enabled", "budget_tokens": 1024},
        "stop_sequences": [], "temperature": 1, "context_management": {"edits": []}}),
    ("adaptive thinking", {**BASE, "thinking": {"type": "adaptive"}}),
    # kvroute's own answers come back with an empty signature, or none
    ("thinking block as kvroute answers it", {**BASE, "messages": [USER, {
        "role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": ""},
                                         {"type": "text", "text": "ok"}]}, USER]}),
    ("a string system", {**BASE, "system": "Be brief."}),
    ("a prefill", {**BASE, "messages": [USER, {"role": "assistant", "content": "{"}]}),
    ("every image source", {**BASE, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}},
        {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}},
        {"type": "image", "source": {"type": "file", "file_id": "file_1"}},
        {"type": "text", "text": "what are these?"}]}]}),
    # block types kvroute does not convert (dropped, as llama-server drops them)
    ("documents, tool references, server tools", {**BASE, "messages": [
        {"role": "user", "content": [
            {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                            "data": "d"}},
            {"type": "text", "text": "summarise"}]},
        {"role": "assistant", "content": [
            {"type": "redacted_thinking", "data": "xyz"},
            {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search",
             "input": {"query": "q"}},
            {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []},
            {"type": "tool_use", "id": "toolu_9", "name": "ToolSearch", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9",
                                      "content": [{"type": "tool_reference",
                                                   "tool_name": "Bash"}]}]}],
      "tools": [*CC_TOOLS, tool(name="mcp__srv__do-it", defer_loading=True, type="custom")]}),
    ("several tool_results, text after them", {**BASE, "messages": [
        USER, use("a", "b"), {"role": "user", "content": [
            result("b")["content"][0], result("a", is_error=True)["content"][0],
            {"type": "text", "text": "go on"}]}]}),
    ("tool_choice tool", {**BASE, "tools": [tool()],
                          "tool_choice": {"type": "tool", "name": "Bash",
                                          "disable_parallel_tool_use": True}}),
    ("metadata user_id null", {**BASE, "metadata": {"user_id": None}}),
    ("a mid-conversation system turn", {**BASE, "messages": [
        USER, {"role": "assistant", "content": "ok"},
        {"role": "system", "content": "reminder"}, USER]}),
    ("a system turn between tool_use and tool_result", {**BASE, "messages": [
        USER, use("t"), {"role": "system", "content": "env"}, result("t")]}),
    # consecutive messages of one role are one turn, as Anthropic merges them
    ("tool_use, then text, in consecutive assistant messages", {**BASE, "messages": [
        USER, use("t1"), {"role": "assistant", "content": [{"type": "text", "text": "on it"}]},
        result("t1")]}),
    ("tool_uses in consecutive assistant messages, answered together", {**BASE, "messages": [
        USER, use("a"), {"role": "system", "content": "env"}, use("b"),
        {"role": "user", "content": [result("a")["content"][0], result("b")["content"][0]]}]}),
    ("tool_results in consecutive user messages", {**BASE, "messages": [
        USER, use("a", "b"), result("a"), {"role": "user", "content": "and"}, result("b")]}),
    ("a text user message before the tool_result", {**BASE, "messages": [
        USER, use("a"), USER, result("a")]}),
]


@pytest.mark.parametrize("body", [b for _, b in ACCEPTED], ids=[a[0] for a in ACCEPTED])
def test_accepted(body: dict[str, Any]) -> None:
    before = copy.deepcopy(body)
    validate(body)
    assert body == before


def test_count_tokens_needs_no_max_tokens() -> None:
    body = {"model": "m", "system": CC_SYSTEM, "tools": CC_TOOLS, "messages": AGENT_TURNS}
    validate(body, count=True)
    with pytest.raises(BadRequest, match="max_tokens: Field required"):
        validate(body)
    with pytest.raises(BadRequest, match="max_tokens: expected an integer >= 1"):
        validate({**body, "max_tokens": 0}, count=True)
