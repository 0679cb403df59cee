"""OpenAI chat request -> the exact Jinja context llama-server renders its prompt from.

A line-by-line port of what llama-server does before templating (tools/server/
server-common.cpp `oaicompat_chat_params_parse`, common/chat.cpp
`common_chat_msgs_parse_oaicompat`, `common_chat_msg::to_json_oaicompat`,
`messages_inp_normalizer`, the `workaround::` functions and
`common_chat_template_direct_apply_impl`). Every quirk matters, because one changed byte
early in the prompt changes every token after it:

- content `null`/absent/`""`/`[]` all become `""`; text parts are joined with `"\\n"` for
  string-only templates (skipping the separator after an empty leading part);
- tool-call `arguments` objects are dumped compactly (nlohmann style) and, when the
  template takes object arguments, every string is parsed back to an object;
- `developer` becomes `system`; tools keep only type/name/description/parameters;
- `tool_choice` never reaches the template; `chat_template_kwargs` (with the server's own
  default `preserve_reasoning: true`) are merged over the context, and `enable_thinking`
  / `reasoning_effort` follow the server's precedence;
- a trailing assistant message is continued (`prefill_assistant`), not closed.

Errors a backend would answer with 400/500 raise `PromptError` with its message.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from proxy.prompt.caps import TemplateCaps
from proxy.prompt.handlers import adjust_messages
from proxy.prompt.media import MARKER, PART_KINDS

MEDIA_MARKER = "media_marker"  # the part type the server makes of a media part


class PromptError(ValueError):
    """The request cannot be turned into a prompt; the message is safe to show the client.
    `status` is what llama-server answers for it: 400, or 500 for a template that fails
    under a specialized handler (the autoparser reports its failures as bad requests)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ServerChatOptions:
    """llama-server settings that shape the prompt (its defaults unless configured)."""

    enable_thinking: bool = False      # server default: template supports thinking
    prefill_assistant: bool = True     # --no-prefill-assistant turns it off
    # --chat-template-kwargs merged with llama-server's implicit preserve_reasoning=true
    chat_template_kwargs: Mapping[str, Any] = field(
        default_factory=lambda: {"preserve_reasoning": True})


@dataclass
class ChatInputs:
    """What `ChatTemplate.render` needs, plus the continuation of a prefilled message."""

    context: dict[str, Any]
    # When a trailing message is continued: the text appended after the generation prompt
    # (llama.cpp appends nothing at all, not even that prompt, for an empty message: None).
    continue_text: str | None


def dump_compact(value: Any) -> str:
    """nlohmann::json::dump(): no spaces, raw UTF-8 (tool-call arguments, every turn)."""
    if _float_free(value):
        try:
            # same text as json.dumps below for these values (escapes included), ~10x
            # faster; it differs on floats (1e+16 vs 1e16)
            return orjson.dumps(value).decode()
        except TypeError:
            pass  # a key that is not a string, an int past 64 bits
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _float_free(value: Any) -> bool:
    stack = [value]
    while stack:
        v = stack.pop()
        t = type(v)
        if t is dict:
            stack.extend(v.values())
        elif t is list:
            stack.extend(v)
        elif not (t is str or t is int or t is bool or v is None):
            return False
    return True


def _get(obj: Mapping[str, Any], key: str, default: Any, kind: type | tuple[type, ...]) -> Any:
    """json_value(): a missing, null or wrongly typed field yields the default."""
    v = obj.get(key)
    if v is None or not isinstance(v, kind) or (kind is not bool and isinstance(v, bool)):
        return default
    return v


def _need_str(v: Any, what: str) -> str:
    if not isinstance(v, str):
        raise PromptError(f"{what} must be a string, got {json.dumps(v)[:200]}")
    return v


