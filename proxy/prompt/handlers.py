"""Which of llama-server's per-template handlers renders a template, and what it changes.

`common_chat_try_specialized_template` (common/chat.cpp) picks a dedicated handler for
some model families by looking for marker strings in the template's source; every other
template goes through the differential "autoparser". A handler may reshape the messages
before rendering (LFM2 and GPT-OSS read reasoning from `thinking`, Ministral 3 from a
`thinking` content block) and decides whether the template "supports thinking", which is
the server's default for `enable_thinking` (`--reasoning` unset).

The autoparser's answer comes from rendering probe conversations and looking for tags
around the reasoning (common/chat-diff-analyzer.cpp `analyze_reasoning`); `_autoparser_
thinks` follows the same probes and the same tests on the rendered text.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import orjson

from proxy.prompt.caps import TemplateCaps
from proxy.prompt.template import ChatTemplate, TemplateError

# (handler, markers that must all be present, markers that must be absent), in the order
# llama.cpp tests them: the first match wins.
_HANDLERS: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("ministral_3", ("[SYSTEM_PROMPT]", "[TOOL_CALLS]", "[ARGS]"), ("[CALL_ID]",)),
    ("gpt_oss", ("<|channel|>",), ()),
    ("muse_glimmer", ("<atem:function_calls>", "<|eom|>"), ()),
    ("functionary_v3_2", (">>>all", ">>>${recipient}"), ()),
    ("kimi_k2", ("<|tool_calls_section_begin|>", "<|tool_call_begin|>"), ()),
    ("kimi_k3", ("<|open|>", "<|close|>", "<|end_of_msg|>"), ()),
    ("ling3", ("<role>ASSISTANT</role>", "<arg_key>"), ()),
    ("cohere2moe", ("<|START_TEXT|>", "<|START_ACTION|>"), ()),
    ("lfm2", ("<|tool_list_start|>", "<|tool_list_end|>"), ()),
    ("lfm2", ("List of tools: [",), ("<|tool_list_start|>",)),
    ("gigachat_v3", ("<|role_sep|>", "<|message_sep|>"), ("<|function_call|>",)),
    ("minimax_m3", ("]<]minimax[>[", "<tool_call>", "<invoke name="), ()),
    ("deepseek_v3_2", ("dsml_token", "DSML"), ()),
    ("gemma4", ("'<|tool_call>call:'",), ()),
    ("minicpm5", ("Tool usage guidelines:", '<function name="', '<param name="'), ()),
    ("qwen3_coder", ("<tool_call>", "<function=", "<parameter="),
     ("'<tool_call><function=' ~ tool_call.name ~ '>'",)),
)
# handlers that leave `supports_thinking` false
_NO_THINKING = frozenset(("functionary_v3_2", "gigachat_v3"))


# common_chat_templates_init rewrites a check some templates fail on (GPT-OSS: a channel
# tag in content; Mistral: a tool-call message with no content) before compiling them.
_SOURCE_PATCHES = (
    ("<|channel|>", "in message.content or",
     '{%- if "<|channel|>analysis<|message|>" in message.content or '
     '"<|channel|>final<|message|>" in message.content %}'),
    ("[TOOL_CALLS]", "if (message['content'] is none or",
     "{%- if (message['content'] is none or message['content'] == '' or "
     "message['content']|length == 0) and (message['tool_calls'] is not defined or "
     "message['tool_calls'] is none or message['tool_calls']|length == 0) %}"),
)


def patch_source(source: str) -> str:
    """The default template's text as the server compiles it (see _SOURCE_PATCHES)."""
    for marker, probe, check in _SOURCE_PATCHES:
        if marker in source and probe in source:
            source = source.replace(check, "{%- if false %}")
    return source


@functools.lru_cache(maxsize=16)
def detect_handler(source: str) -> str | None:
    """The specialized handler llama-server uses for this template; None: the autoparser.
    Cached: every request asks, and a template's text is long."""
    for name, present, absent in _HANDLERS:
        if all(m in source for m in present) and not any(m in source for m in absent):
            if name == "deepseek_v3_2" and "function_calls" not in source \
                    and "tool_calls" not in source:
                continue
            return name
    return None


