"""The message starts llama-server's differential "autoparser" finds in a chat template.

A template no specialized handler claims (proxy/prompt/handlers.py) is analysed by
rendering probe conversations and diffing the outputs (common/chat-diff-analyzer.cpp).
Two of its answers mark messages in the prompt's token ids: `assistant_start` and
`user_start`, which the server turns into the message delimiters it places context
checkpoints with (proxy/prompt/delimiters.py). This module ports the parts of the
analysis those two depend on: the reasoning tags (the assistant start is cut before
them), the content start (one per-template workaround reads it), the two detections and
the workarounds that overwrite them. It is a port because nothing else implements this
analysis: it lives in llama.cpp's common/, which llama-cpp-python does not bind, and no
package on PyPI reproduces it. The answer is whatever that C++ code computes, so the
port follows it step by step, on UTF-8 bytes as std::string does (a diff may split a
character).

Helpers keep the C++ names: `diff_split` is calculate_diff_split, `segmentize` is
segmentize_markers (common/chat-auto-parser-helpers.cpp). The PEG parsers the analysis
builds from `marker()` and `space()` are regular expressions here: every one is a
sequence of deterministic parts (a marker never starts with whitespace, the probe texts
start with letters), so a leftmost regex match is the PEG parse-anywhere result.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from proxy.prompt.caps import TemplateCaps
from proxy.prompt.template import ChatTemplate, TemplateError

USER_MSG = b"U_USER_MSG Hello END_U"
USER_MSG_TWO = b"V_USER_MSG Hello END_V"
ASSISTANT_MSG = b"A_ASST_MSG I can help END_A"
THINKING = b"REASON_PART I am thinking END_R"
_FUN_FIRST, _FUN_SECOND = "FFF_FIRST_FUN_F", "SSS_SECOND_FUN_S"
_ARG_FIRST, _ARG_SECOND = "AA_ARG_FST_AA", "BB_ARG_SND_BB"
_PARAMS = {"type": "object", "properties": {
    _ARG_FIRST: {"type": "string", "description": "First argument"},
    _ARG_SECOND: {"type": "string", "description": "Second argument"}}, "required": []}
_TOOLS = [{"type": "function", "function": {"name": name, "description": desc,
                                            "parameters": _PARAMS}}
          for name, desc in ((_FUN_FIRST, "Test function foo"),
                             (_FUN_SECOND, "Test function bar"))]

# p.marker(): `<` to the first `>`, or `[` to the first `]`; p.space(): C isspace
_MARKER = rb"(?:<[^>]*>|\[[^\]]*\])"
_WS = rb"[ \t\n\v\f\r]*"
_SPACES = b" \t\n\v\f\r"
_PRE = rb"(?P<pre>" + _MARKER + _WS + rb")"
# compare_reasoning_presence's post tag takes the blanks before its marker too
_REASONING_WRAPPED = re.compile(_PRE + re.escape(THINKING)
                                + rb"(?P<post>" + _WS + _MARKER + _WS + rb")")
_REASONING_SCOPED = re.compile(_PRE + re.escape(THINKING) + _WS
                               + rb"(?P<post>" + _MARKER + _WS + rb")")
_REASONING_CLOSED = re.compile(re.escape(THINKING) + _WS
                               + rb"(?P<post>" + _MARKER + _WS + rb")?")
_CONTENT_WRAPPED = re.compile(_PRE + re.escape(ASSISTANT_MSG) + _WS
                              + rb"(?P<post>" + _MARKER + _WS + rb")")


@dataclass(frozen=True)
class Segment:
    marker: bool
    value: bytes


def segmentize(text: bytes) -> list[Segment]:
    """segmentize_markers: text and `<...>` / `[...]` markers; an unclosed opener makes
    the rest one more text segment."""
    out: list[Segment] = []
    border = 0
    while True:
        lt, sq = text.find(b"<", border), text.find(b"[", border)
        i = lt if sq < 0 or 0 <= lt < sq else sq
        if i < 0:
            break
        j = text.find(b">" if text[i] == 0x3C else b"]", i + 1)
        if border < i:
            out.append(Segment(False, text[border:i]))
        if j < 0:
            out.append(Segment(False, text[i:]))
            return out
        out.append(Segment(True, text[i:j + 1]))
        border = j + 1
    if border < len(text):
        out.append(Segment(False, text[border:]))
    return out


def _pruned(segments: list[Segment]) -> list[Segment]:  # prune_whitespace_segments
    return [s for s in segments if s.value.strip(_SPACES)]


@dataclass(frozen=True)
class Diff:
    prefix: bytes
    suffix: bytes
    left: bytes
    right: bytes


def _common_prefix(a: bytes, b: bytes) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def diff_split(left: bytes, right: bytes) -> Diff:
    """calculate_diff_split: whole segments off both ends first, then bytes of the text
    segments where both remainders start or end with text."""
    ls, rs = segmentize(left), segmentize(right)
    if not ls:
        return Diff(b"", b"", b"", right)
    if not rs:
        return Diff(b"", b"", left, b"")
    l0, l1, r0, r1 = 0, len(ls) - 1, 0, len(rs) - 1
    prefix, suffix = b"", b""
    l_done = r_done = False
    while l0 != l1 and r0 != r1:
        advanced = False
        if ls[l0] == rs[r0]:
            prefix += ls[l0].value
            l0, r0, advanced = l0 + 1, r0 + 1, True
        if ls[l1] == rs[r1]:
            suffix = ls[l1].value + suffix
            if l0 != l1:
                l1 -= 1
            else:
                l_done = True
            if r0 != r1:
                r1 -= 1
            else:
                r_done = True
            advanced = True
        if not advanced:
            break
    if l0 == l1 and r0 != r1:
        if ls[l0] == rs[r1]:
            suffix, r1, l_done = rs[r1].value + suffix, r1 - 1, True
        elif ls[l0] == rs[r0]:
            prefix, r0, l_done = prefix + rs[r0].value, r0 + 1, True
    elif r0 == r1 and l0 != l1:
        if ls[l1] == rs[r0]:
            suffix, l1, r_done = ls[l1].value + suffix, l1 - 1, True
        elif ls[l0] == rs[r0]:
            prefix, l0, r_done = prefix + ls[l0].value, l0 + 1, True
    elif l0 == l1 and r0 == r1 and ls[l0] == rs[r0] and ls[l0].marker:
        prefix, l_done, r_done = prefix + rs[r0].value, True, True
    text_suffix = not ls[l1].marker and not rs[r1].marker
    text_prefix = not rs[r0].marker and not ls[l0].marker
    rem_l = b"".join(s.value for s in ls[l0:l1 if l_done else l1 + 1])
    rem_r = b"".join(s.value for s in rs[r0:r1 if r_done else r1 + 1])
    n_suf = _common_prefix(rem_l[::-1], rem_r[::-1]) if text_suffix else 0
    n_pre = _common_prefix(rem_l[:len(rem_l) - n_suf],
                           rem_r[:len(rem_r) - n_suf]) if text_prefix else 0
    d_left = rem_l[n_pre:len(rem_l) - n_suf]
    d_right = rem_r[n_pre:len(rem_r) - n_suf]
    prefix += rem_l[:n_pre]
    suffix = rem_l[len(rem_l) - n_suf:] + suffix
    if not d_left and not d_right:
        prefix, suffix = left, b""
    if not d_left and d_right and right.startswith(left):
        prefix, suffix, d_right = left, b"", right[len(left):]
    return Diff(prefix, suffix, d_left, d_right)


class _Probe:
    """apply_template of the analysis: the template with the probe inputs, contents
    shaped as the template takes them, no BOS/EOS stripped; None if rendering fails."""

    def __init__(self, tmpl: ChatTemplate, caps: TemplateCaps) -> None:
        self.tmpl = tmpl
        self.typed = not caps.supports_string_content and caps.supports_typed_content

    def render(self, messages: list[dict[str, Any]], *, tools: bool = False,
               add_generation_prompt: bool = False, thinking: bool = True) -> bytes | None:
        if self.typed:
            messages = [{**m, "content": [{"type": "text", "text": m["content"]}]}
                        if isinstance(m.get("content"), str) else m for m in messages]
        ctx: dict[str, Any] = {"messages": messages, "bos_token": self.tmpl.bos_token,
                               "eos_token": self.tmpl.eos_token, "enable_thinking": thinking}
        if tools:
            ctx["tools"] = _TOOLS
        if add_generation_prompt:
            ctx["add_generation_prompt"] = True
        try:
            return self.tmpl.render(ctx).encode("utf-8", "surrogateescape")
        except TemplateError:
            return None


def _msg(role: str, content: bytes | None, **extra: Any) -> dict[str, Any]:
    text = None if content is None else content.decode()
    return {"role": role, "content": text, **extra}


def _call(name: str, args: dict[str, str]) -> dict[str, Any]:
    return {"id": "call00001", "type": "function",
            "function": {"name": name, "arguments": args}}


_USER = _msg("user", USER_MSG)
_ASSISTANT = _msg("assistant", ASSISTANT_MSG)


@dataclass
class Reasoning:
    """analyze_reasoning's tags (`mode`: none, tag_based, tools_only)."""

    mode: str = "none"
    start: bytes = b""
    end: bytes = b""