def _content_parts(content: list[Any]) -> list[dict[str, str]]:
    parts = []
    for part in content:
        if not isinstance(part, dict):
            raise PromptError(f"content parts must be objects, got {json.dumps(part)[:200]}")
        ptype = part.get("type")
        if ptype in PART_KINDS:
            # the server's marker (a backend without a projector refuses the request)
            parts.append({"type": MEDIA_MARKER, "text": MARKER})
            continue
        if ptype != "text":
            raise PromptError("unsupported content[].type")
        if "text" not in part:
            raise PromptError("Failed to parse messages: content part without 'text'")
        parts.append({"type": "text", "text": _need_str(part["text"], "content[].text")})
    return parts


def _join_parts(parts: Sequence[Mapping[str, str]], delimiter: str = "\n") -> str:
    # messages_inp_normalizer::concat_content_parts: the delimiter between text parts
    # once text has accumulated (leading empty parts add nothing), never next to a media
    # marker
    text, after_marker = "", False
    for p in parts:
        marker = p["type"] == MEDIA_MARKER
        if text and not marker and not after_marker:
            text += delimiter
        text += p["text"]
        after_marker = marker
    return text


def _parse_message(msg: Any) -> dict[str, Any]:
    """common_chat_msgs_parse_oaicompat + to_json_oaicompat for one message."""
    if not isinstance(msg, dict):
        raise PromptError(f"Expected 'message' to be an object, got {json.dumps(msg)[:200]}")
    if "role" not in msg:
        raise PromptError("Failed to parse messages: Missing 'role' in message")
    role = _need_str(msg["role"], "message role")
    content: str | list[dict[str, str]] = ""
    if "content" in msg:
        c = msg["content"]
        if isinstance(c, str):
            content = c
        elif isinstance(c, list):
            parts = _content_parts(c)
            content = parts if parts else ""
        elif c is not None:
            raise PromptError("Expected 'content' to be a string or an array")
    elif role != "assistant":
        raise PromptError("All non-assistant messages must contain 'content'")
    out: dict[str, Any] = {"role": role, "content": content}
    tool_calls = []
    if "tool_calls" in msg:
        tcs = msg["tool_calls"]
        # NOTE: nlohmann::json iterates an object's values and a scalar as itself, and
        # each must then be a tool call: any JSON is a 400, not a TypeError
        items = tcs if isinstance(tcs, list) else list(tcs.values()) \
            if isinstance(tcs, dict) else [] if tcs is None else [tcs]
        for tc in items:
            tool_calls.append(_parse_tool_call(tc))
    elif "content" not in msg:
        raise PromptError("Assistant message must contain either 'content' or 'tool_calls'!")
    for key, out_key in (("reasoning_content", "reasoning_content"), ("name", "name"),
                         ("tool_call_id", "tool_call_id")):
        if key in msg:
            v = _need_str(msg[key], f"message {key}")
            if v:
                out[out_key] = v
    if tool_calls:
        out["tool_calls"] = tool_calls
    return out


def _parse_tool_call(tc: Any) -> dict[str, Any]:
    if not isinstance(tc, dict) or "type" not in tc:
        raise PromptError("Failed to parse messages: Missing tool call type")
    if tc["type"] != "function":
        raise PromptError("Failed to parse messages: Unsupported tool call type")
    fc = tc.get("function")
    if not isinstance(fc, dict):
        raise PromptError("Failed to parse messages: Missing tool call function")
    if "name" not in fc:
        raise PromptError("Failed to parse messages: Missing tool call name")
    if "arguments" not in fc:
        raise PromptError("Failed to parse messages: Missing tool call arguments")
    args = fc["arguments"]
    out: dict[str, Any] = {"type": "function", "function": {
        "name": _need_str(fc["name"], "tool call name"),
        "arguments": args if isinstance(args, str) else dump_compact(args)}}
    if "id" in tc:
        tc_id = _need_str(tc["id"], "tool call id")
        if tc_id:
            out["id"] = tc_id
    return out


