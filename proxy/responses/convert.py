"""OpenAI Responses request -> the OpenAI chat request llama-server derives from it.

A faithful port of `server_chat_convert_responses_to_chatcmpl` (tools/server/
server-chat.cpp), so that `PromptBuilder.chat_tokens(responses_to_chat(body))` is the
prompt a backend builds -- and caches -- for `POST /v1/responses`. The server's JSON is
insertion-ordered, and so is this: keys keep their place (the template dumps tools with
`tojson`, where order is text). Quirks kept on purpose:

- every field of the body but `input`, `instructions`, `tools`, `max_output_tokens` and
  `reasoning` passes through to the chat body as it is (`id_slot`, `cache_prompt`,
  `temperature`, `tool_choice`, `store`, ...); a non-empty string
  `previous_response_id` is refused (the server keeps no responses);
- `instructions` (any type: a non-string one is `""`) becomes a leading system message;
- a string `content` of any item becomes one `input_text` part first; user, system and
  developer messages keep their other keys (`id`, ...) but `type` and `status`;
- an assistant item needs `type: "message"`; it, a `function_call` and a `reasoning`
  item merge into a directly preceding assistant message (content parts appended, tool
  call added, `reasoning_content` replaced), else start one;
- a `reasoning` item needs a non-empty `content` whose first part has string `text`;
- tools other than `function` are skipped; the others lose `type`, get `strict: true`
  unless they say, and become chat functions; none left -> no `tools`;
- `max_output_tokens` -> `max_tokens` (a null kept); `reasoning.effort` ->
  `reasoning_effort`.

Errors carry the server's messages, prefixed with the index of the input item at fault.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from proxy.prompt.chat_request import PromptError

JSON = dict[str, Any]

_INPUT_ROLES = ("user", "system", "developer")


def _str(obj: Any, key: str) -> str:
    """json_value(obj, key, std::string()): missing, null or not a string -> ""."""
    v = obj.get(key) if isinstance(obj, dict) else None
    return v if isinstance(v, str) else ""


def _is(obj: Any, key: str, kind: type) -> bool:
    """exists_and_is_string / exists_and_is_array."""
    return isinstance(obj, dict) and isinstance(obj.get(key), kind)


def _input_message(item: JSON) -> JSON:
    content: list[JSON] = []
    for part in item["content"]:
        ptype = _str(part, "type")
        if ptype == "input_text":
            if "text" not in part:
                raise PromptError("'Input text' requires 'text'")
            content.append({"text": part["text"], "type": "text"})
        elif ptype == "input_image":
            if "image_url" not in part:
                raise PromptError("'image_url' is required")
            content.append({"image_url": {"url": part["image_url"]}, "type": "image_url"})
        elif ptype == "input_file":
            raise PromptError("'input_file' is not supported by llamacpp at this moment")
        else:
            raise PromptError("'type' must be one of 'input_text', 'input_image', or "
                              "'input_file'")
    item.pop("type", None)
    item.pop("status", None)
    item["content"] = content
    return item


def _output_content(item: JSON) -> list[JSON]:
    content = item.get("content")
    if isinstance(content, str):
        return [{"text": content, "type": "text"}]
    out: list[JSON] = []
    for part in content if isinstance(content, list) else ():
        ptype = _str(part, "type")
        if ptype in ("output_text", "input_text"):
            if not _is(part, "text", str):
                raise PromptError("'Output text' requires 'text'")
            out.append({"text": part["text"], "type": "text"})
        elif ptype == "refusal":
            if not _is(part, "refusal", str):
                raise PromptError("'Refusal' requires 'refusal'")
            out.append({"refusal": part["refusal"], "type": "refusal"})
        else:
            raise PromptError("'type' must be one of 'output_text' or 'refusal'")
    return out


def _tool_output(item: JSON) -> JSON:
    output = item["output"]
    if isinstance(output, list):
        parts = []
        for part in output:
            if not isinstance(part, dict) or "type" not in part:
                raise PromptError("Output of tool call missing 'type' field")
            ptype = part["type"]
            if ptype not in ("input_text", "input_image"):
                raise PromptError("Output of tool call should be 'Input text' or "
                                  "'Input image'")
            part = dict(part)
            if ptype == "input_text":
                part["type"] = "text"
            else:
                if "image_url" not in part:
                    raise PromptError("'image_url' is required")
                part["type"] = "image_url"
                part["image_url"] = {"url": part["image_url"]}
            parts.append(part)
        output = parts
    return {"content": output, "role": "tool", "tool_call_id": item["call_id"]}


def _reasoning_text(item: JSON) -> Any:
    content = item.get("content")
    if not isinstance(content, list):
        raise PromptError("item['content'] is not an array")
    if not content:
        raise PromptError("item['content'] is empty")
    if not _is(content[0], "text", str):
        raise PromptError("item['content']['text'] is not a string")
    return content[0]["text"]


def _add_item(item: Any, messages: list[JSON]) -> None:
    """One input item, converted into `messages` (appended, or merged into the last)."""
    merge = bool(messages) and messages[-1].get("role") == "assistant"
    if isinstance(item, dict):
        item = dict(item)  # (the client's body is not changed)
        if isinstance(item.get("content"), str):
            item["content"] = [{"text": item["content"], "type": "input_text"}]
    role = item.get("role") if isinstance(item, dict) else None
    itype = item.get("type") if isinstance(item, dict) else None
    if _is(item, "content", list) and role in _INPUT_ROLES and isinstance(role, str):
        messages.append(_input_message(item))
    elif role == "assistant" and itype in ("message", None):
        # the short form without "type" (what the OpenAI API and its SDKs' users send
        # back) reads as the message it means; llama-server alone refuses it
        content = _output_content(item)
        if merge:
            prev = messages[-1]
            if not isinstance(prev.get("content"), list):
                prev["content"] = []
            prev["content"] = [*prev["content"], *content]
        else:
            item.pop("status", None)
            item.pop("type", None)
            item["content"] = content
            messages.append(item)
    elif (itype == "function_call" and _is(item, "arguments", str)
          and _is(item, "call_id", str) and _is(item, "name", str)):
        call = {"function": {"arguments": item["arguments"], "name": item["name"]},
                "id": item["call_id"], "type": "function"}
        if merge:
            prev = messages[-1]
            if not isinstance(prev.get("tool_calls"), list):
                prev["tool_calls"] = []
            prev["tool_calls"] = [*prev["tool_calls"], call]
        else:
            messages.append({"role": "assistant", "tool_calls": [call]})
    elif (itype == "function_call_output" and _is(item, "call_id", str)
          and isinstance(item.get("output"), str | list)):
        messages.append(_tool_output(item))
    elif itype == "reasoning" and _is(item, "summary", list):
        text = _reasoning_text(item)
        if merge:
            messages[-1]["reasoning_content"] = text
        else:
            messages.append({"role": "assistant", "content": [], "reasoning_content": text})
    else:
        raise PromptError("Cannot determine type of 'item' (expected a message with a role "
                          "-- an assistant's with \"type\": \"message\" -- or a "
                          "function_call, function_call_output or reasoning item with "
                          "its fields)")


def _tools(tools: Any) -> list[JSON]:
    if not isinstance(tools, list):
        raise PromptError("'tools' must be an array of objects")
    out = []
    for tool in tools:
        if _str(tool, "type") != "function":
            continue  # (web_search, ...: nothing in chat completions does them)
        function = {k: v for k, v in tool.items() if k != "type"}
        function.setdefault("strict", True)
        out.append({"type": "function", "function": function})
    return out


def responses_to_chat(body: Mapping[str, Any]) -> JSON:
    """The OpenAI chat body llama-server builds from a `/v1/responses` body."""
    if not isinstance(body, dict):
        raise PromptError("request body must be a JSON object")
    if "input" not in body:
        raise PromptError("'input' is required")
    if _str(body, "previous_response_id"):
        raise PromptError("llama.cpp does not support 'previous_response_id'.")
    chat = {k: v for k, v in body.items() if k not in ("input", "instructions")}
    messages: list[JSON] = []
    if "instructions" in body:
        messages.append({"role": "system", "content": _str(body, "instructions")})
    value = body["input"]
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
    elif isinstance(value, list):
        for i, item in enumerate(value):
            try:
                _add_item(item, messages)
            except PromptError as e:
                raise PromptError(f"input[{i}]: {e}") from None  # (the server names none)
    else:
        raise PromptError("'input' must be a string or array of objects")
    chat["messages"] = messages
    if "tools" in body:
        tools = _tools(body["tools"])
        del chat["tools"]
        if tools:
            chat["tools"] = tools
    if "max_output_tokens" in body:
        del chat["max_output_tokens"]
        chat["max_tokens"] = body["max_output_tokens"]
    if "reasoning" in body:
        reasoning = body["reasoning"]
        if isinstance(reasoning, dict) and "effort" in reasoning:
            chat["reasoning_effort"] = reasoning["effort"]
        chat.pop("reasoning", None)
    return chat
