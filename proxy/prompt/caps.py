"""What llama-server believes a chat template supports (its `chat_template_caps`).

The caps decide how the server normalises messages before rendering: typed content parts
joined into a string or strings wrapped into parts, tool-call arguments parsed into
objects, a system message merged into the next one. The server derives them
(common/jinja/caps.cpp `caps_get`) by rendering fixed probe conversations and tracing
which input values the template touched; `probe_caps` renders the same probes with
marker strings and reads "touched" as "its marker reached the output". The proxy may
pass the backend's own `/props` caps instead.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import jinja2

from proxy.prompt.template import ChatTemplate, LenientEnv, TemplateError, llama_tojson


@dataclass(frozen=True)
class TemplateCaps:
    """The server's `chat_template_caps` that shape the prompt."""

    supports_string_content: bool = True
    supports_typed_content: bool = False
    supports_system_role: bool = True
    supports_tools: bool = False
    supports_tool_calls: bool = False
    supports_object_arguments: bool = False

    @classmethod
    def from_props(cls, caps: Mapping[str, Any]) -> TemplateCaps:
        names = cls.__dataclass_fields__
        return cls(**{k: bool(v) for k, v in caps.items() if k in names})


def probe_caps(tmpl: ChatTemplate) -> TemplateCaps:
    """`caps_get` for `tmpl` (see the module docstring)."""
    string_ok, typed = _probe_content(tmpl)
    system = _render(tmpl, [{"role": "system", "content": "SYSTEM_MARKER"}, _USER])
    tools, calls, objects = _probe_tools(tmpl)
    return TemplateCaps(
        supports_string_content=string_ok, supports_typed_content=typed,
        supports_system_role=system is not None and "SYSTEM_MARKER" in system,
        supports_tools=tools, supports_tool_calls=calls, supports_object_arguments=objects)


class _TracedStr(str):
    """A message content that records how the template used it (`ops`)."""

    ops: set[str]


class _TracedList(list[Any]):
    ops: set[str]

    def __iter__(self) -> Iterator[Any]:
        self.ops.add("array_access")  # a for loop over it, as the server counts one
        return super().__iter__()


class _TracingEnv(LenientEnv):
    """Records `is string` tests and index access on traced contents."""

    def __init__(self) -> None:
        super().__init__()
        self.tests["string"] = _is_string
        self.filters["tojson"] = _untraced_tojson

    def getitem(self, obj: Any, argument: Any) -> Any:
        if isinstance(obj, _TracedStr | _TracedList) and isinstance(argument, int):
            obj.ops.add("array_access")
        return super().getitem(obj, argument)


def _untraced_tojson(value: Any, *args: Any, **kwargs: Any) -> str:
    # writing parts out whole is no use of them as parts (the server counts none)
    if isinstance(value, _TracedList):
        value = list.copy(value)
    return llama_tojson(value, *args, **kwargs)


def _is_string(value: Any) -> bool:
    if isinstance(value, _TracedStr | _TracedList):
        value.ops.add("test_is_string")
    return isinstance(value, str)


_TRACING_ENV = _TracingEnv()


def _probe_content(tmpl: ChatTemplate) -> tuple[bool, bool]:
    """(string content, typed content): typed when the template indexes or iterates a
    string content, or, having tested for a string, an empty list of parts."""
    traced = _TRACING_ENV.from_string(tmpl.source)
    text = _TracedStr("STRING_MARKER")
    text.ops = set()
    out = _traced_render(traced, text)
    typed = "array_access" in text.ops
    string_ok = out is not None and not (typed and "STRING_MARKER" not in out)
    if "test_is_string" in text.ops:
        parts = _TracedList()
        parts.ops = set()
        if _traced_render(traced, parts) is not None and "array_access" in parts.ops:
            typed = True
    return string_ok, typed


def _traced_render(traced: jinja2.Template, content: Any) -> str | None:
    try:
        return traced.render(messages=[{"role": "user", "content": content}], tools=[],
                             bos_token="", eos_token="", add_generation_prompt=True)
    except TemplateError:
        return None
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError,
            AttributeError, ZeroDivisionError):
        return None


_USER = {"role": "user", "content": "User message"}
_TOOLS = [{"name": "tool", "type": "function", "function": {
    "name": "TOOL_MARKER", "description": "Tool description", "parameters": {
        "type": "object", "properties": {"arg": {"type": "string",
                                                 "description": "Arg description"}},
        "required": ["arg"]}}}]


def _render(tmpl: ChatTemplate, messages: list[dict[str, Any]],
            tools: list[Any] | None = None) -> str | None:
    try:
        return tmpl.render({"messages": messages, "tools": tools or [], "bos_token": "",
                            "eos_token": "", "add_generation_prompt": True})
    except TemplateError:
        return None


def _tool_conversation(args: Any) -> list[dict[str, Any]]:
    return [
        _USER,
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call00001", "type": "function",
            "function": {"name": "CALL_MARKER", "arguments": args}}]},
        {"role": "tool", "content": "Tool response", "tool_call_id": "call00001"},
        {"role": "assistant", "content": "The tool response was 'tool response'"},
        _USER,
    ]


def _probe_tools(tmpl: ChatTemplate) -> tuple[bool, bool, bool]:
    """(tools, tool calls, object arguments): first with object arguments; a render that
    fails tells nothing. Without object arguments, again with string ones: a failure
    then means neither tools nor calls."""
    tools = True
    out = _render(tmpl, _tool_conversation({"arg": "ARG_MARKER"}), _TOOLS)
    if out is not None:
        tools = "TOOL_MARKER" in out
        if "CALL_MARKER" not in out:
            return tools, False, False
        # arguments printed as a Python dict's repr are not really supported
        if "ARG_MARKER" in out and "{'arg': 'ARG_MARKER'}" not in out:
            return tools, True, True
    out = _render(tmpl, _tool_conversation('{"arg": "value"}'), _TOOLS)
    if out is None:
        return False, False, False
    return "TOOL_MARKER" in out, "CALL_MARKER" in out, False