def parse_tools(tools: Any) -> list[dict[str, Any]]:
    """common_chat_tools_parse_oaicompat + common_chat_tools_to_json_oaicompat."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise PromptError("Failed to parse tools: Expected 'tools' to be an array")
    out = []
    for tool in tools:
        if not isinstance(tool, dict) or "type" not in tool:
            raise PromptError("Failed to parse tools: Missing tool type")
        if tool["type"] != "function":
            raise PromptError("Failed to parse tools: Unsupported tool type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise PromptError("Failed to parse tools: Missing tool function")
        if "name" not in fn:
            raise PromptError("Failed to parse tools: Missing tool name")
        desc = fn.get("description", "")
        out.append({"type": "function", "function": {
            "name": _need_str(fn["name"], "tool name"),
            "description": _need_str(desc, "tool description"),
            "parameters": fn.get("parameters", {}),
        }})
    return out


def _render_content(msg: Mapping[str, Any]) -> str:
    # common_chat_msg::render_content(delimiter="\n\n")
    c = msg.get("content", "")
    return c if isinstance(c, str) else _join_parts(
        [p for p in c if p["type"] == "text"], "\n\n")


def build_inputs(body: Mapping[str, Any], caps: TemplateCaps, source: str,
                 bos_token: str, eos_token: str, options: ServerChatOptions) -> ChatInputs:
    """The Jinja context for `body` (see module docstring); `source` picks workarounds."""
    messages, tools = _parse_body(body)
    add_gen, continue_text = _continuation(body, messages, options)
    messages = _as_server_renders(messages, caps, source)
    ctx = _jinja_context(body, options, messages, tools, bos_token, eos_token)
    if add_gen:
        ctx["add_generation_prompt"] = True
    return ChatInputs(ctx, continue_text)


def _parse_body(body: Mapping[str, Any]) -> tuple[list[dict[str, Any]], Any]:
    """The request's messages and tools, refused as the server refuses them."""
    if not isinstance(body, dict):
        raise PromptError("request body must be a JSON object")
    if "messages" not in body:
        raise PromptError("'messages' is required")
    raw = body["messages"]
    if not isinstance(raw, list):
        raise PromptError("Expected 'messages' to be an array")
    messages = [_parse_message(m) for m in raw]
    tools = parse_tools(body.get("tools"))
    tool_choice = _get(body, "tool_choice", "auto", str)
    if tool_choice not in ("auto", "none", "required"):
        raise PromptError(f"Invalid tool_choice: {tool_choice}")
    return messages, tools


def _continuation(body: Mapping[str, Any], messages: list[dict[str, Any]],
                  options: ServerChatOptions) -> tuple[bool, str | None]:
    """(add_generation_prompt, the text the prompt continues with): a final assistant
    message continued (taken off ``messages``) rather than answered."""
    add_gen = _get(body, "add_generation_prompt", True, bool)
    cont = _continuation_mode(body.get("continue_final_message"))
    if not cont and options.prefill_assistant and messages and messages[-1]["role"] == "assistant":
        if len(messages) >= 2 and messages[-2]["role"] == "assistant":
            raise PromptError("Cannot have 2 or more assistant messages at the end of the list.")
        cont, add_gen = "auto", False
    if cont and add_gen:
        raise PromptError("Cannot set both add_generation_prompt and continue_final_message "
                          "to true.")
    if cont and messages and messages[-1]["role"] == "assistant" and messages[-1].get(
            "tool_calls"):
        raise PromptError("Cannot continue an assistant message that contains tool calls.")
    continue_text = None
    if cont and messages:
        last = messages.pop()
        if len(last) > 2 or last["content"] != "":  # common_chat_msg::empty() is false
            if cont == "auto":  # resolved as in common_chat_templates_apply_jinja
                cont = "reasoning_content" if last.get("reasoning_content") and \
                    last["content"] == "" else "content"
            # Without reasoning markers in the template only content is appended.
            continue_text = _render_content(last) if cont == "content" else ""
    return add_gen, continue_text