def analyze_reasoning(probe: _Probe, caps: TemplateCaps) -> Reasoning:
    r = Reasoning()
    _reasoning_presence(probe, r)
    _thinking_enabled(probe, r)
    if caps.supports_tool_calls:
        _reasoning_scope(probe, r)
    return r


def _reasoning_presence(probe: _Probe, r: Reasoning) -> None:
    a = probe.render([_USER, _ASSISTANT])
    b = probe.render([_USER, _msg("assistant", ASSISTANT_MSG,
                                  reasoning_content=THINKING.decode())])
    if a is None or b is None:
        return
    right = diff_split(a, b).right
    if not right or THINKING not in right:
        return
    m = _REASONING_WRAPPED.search(b) or _REASONING_CLOSED.search(b)
    pre = (m.groupdict().get("pre") or b"") if m else b""
    post = (m.group("post") or b"") if m else b""
    if pre and post:
        r.mode, r.start, r.end = "tag_based", pre, post
    elif post:
        r.mode, r.end = "tag_based", post


def _thinking_enabled(probe: _Probe, r: Reasoning) -> None:
    a = probe.render([_USER], add_generation_prompt=True, thinking=False)
    b = probe.render([_USER], add_generation_prompt=True, thinking=True)
    if a is None or b is None:
        return
    d = diff_split(a, b)
    left, right = d.left.strip(_SPACES), d.right.strip(_SPACES)
    if not left and d.right:
        if right and b.endswith(right) and not r.start:
            r.start, r.mode = d.right, "tag_based"
    elif not right and d.left:
        if left and a.endswith(left) and not r.end:
            seg = _pruned(segmentize(a))
            if len(seg) >= 2 and seg[-1].value == left and seg[-2].marker:
                r.start = seg[-2].value
            r.end, r.mode = d.left, "tag_based"
    elif left and right:
        # one output's tail followed, in the other, by exactly two tags
        for base, extended in ((b, a), (a, b)):
            anchor = base[len(base) - min(len(base), 64):]
            pos = extended.rfind(anchor)
            if pos < 0 or pos + len(anchor) >= len(extended):
                continue
            extra = extended[pos + len(anchor):].strip(_SPACES)
            seg = _pruned(segmentize(extra)) if extra else []
            if len(seg) == 2 and seg[0].marker and seg[1].marker:
                r.start = r.start or seg[0].value
                r.end = r.end or seg[1].value
                r.mode = "tag_based"
                break
    if r.mode == "none" and not r.start and r.end:
        r.mode = "tag_based"


