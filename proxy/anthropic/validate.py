"""The checks Anthropic's Messages API makes on the fields kvroute reads.

`anthropic_to_chat` is as lenient as llama-server's converter: a block of the wrong
shape silently becomes nothing, or an empty tool name. The contract of `/v1/messages`
is Anthropic's API, so what it refuses is refused here first, with a 400 in its error
shape naming the field's path (`messages.2.content.0.source: ...`), as Anthropic does.

Checked: `max_tokens` (required, an integer >= 1), `messages` (roles, content blocks
with their required fields), `system`, `tools`, `tool_choice`, `thinking`,
`stop_sequences`, `metadata`, `model`'s type, and that every `tool_result` answers a
`tool_use` of the assistant turn just before it (a `system` turn between them aside).
Consecutive messages of one role are one turn, as Anthropic merges them: a user turn's
tool_results may answer the tool_use blocks of any message of the assistant turn
before it, from any of its own messages. Left as they are: block types
kvroute does not convert (`document`, server-tool blocks, ...; their list grows with
every Anthropic beta, and both converters drop them), any role string (llama-server
templates a mid-conversation `system` message like any other), consecutive messages of
one role (the template takes them as they are).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from proxy.errors import BadRequest

JSON = dict[str, Any]

# Anthropic's pattern for a custom tool's name.
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,128}")
IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
TOOL_CHOICES = ("auto", "any", "tool", "none")

_KINDS: dict[type | tuple[type, ...], str] = {
    str: "a string", dict: "an object", list: "an array", bool: "a boolean",
    int: "an integer", (int, float): "a number", (str, list): "a string or an array",
}


def _fail(path: str, message: str) -> BadRequest:
    return BadRequest(f"{path}: {message}")


def _is(value: Any, kind: type | tuple[type, ...]) -> bool:
    if isinstance(value, bool):
        return kind is bool
    return isinstance(value, kind)


def _need(obj: Mapping[str, Any], key: str, kind: type | tuple[type, ...], path: str,
          *, required: bool = True) -> Any:
    """``obj[key]`` of type ``kind``: absent (or null) only when not ``required``."""
    value = obj.get(key)
    if value is None:
        if required:
            raise _fail(f"{path}.{key}" if path else key, "Field required")
        return None
    if not _is(value, kind):
        raise _fail(f"{path}.{key}" if path else key, f"expected {_KINDS[kind]}")
    return value


def _object(value: Any, path: str) -> JSON:
    if not isinstance(value, dict):
        raise _fail(path, "expected an object")
    return value


def _image_source(source: JSON, path: str) -> None:
    stype = _need(source, "type", str, path)
    if stype == "base64":
        media = _need(source, "media_type", str, path)
        if media not in IMAGE_MEDIA_TYPES:
            raise _fail(f"{path}.media_type", f"expected one of {', '.join(IMAGE_MEDIA_TYPES)}")
        _need(source, "data", str, path)
    elif stype == "url":
        _need(source, "url", str, path)
    elif stype == "file":
        _need(source, "file_id", str, path)
    else:
        raise _fail(f"{path}.type", "expected 'base64', 'url' or 'file'")


def _block(block: Any, path: str, uses: set[str] | None) -> None:
    """One content block; ``uses``: the tool_use ids a tool_result may answer (None: it
    may not appear here)."""
    block = _object(block, path)
    btype = _need(block, "type", str, path)
    if btype == "text":
        _need(block, "text", str, path)
    elif btype == "image":
        _image_source(_object(_need(block, "source", dict, path), f"{path}.source"),
                      f"{path}.source")
    elif btype == "tool_use":
        _need(block, "id", str, path)
        _need(block, "name", str, path)
        _need(block, "input", dict, path)
    elif btype == "thinking":
        _need(block, "thinking", str, path)
        # (required by Anthropic; kvroute's own answers carry an empty one)
        _need(block, "signature", str, path, required=False)
    elif btype == "redacted_thinking":
        _need(block, "data", str, path)
    elif btype == "document":
        _need(block, "source", dict, path)
    elif btype == "tool_result":
        tool_use_id = _need(block, "tool_use_id", str, path)
        _need(block, "is_error", bool, path, required=False)
        content = _need(block, "content", (str, list), path, required=False)
        if isinstance(content, list):
            for j, part in enumerate(content):
                _block(part, f"{path}.content.{j}", None)
        if uses is None:
            raise _fail(path, "a tool_result block can only be in a user message's content")
        if tool_use_id not in uses:
            raise _fail(path, f"unexpected `tool_use_id` found in `tool_result` blocks: "
                              f"{tool_use_id}. Each `tool_result` block must have a "
                              "corresponding `tool_use` block in the previous message.")


def _tool_use_ids(msg: JSON) -> set[str]:
    """The tool_use ids of an assistant message (its blocks checked already)."""
    content = msg.get("content")
    if not isinstance(content, list):
        return set()
    return {b["id"] for b in content if b.get("type") == "tool_use"}


def _messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise _fail("messages", "expected a non-empty array of messages")
    turn: str | None = None  # the role of the turn the messages so far are in
    asked: set[str] = set()  # the tool_use ids of the last assistant turn
    answerable: set[str] = set()  # the ids the current user turn's tool_results may answer
    for i, msg in enumerate(messages):
        path = f"messages.{i}"
        msg = _object(msg, path)
        role = _need(msg, "role", str, path)
        content = _need(msg, "content", (str, list), path)
        if role == "system":
            pass  # (Claude Code's environment turn may sit between them)
        elif role == "user" and turn != "user":
            answerable = asked if turn == "assistant" else set()
        elif role == "assistant" and turn != "assistant":
            asked = set()
        if isinstance(content, list):
            uses = answerable if role == "user" else None
            for j, block in enumerate(content):
                _block(block, f"{path}.content.{j}", uses)
        if role == "assistant":
            asked |= _tool_use_ids(msg)
        if role != "system":
            turn = role


def _system(system: Any) -> None:
    if isinstance(system, list):
        for i, block in enumerate(system):
            block = _object(block, f"system.{i}")
            if _need(block, "type", str, f"system.{i}") != "text":
                raise _fail(f"system.{i}.type", "expected 'text'")
            _need(block, "text", str, f"system.{i}")
    elif not isinstance(system, str):
        raise _fail("system", "expected a string or an array of text blocks")


def _tools(tools: list[Any]) -> None:
    for i, tool in enumerate(tools):
        path = f"tools.{i}"
        tool = _object(tool, path)
        name = _need(tool, "name", str, path)
        ttype = _need(tool, "type", str, path, required=False)
        if ttype not in (None, "custom"):
            continue  # a server tool (web_search_..., ...): its own fixed name and fields
        if not TOOL_NAME.fullmatch(name):
            raise _fail(f"{path}.name", f"String should match pattern "
                                        f"'^{TOOL_NAME.pattern}$'")
        _need(tool, "description", str, path, required=False)
        schema = _need(tool, "input_schema", dict, path)
        if schema.get("type") != "object":
            raise _fail(f"{path}.input_schema.type", "expected 'object'")


def _tool_choice(choice: JSON) -> None:
    ctype = _need(choice, "type", str, "tool_choice")
    if ctype not in TOOL_CHOICES:
        raise _fail("tool_choice.type", f"expected one of {', '.join(TOOL_CHOICES)}")
    if ctype == "tool":
        _need(choice, "name", str, "tool_choice")
    _need(choice, "disable_parallel_tool_use", bool, "tool_choice", required=False)


def validate(body: Mapping[str, Any], *, count: bool = False) -> None:
    """BadRequest (400, Anthropic's `invalid_request_error`) for the first field of
    ``body`` that Anthropic's API would refuse, among those kvroute reads. ``count``:
    a count_tokens body (no `max_tokens`)."""
    _need(body, "model", str, "", required=False)
    _messages(body.get("messages"))
    max_tokens = _need(body, "max_tokens", int, "", required=not count)
    if max_tokens is not None and max_tokens < 1:
        raise _fail("max_tokens", f"expected an integer >= 1, got {max_tokens}")
    if body.get("system") is not None:
        _system(body["system"])
    tools = _need(body, "tools", list, "", required=False)
    if tools is not None:
        _tools(tools)
    choice = _need(body, "tool_choice", dict, "", required=False)
    if choice is not None:
        _tool_choice(choice)
    stops = _need(body, "stop_sequences", list, "", required=False)
    for i, stop in enumerate(stops or ()):
        if not isinstance(stop, str):
            raise _fail(f"stop_sequences.{i}", "expected a string")
    thinking = _need(body, "thinking", dict, "", required=False)
    if thinking is not None and _need(thinking, "type", str, "thinking") == "enabled":
        _need(thinking, "budget_tokens", int, "thinking")
    metadata = _need(body, "metadata", dict, "", required=False)
    if metadata is not None:
        _need(metadata, "user_id", str, "metadata", required=False)