def _as_server_renders(messages: list[dict[str, Any]], caps: TemplateCaps,
                       source: str) -> list[dict[str, Any]]:
    """The messages as the server hands them to the template: content normalized, roles
    it renames, a system message merged where the template has no system role, tool call
    arguments as objects where it takes them so, the template's own workarounds."""
    messages = _normalize_content(messages, caps)
    if "<|channel|>" not in source:
        for m in messages:
            if m["role"] == "developer":
                m["role"] = "system"
    if not caps.supports_system_role and messages and messages[0]["role"] == "system":
        first = messages.pop(0)
        if messages:
            if not isinstance(first["content"], str) or not isinstance(
                    messages[0]["content"], str):
                raise PromptError("cannot merge a typed-content system message")
            messages[0]["content"] = first["content"] + "\n" + messages[0]["content"]
    if caps.supports_object_arguments:
        for m in messages:
            for tc in m.get("tool_calls", ()):
                args = tc["function"]["arguments"]
                if isinstance(args, str):
                    try:
                        # orjson: as strict as the server's parser (no NaN/Infinity,
                        # no 1e400, integers past 64 bits as floats); json takes them
                        tc["function"]["arguments"] = orjson.loads(args)
                    except ValueError as e:
                        raise PromptError(
                            f"Failed to parse tool call arguments as JSON: {e}") from e
    return adjust_messages(source, messages)


def _jinja_context(body: Mapping[str, Any], options: ServerChatOptions,
                   messages: list[dict[str, Any]], tools: Any, bos_token: str,
                   eos_token: str) -> dict[str, Any]:
    kwargs = _template_kwargs(body, options)
    enable_thinking = kwargs.pop("__enable_thinking__")
    ctx: dict[str, Any] = {"messages": messages, "bos_token": bos_token,
                           "eos_token": eos_token, "enable_thinking": enable_thinking}
    if tools:
        ctx["tools"] = tools
    now = time.localtime()
    ctx["datetime"] = time.strftime("%b %d %Y", now)
    ctx["date_string"] = time.strftime("%d %b %Y", now)
    ctx.update(kwargs)
    if isinstance(ctx.get("preserve_reasoning"), bool):
        on = ctx["preserve_reasoning"]
        ctx.update(preserve_thinking=on, clear_thinking=not on,
                   truncate_history_thinking=not on, drop_thinking=not on)
    effort = ctx.get("reasoning_effort")
    if isinstance(effort, str) and effort:
        ctx["reasoning_strength"] = effort
    return ctx


def _continuation_mode(value: Any) -> str | None:
    """common_chat_continuation_parse: "auto", "content", "reasoning_content" or None."""
    if value is True:
        return "auto"
    return value if value in ("content", "reasoning_content") else None


def _normalize_content(messages: list[dict[str, Any]], caps: TemplateCaps
                       ) -> list[dict[str, Any]]:
    only_string = caps.supports_string_content and not caps.supports_typed_content
    only_typed = caps.supports_typed_content and not caps.supports_string_content
    for m in messages:
        c = m["content"]
        # common_chat_msg::to_json_oaicompat: a message holding media is one string (and
        # then, for a template taking typed content only, one text part)
        if isinstance(c, list) and (only_string or any(p["type"] == MEDIA_MARKER for p in c)):
            c = m["content"] = _join_parts(c)
        if only_typed and isinstance(c, str):
            m["content"] = [{"type": "text", "text": c}]
    return messages


def _template_kwargs(body: Mapping[str, Any], options: ServerChatOptions) -> dict[str, Any]:
    kwargs = dict(options.chat_template_kwargs)
    req = body.get("chat_template_kwargs")
    if isinstance(req, dict):
        kwargs.update(req)
    enable_thinking = options.enable_thinking
    et = kwargs.get("enable_thinking")
    if et is True or et is False:
        enable_thinking = et
    elif isinstance(et, str):
        raise PromptError('invalid type for "enable_thinking" (expected boolean, got string)')
    effort = _get(body, "reasoning_effort", "", str)
    if effort == "none":
        enable_thinking = False
        kwargs.pop("reasoning_effort", None)
    elif effort:
        kwargs["reasoning_effort"] = effort
    kwargs["__enable_thinking__"] = enable_thinking
    return kwargs