def _reasoning_scope(probe: _Probe, r: Reasoning) -> None:
    with_content = _msg("assistant", ASSISTANT_MSG, reasoning_content=THINKING.decode())
    with_call = _msg("assistant", None, reasoning_content=THINKING.decode(), tool_calls=[
        _call(_FUN_FIRST, {_ARG_FIRST: "VVVV", _ARG_SECOND: "XXXX"})])
    a = probe.render([_USER, with_content], tools=True)
    b = probe.render([_USER, with_call], tools=True)
    if a is None or b is None or THINKING in a or THINKING not in b:
        return
    r.mode = "tools_only"
    m = _REASONING_SCOPED.search(b)
    if m:
        r.start, r.end = m.group("pre"), m.group("post")
        return
    m = _REASONING_CLOSED.search(b)  # always matches: the reasoning is in b
    r.end = (m.group("post") or b"") if m else b""


def content_start(probe: _Probe, r: Reasoning) -> bytes:
    """analyze_content's `start`: the tag before plain assistant content, if any."""
    with_call = _msg("assistant", b"", tool_calls=[_call("test_func", {"arg1": "value1"})])
    with_reasoning = _msg("assistant", b"", reasoning_content=THINKING.decode())
    plain = probe.render([_USER, _ASSISTANT], tools=True)
    b_call = probe.render([_USER, with_call], tools=True)
    b_reasoning = probe.render([_USER, with_reasoning], tools=True)
    if plain is None or b_call is None or b_reasoning is None:
        return b""
    d_call, d_reasoning = diff_split(plain, b_call), diff_split(plain, b_reasoning)
    if d_call.left.strip(_SPACES) == ASSISTANT_MSG:
        # p.space() + literal(left) + ... + p.end() over `left` itself: it parses unless
        # the space eats the head the literal needs
        rleft = d_reasoning.left
        if not rleft or rleft[0] not in _SPACES:
            return b""
        if r.mode != "none" and r.end and re.search(
                re.escape(r.end) + _WS + re.escape(ASSISTANT_MSG), rleft):
            return b""
    rdiff = d_reasoning.left
    if r.end and r.end in rdiff:
        rdiff = rdiff[rdiff.find(r.end) + len(r.end):]
    pure = rdiff if len(rdiff) > len(d_call.left) else d_call.left
    m = _CONTENT_WRAPPED.search(pure)
    return m.group("pre") if m else b""