def supports_thinking(tmpl: ChatTemplate, caps: TemplateCaps) -> bool:
    """`common_chat_templates_support_enable_thinking`: the server's default for
    `enable_thinking` when it is started without `--reasoning`."""
    handler = detect_handler(tmpl.source)
    if handler == "qwen3_coder":
        return "<think>" in tmpl.source
    if handler is not None:
        return handler not in _NO_THINKING
    return _autoparser_thinks(tmpl, caps)


def finish_prompt(source: str, prompt: str, add_generation_prompt: bool) -> str:
    """What a handler appends to the rendered prompt: Gemma 4's template opens no model
    turn after an assistant message that had text and tool calls; the server does."""
    if add_generation_prompt and prompt.endswith("<turn|>\n") \
            and detect_handler(source) == "gemma4":
        return prompt + "<|turn>model\n"
    return prompt


def adjust_messages(source: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages a specialized handler renders instead of the parsed ones."""
    handler = detect_handler(source)
    if handler == "gemma4" and "{#- OpenAI Chat Completions:" not in source:
        return _gemma4_tool_responses(messages)  # the server's fix for older templates
    if handler == "deepseek_v3_2" and "function_calls" not in source:
        return _tool_results_in_call_order(messages)  # V4
    adjust = _ADJUSTERS.get(handler or "")
    return adjust(messages) if adjust else messages


def _tool_results_in_call_order(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """deepseek_v4_sort_tool_results: the tool results of a run of user/tool messages, in
    the order of the calls of the assistant message before them (matched by id)."""
    out = list(messages)
    order: dict[str, int] = {}
    i = 0
    while i < len(out):
        role = out[i]["role"]
        if role == "assistant" and out[i].get("tool_calls"):
            order = {tc["id"]: n for n, tc in enumerate(out[i]["tool_calls"]) if tc.get("id")}
        if role not in ("user", "tool"):
            i += 1
            continue
        end = i
        while end < len(out) and out[end]["role"] in ("user", "tool"):
            end += 1
        tools = [k for k in range(i, end) if out[k]["role"] == "tool"]
        if len(tools) > 1 and order:
            ranked = sorted((out[k] for k in tools),
                            key=lambda m: order.get(m.get("tool_call_id", ""), 0))
            for k, m in zip(tools, ranked, strict=True):
                out[k] = m
        i = max(end, i + 1)
    return out


def _thinking_field(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # LFM2: the template reads reasoning from `thinking`
    return [{**m, "thinking": m["reasoning_content"]} if "reasoning_content" in m else m
            for m in messages]


def _gpt_oss(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        if "reasoning_content" in m:
            m = {**m, "thinking": m["reasoning_content"]}
            if m.get("tool_calls"):
                m.pop("content", None)
        out.append(m)
    return out


def _ministral_3(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # system and assistant content becomes blocks: reasoning as a `thinking` block first
    out = []
    for m in messages:
        if m["role"] not in ("system", "assistant"):
            out.append(m)
            continue
        blocks: list[Any] = []
        if "reasoning_content" in m:
            blocks.append({"type": "thinking", "thinking": m["reasoning_content"]})
        content = m.get("content")
        if isinstance(content, str):
            blocks.append({"type": "text", "text": content})
        elif isinstance(content, list):
            blocks.extend(content)
        adjusted = {k: v for k, v in m.items() if k != "reasoning_content"}
        adjusted["content"] = blocks
        out.append(adjusted)
    return out


def _gemma4_tool_responses(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """convert_tool_responses_gemma4: an assistant turn with tool calls, the tool results
    after it and a final assistant answer become one message with `tool_responses`."""
    out: list[dict[str, Any]] = []
    i = 0
    while i < len(messages):
        msg = messages[i]
        if msg["role"] != "assistant" or not msg.get("tool_calls"):
            out.append(msg)
            i += 1
            continue
        merged: dict[str, Any] = {"role": "assistant", "tool_calls": msg["tool_calls"]}
        calls = msg["tool_calls"]
        responses = []
        i += 1
        while i < len(messages) and messages[i]["role"] == "tool":
            responses.append(_gemma4_response(messages[i], calls, len(responses)))
            i += 1
        if responses:
            merged["tool_responses"] = responses
        if i < len(messages) and messages[i]["role"] == "assistant" \
                and not messages[i].get("tool_calls") and messages[i].get("content"):
            merged["content"] = messages[i]["content"]
            i += 1
        if "reasoning_content" in msg:
            merged["reasoning_content"] = msg["reasoning_content"]
        out.append(merged)
    return out


def _gemma4_response(tool: dict[str, Any], calls: list[dict[str, Any]], idx: int
                     ) -> dict[str, Any]:
    content = tool.get("content")
    response: Any = content
    if isinstance(content, str):
        try:
            response = orjson.loads(content)  # JSON results as values, else the text
        except orjson.JSONDecodeError:
            response = content
    name = calls[idx]["function"]["name"] if idx < len(calls) else ""
    return {"name": name or tool.get("tool_call_id", ""), "response": response}


_ADJUSTERS: dict[str, Callable[[list[dict[str, Any]]], list[dict[str, Any]]]] = {
    "lfm2": _thinking_field, "gpt_oss": _gpt_oss, "ministral_3": _ministral_3}

# -- the autoparser's reasoning analysis ----------------------------------------------

_USER = "U_USER_MSG Hello END_U"
_ASSISTANT = "A_ASST_MSG I can help END_A"
_THINKING = "REASON_PART I am thinking END_R"
_MARKER = r"(?:<[^>]*>|\[[^\]]*\])"
# the reasoning, then (after blanks) a tag closing it
_CLOSED_REASONING = re.compile(re.escape(_THINKING) + r"\s*" + _MARKER)
_PROBE_TOOLS = [{"type": "function", "function": {
    "name": name, "description": "Test function", "parameters": {
        "type": "object", "properties": {
            "AA_ARG_FST_AA": {"type": "string", "description": "First argument"},
            "BB_ARG_SND_BB": {"type": "string", "description": "Second argument"}},
        "required": []}}} for name in ("FFF_FIRST_FUN_F", "SSS_SECOND_FUN_S")]


def _probe(tmpl: ChatTemplate, caps: TemplateCaps, messages: list[dict[str, Any]], *,
           add_generation_prompt: bool, enable_thinking: bool,
           tools: list[Any] | None = None) -> str | None:
    ctx: dict[str, Any] = {"messages": _typed(messages, caps), "bos_token": tmpl.bos_token,
                           "eos_token": tmpl.eos_token, "enable_thinking": enable_thinking}
    if tools:
        ctx["tools"] = tools
    if add_generation_prompt:
        ctx["add_generation_prompt"] = True
    try:
        return tmpl.render(ctx)
    except TemplateError:
        return None


def _typed(messages: list[dict[str, Any]], caps: TemplateCaps) -> list[dict[str, Any]]:
    if caps.supports_string_content or not caps.supports_typed_content:
        return messages
    return [{**m, "content": [{"type": "text", "text": m["content"]}]}
            if isinstance(m.get("content"), str) else m for m in messages]


def _autoparser_thinks(tmpl: ChatTemplate, caps: TemplateCaps) -> bool:
    src = tmpl.source
    if _patched_to_think(src):
        return True
    tagged = _reasoning_tagged(tmpl, caps) or _thinking_toggles(tmpl, caps)
    if caps.supports_tool_calls:
        scoped = _tools_only_reasoning(tmpl, caps)
        if scoped is not None:
            return scoped
    return tagged


def _patched_to_think(src: str) -> bool:
    # chat-diff-analyzer.cpp `workarounds`: old Qwen/DeepSeek, Granite 3.3, Nemotron Nano v2
    return ("content.split('</think>')" in src and "reasoning_content" not in src
            and "<SPECIAL_12>" not in src) or (
        "Write your thoughts between <think></think> and write your response between "
        "<response></response>" in src) or all(
        m in src for m in ("<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>", "<TOOL_RESPONSE>"))


def _reasoning_tagged(tmpl: ChatTemplate, caps: TemplateCaps) -> bool:
    """compare_reasoning_presence: a past turn's reasoning is rendered and closed by a tag."""
    user = {"role": "user", "content": _USER}
    plain = {"role": "assistant", "content": _ASSISTANT}
    out_a = _probe(tmpl, caps, [user, plain], add_generation_prompt=False,
                   enable_thinking=True)
    out_b = _probe(tmpl, caps, [user, {**plain, "reasoning_content": _THINKING}],
                   add_generation_prompt=False, enable_thinking=True)
    if out_a is None or out_b is None or _THINKING in out_a:
        return False
    return bool(_CLOSED_REASONING.search(out_b))


def _thinking_toggles(tmpl: ChatTemplate, caps: TemplateCaps) -> bool:
    """compare_thinking_enabled: `enable_thinking` changes the generation prompt by tags."""
    user = [{"role": "user", "content": _USER}]
    off = _probe(tmpl, caps, user, add_generation_prompt=True, enable_thinking=False)
    on = _probe(tmpl, caps, user, add_generation_prompt=True, enable_thinking=True)
    if off is None or on is None or off == on:
        return False
    left, right = _middle(off, on)
    if not left.strip() and right.strip():
        return on.endswith(right.strip()) and bool(re.search(_MARKER, right))
    if not right.strip() and left.strip():
        return off.endswith(left.strip()) and bool(re.search(_MARKER, left))
    return _two_tags_appended(off, on) or _two_tags_appended(on, off)


def _middle(a: str, b: str) -> tuple[str, str]:
    """What differs between a and b once their common head and tail are removed."""
    head = 0
    while head < min(len(a), len(b)) and a[head] == b[head]:
        head += 1
    tail = 0
    while tail < min(len(a), len(b)) - head and a[-1 - tail] == b[-1 - tail]:
        tail += 1
    return a[head:len(a) - tail], b[head:len(b) - tail]


def _two_tags_appended(base: str, extended: str) -> bool:
    # one output's tail followed, in the other, by exactly two tags (`<think></think>`)
    anchor = base[-64:]
    pos = extended.rfind(anchor)
    if pos < 0 or pos + len(anchor) >= len(extended):
        return False
    extra = extended[pos + len(anchor):].strip()
    return bool(extra) and re.fullmatch(rf"\s*{_MARKER}\s*{_MARKER}\s*", extra) is not None


def _tools_only_reasoning(tmpl: ChatTemplate, caps: TemplateCaps) -> bool | None:
    """compare_reasoning_scope: reasoning rendered only beside tool calls decides alone
    (tagged: thinking; untagged: none); None when it shows either way or neither."""
    user = {"role": "user", "content": _USER}
    with_content = {"role": "assistant", "content": _ASSISTANT, "reasoning_content": _THINKING}
    call = {"id": "call00001", "type": "function", "function": {
        "name": "FFF_FIRST_FUN_F", "arguments": {"AA_ARG_FST_AA": "VVVV",
                                                 "BB_ARG_SND_BB": "XXXX"}}}
    with_tools = {"role": "assistant", "content": None, "reasoning_content": _THINKING,
                  "tool_calls": [call]}
    out_a = _probe(tmpl, caps, [user, with_content], add_generation_prompt=False,
                   enable_thinking=True, tools=_PROBE_TOOLS)
    out_b = _probe(tmpl, caps, [user, with_tools], add_generation_prompt=False,
                   enable_thinking=True, tools=_PROBE_TOOLS)
    if out_a is None or out_b is None or _THINKING in out_a or _THINKING not in out_b:
        return None
    return bool(re.search(_MARKER + r"\s*" + re.escape(_THINKING), out_b)
                or _CLOSED_REASONING.search(out_b))

