"""Anthropic Messages request -> the OpenAI chat request llama-server derives from it.

A faithful port of `server_chat_convert_anthropic_to_oai` (tools/server/server-chat.cpp),
so that `PromptBuilder.chat_tokens(anthropic_to_chat(body))` is the prompt a backend
builds -- and caches -- for `POST /v1/messages`. Quirks kept on purpose:

- all `system` text blocks are concatenated with no separator; a non-string, non-array
  `system` still yields an empty system message; each block's text (or the string) that
  starts with `x-anthropic-billing-header:` has the 5 characters after `cch=` replaced by
  `fffff` when a `;` follows them (Claude Code rotates that value every request);
- a message without `content` is dropped if it is the assistant's, passed through
  otherwise; string content (and non-array content) passes through untouched;
- `text` blocks are kept whole (the template joins them with a newline), `thinking` text
  is concatenated into `reasoning_content`, images become `image_url` parts, `tool_use`
  becomes a tool call whose arguments are the compact JSON dump of `input`, and each
  `tool_result` becomes a following `tool` message (text parts concatenated with no
  separator; any image keeps it as content parts);
- tools become functions (`input_schema` -> `parameters`); `tool_choice` any/tool ->
  "required", auto -> "auto"; `stop_sequences`, `max_tokens` (default 4096),
  `temperature`, `top_p`, `top_k`, `stream`, `chat_template_kwargs`, thinking budget
  and `metadata.user_id` (as `__metadata_user_id`) are carried like the server does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from proxy.prompt.chat_request import PromptError, dump_compact

_BILLING_PREFIX = b"x-anthropic-billing-header:"
_CCH_LEN = 5


def normalize_billing_header(text: str) -> str:
    """normalize_anthropic_billing_header (byte offsets, as the C++ does)."""
    if not text.startswith("x-anthropic-billing-header:"):
        return text
    data = bytearray(text.encode("utf-8"))
    at = data.find(b"cch=", len(_BILLING_PREFIX))
    if at < 0:
        return text
    start = at + 4
    if start + _CCH_LEN < len(data) and data[start + _CCH_LEN] == ord(";"):
        data[start:start + _CCH_LEN] = b"f" * _CCH_LEN
        return data.decode("utf-8", errors="replace")
    return text


def _val(obj: Any, key: str, default: Any, kind: type | tuple[type, ...]) -> Any:
    """json_value(): missing, null, non-object container or wrong type -> default."""
    if not isinstance(obj, dict):
        return default
    v = obj.get(key)
    if v is None or not isinstance(v, kind) or (kind is not bool and isinstance(v, bool)):
        return default
    return v


def _image_part(source: Any) -> dict[str, Any] | None:
    stype = _val(source, "type", "", str)
    if stype == "base64":
        media = _val(source, "media_type", "image/jpeg", str)
        data = _val(source, "data", "", str)
        return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}
    if stype == "url":
        return {"type": "image_url", "image_url": {"url": _val(source, "url", "", str)}}
    return None


def _tool_result(block: Mapping[str, Any]) -> dict[str, Any]:
    tool_use_id = _val(block, "tool_use_id", "", str)
    result = block.get("content")
    if isinstance(result, str):
        content: Any = result
    elif isinstance(result, list):
        text, parts, has_images = "", [], False
        for c in result:
            ctype = _val(c, "type", "", str)
            if ctype == "text":
                t = _val(c, "text", "", str)
                text += t
                parts.append({"type": "text", "text": t})
            elif ctype == "image":
                has_images = True
                part = _image_part(_val(c, "source", {}, dict))
                if part is not None:
                    parts.append(part)
        content = parts if has_images else text
    else:
        content = ""
    return {"role": "tool", "tool_call_id": tool_use_id, "content": content}


def _convert_message(msg: Any, out: list[Any]) -> None:
    role = _val(msg, "role", "", str)
    if not isinstance(msg, dict) or "content" not in msg:
        if role != "assistant":
            out.append(msg)
        return
    content = msg["content"]
    if not isinstance(content, list):
        out.append(msg)
        return
    tool_calls: list[dict[str, Any]] = []
    converted: list[Any] = []
    tool_results: list[dict[str, Any]] = []
    reasoning = ""
    for block in content:
        btype = _val(block, "type", "", str)
        if btype == "text":
            converted.append(block)
        elif btype == "thinking":
            reasoning += _val(block, "thinking", "", str)
        elif btype == "image":
            part = _image_part(_val(block, "source", {}, dict))
            if part is not None:
                converted.append(part)
        elif btype == "tool_use":
            tool_input = block.get("input")
            tool_calls.append({
                "id": _val(block, "id", "", str),
                "type": "function",
                "function": {"name": _val(block, "name", "", str),
                             "arguments": dump_compact({} if tool_input is None
                                                        else tool_input)},
            })
        elif btype == "tool_result":
            tool_results.append(_tool_result(block))
    if converted or tool_calls or reasoning:
        new: dict[str, Any] = {"role": role, "content": converted if converted else ""}
        if tool_calls:
            new["tool_calls"] = tool_calls
        if reasoning:
            new["reasoning_content"] = reasoning
        out.append(new)
    out.extend(tool_results)


def anthropic_to_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    """The OpenAI chat body llama-server builds from an Anthropic `/v1/messages` body."""
    if not isinstance(body, dict):
        raise PromptError("request body must be a JSON object")
    messages: list[Any] = []
    system = body.get("system")
    if system is not None:
        text = ""
        if isinstance(system, str):
            text = normalize_billing_header(system)
        elif isinstance(system, list):
            for block in system:
                if _val(block, "type", "", str) == "text":
                    text += normalize_billing_header(_val(block, "text", "", str))
        messages.append({"role": "system", "content": text})

    if "messages" not in body:
        raise PromptError("'messages' is required")
    if isinstance(body["messages"], list):
        for msg in body["messages"]:
            _convert_message(msg, messages)

    oai: dict[str, Any] = {"messages": messages}
    tools = body.get("tools")
    if isinstance(tools, list):
        oai["tools"] = [{"type": "function", "function": {
            "name": _val(t, "name", "", str),
            "description": _val(t, "description", "", str),
            "parameters": t["input_schema"] if isinstance(t, dict) and "input_schema" in t
            else {},
        }} for t in tools]
    tc = body.get("tool_choice")
    if isinstance(tc, dict):
        tc_type = _val(tc, "type", "", str)
        if tc_type == "auto":
            oai["tool_choice"] = "auto"
        elif tc_type in ("any", "tool"):
            oai["tool_choice"] = "required"
    if "stop_sequences" in body:
        oai["stop"] = body["stop_sequences"]
        if body["stop_sequences"]:
            # a chat answer does not say which one matched; `__verbose.stopping_word` does
            # (trimmed to it by response_fields: whole, it holds the prompt's text)
            oai["verbose"] = True
            oai["response_fields"] = ["stopping_word"]
    oai["max_tokens"] = body.get("max_tokens", 4096)  # a present null is kept, as in C++
    for key in ("temperature", "top_p", "top_k", "stream", "chat_template_kwargs"):
        if key in body:
            oai[key] = body[key]
    if "thinking" in body:
        thinking = _val(body, "thinking", {}, dict)
        if _val(thinking, "type", "", str) == "enabled":
            budget = _val(thinking, "budget_tokens", 10000, (int, float))
            oai["thinking_budget_tokens"] = int(budget)
    if "metadata" in body:
        user_id = _val(_val(body, "metadata", {}, dict), "user_id", "", str)
        if user_id:
            oai["__metadata_user_id"] = user_id
    return oai