def assistant_start(probe: _Probe, r: Reasoning) -> bytes:
    """detect_assistant_start_marker: what an assistant turn adds before its text, cut
    before the reasoning tags."""
    a = probe.render([_USER])
    b = probe.render([_USER, _ASSISTANT])
    if a is None or b is None:
        return b""
    block = diff_split(a, b).right
    cut = block.find(ASSISTANT_MSG)
    head = block if cut < 0 else block[:cut]
    for tag in (r.start, r.end):
        # a blank tag is trimmed to "", found at 0: it cuts everything
        if tag and tag.strip(_SPACES) in head:
            head = head[:head.find(tag.strip(_SPACES))]
    return head.strip(_SPACES)


def user_start(probe: _Probe) -> bytes:
    """detect_user_start_marker: the markers before a user message's text, leading end
    markers and blank text skipped."""
    a, b = probe.render([]), probe.render([_USER])
    if a is None or b is None:
        first = [_msg("user", USER_MSG_TWO), _ASSISTANT]
        a, b = probe.render(first), probe.render([*first, _USER])
        if a is None or b is None:
            return b""
    block = diff_split(a, b).right
    if ASSISTANT_MSG in block:
        block = block[block.find(ASSISTANT_MSG) + len(ASSISTANT_MSG):]
    cut = block.find(USER_MSG)
    out, seen_marker = b"", False
    for seg in segmentize(block if cut < 0 else block[:cut]):
        lower = seg.value.lower()
        if seg.marker and not seen_marker and (b"end" in lower or b"close" in lower):
            continue
        if not seg.marker and not seen_marker and not seg.value.strip(_SPACES):
            continue
        seen_marker |= seg.marker
        out += seg.value
    return out.strip(_SPACES)


# The analyzer's per-template workarounds that set the two starts, in its order:
# (markers that must all be in the source, assistant start, user start); None: kept.
_WORKAROUNDS: tuple[tuple[tuple[str, ...], bytes | None, bytes | None], ...] = (
    (("<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>", "<TOOL_RESPONSE>"),
     b"<SPECIAL_11>Assistant", b"<SPECIAL_11>User"),  # Nemotron Nano v2
    (("{%- set system_prompt = '<|start_header_id|>' + 'system' + '<|end_header_id|>\\n\\n'"
      " + message['content'] | trim + '\\n' + system_prompt_suffix + '<|eot_id|>' -%}",),
     b"<|start_header_id|>assistant<|end_header_id|>",
     b"<|start_header_id|>user<|end_header_id|>"),  # Fireworks
    (("<|begin|>assistant<|think|><|end|>",), b"<|begin|>assistant", None),  # Solar Open
    (("if not loop.last and '[BEGIN FINAL RESPONSE]' in asst_text",),
     b"<|begin_assistant|>", b"<|begin_user|>"),  # Apriel 1.6
)
_COHERE = ("<|CHATBOT_TOKEN|>", "<|END_OF_TURN_TOKEN|>")
# the Granite 3.3 workaround, which runs before Cohere's, gives content a start tag
_GRANITE = ("Write your thoughts between <think></think> and write your response between "
            "<response></response>")


def message_starts(tmpl: ChatTemplate, caps: TemplateCaps) -> tuple[bytes, bytes]:
    """(assistant_start, user_start) as autoparser::analyze_template leaves them."""
    probe = _Probe(tmpl, caps)
    reasoning = analyze_reasoning(probe, caps)
    assistant, user = assistant_start(probe, reasoning), user_start(probe)
    src = tmpl.source
    # Cohere Command R+: only when the content analysis found no start tag
    if all(m in src for m in _COHERE) and _GRANITE not in src \
            and not content_start(probe, reasoning):
        user = b"<|START_OF_TURN_TOKEN|><|USER_TOKEN|>"
    for markers, new_assistant, new_user in _WORKAROUNDS:
        if all(m in src for m in markers):
            assistant = assistant if new_assistant is None else new_assistant
            user = user if new_user is None else new_user
    return assistant, user
