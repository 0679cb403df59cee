"""The message delimiters llama-server finds user messages by, and where they start.

On SWA and hybrid models the server creates context checkpoints at user-message starts
(docs/checkpoints.md). For a chat request the template's handler gives a list of (role,
delimiter text); the server tokenizes each text with special tokens parsed
(common_chat_msg_delimiters::tokenize) and gives each prompt position the role of the
first delimiter, in list order, whose tokens start there (::split). A position whose
role is "user" starts a user message.

Where the list comes from (common_chat_templates_apply_jinja): a specialized handler
sets its own (common/parsers/*.cpp; those that set none leave the request without
user starts), and the autoparser gives its assistant start, then its user start, each
only if found (proxy/prompt/autoparser.py). Both live in llama.cpp's common/, which
llama-cpp-python does not bind and no PyPI package reimplements, so this is a port of
that code, checked against the real server on every template of the vendored corpus
(tests/prompt/test_delimiters.py).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from proxy.prompt.autoparser import message_starts
from proxy.prompt.caps import TemplateCaps
from proxy.prompt.handlers import detect_handler
from proxy.prompt.template import ChatTemplate
from proxy.prompt.tokenizer import FragmentTokenizer

Delimiters = tuple[tuple[str, str], ...]
TokenizedDelimiters = tuple[tuple[str, bytes], ...]

_COHERE_TURN = "<|START_OF_TURN_TOKEN|>"
# the lists the specialized handlers set, by handler (proxy/prompt/handlers.py names);
# a handler missing here sets none
_SPECIALIZED: dict[str, Delimiters] = {
    "ling3": (("assistant", "<role>ASSISTANT</role>"), ("user", "<role>HUMAN</role>"),
              ("tool", "<role>OBSERVATION</role>"), ("system", "<role>SYSTEM</role>")),
    "muse_glimmer": (("assistant", "<|start|>assistant"), ("user", "<|start|>user"),
                     ("system", "<|start|>system"), ("tool", "<|start|>tool")),
    # tool results open with the system token: the longer delimiter comes first
    "cohere2moe": (("assistant", _COHERE_TURN + "<|CHATBOT_TOKEN|>"),
                   ("user", _COHERE_TURN + "<|USER_TOKEN|>"),
                   ("tool", _COHERE_TURN + "<|SYSTEM_TOKEN|><|START_TOOL_RESULT|>"),
                   ("system", _COHERE_TURN + "<|SYSTEM_TOKEN|>")),
    "deepseek_v3_2": (("assistant", "<｜Assistant｜>"), ("user", "<｜User｜>")),
    "gpt_oss": (("assistant", "<|start|>assistant"), ("user", "<|start|>user"),
                ("system", "<|start|>developer"), ("system", "<|start|>system"),
                ("tool", "<|start|>functions")),
    "kimi_k3": (("assistant", '<|open|>message role="assistant"<|sep|>'),
                ("user", '<|open|>message role="user"<|sep|>'),
                ("tool", '<|open|>message role="tool"'),
                ("system", '<|open|>message role="system"')),
    # a tool result is a user turn that opens with <tool_response>: listed before user
    "minicpm5": (("assistant", "<|im_start|>assistant"),
                 ("tool", "<|im_start|>user\n<tool_response>"),
                 ("user", "<|im_start|>user"), ("system", "<|im_start|>system")),
    "qwen3_coder": (("assistant", "<|im_start|>assistant"),
                    ("tool", "<|im_start|>user\n<tool_response>"),
                    ("tool", "<|im_start|>tool_response"),
                    ("user", "<|im_start|>user"), ("system", "<|im_start|>system")),
    "minimax_m3": (("assistant", "]~b]ai"), ("user", "]~b]user"), ("tool", "]~b]tool"),
                   ("system", "]~b]developer"), ("system", "]~b]system")),
    "gemma4": (("user", "<|turn>user"), ("assistant", "<|turn>model")),
}


def server_delimiters(tmpl: ChatTemplate, caps: TemplateCaps) -> Delimiters:
    """The (role, delimiter text) list llama-server sends with a chat request rendered
    by `tmpl` (the template as the server compiled it; `caps` its chat_template_caps),
    in the server's order. A text the autoparser cut inside a UTF-8 character keeps the
    stray bytes as surrogate escapes (encode with "surrogateescape" to get them back)."""
    handler = detect_handler(tmpl.source)
    if handler is not None:
        return _SPECIALIZED.get(handler, ())
    assistant, user = message_starts(tmpl, caps)
    return tuple((role, text.decode("utf-8", "surrogateescape"))
                 for role, text in (("assistant", assistant), ("user", user)) if text)


def tokenize_delimiters(delimiters: Delimiters, tokenizer: FragmentTokenizer
                        ) -> TokenizedDelimiters:
    """Each delimiter's ids as native int32 bytes: common_tokenize(vocab, text,
    add_special=false, parse_special=true), as the server tokenizes them."""
    out = []
    for role, text in delimiters:
        ids = tokenizer.llama.tokenize(text.encode("utf-8", "surrogateescape"),
                                       add_bos=False, special=True)
        out.append((role, array("i", ids).tobytes()))
    return tuple(out)


def user_starts(ids: bytes, delimiters: Sequence[tuple[str, bytes]]) -> tuple[int, ...]:
    """The positions of `ids` (native int32 bytes, `array('i').tobytes()`) that start a
    user message: the first delimiter, in list order, whose ids start at a position gives
    its role (common_chat_msg_delimiters::split). Runs per request, so each delimiter is
    searched with bytes.find over the whole prompt, not token by token."""
    last_user = max((k for k, (role, _) in enumerate(delimiters) if role == "user"),
                    default=-1)
    n = len(ids) // 4
    claimed: set[int] = set()
    users: set[int] = set()
    for role, needle in delimiters[:last_user + 1]:
        found = _occurrences(ids, needle, n)
        if role == "user":
            users.update(p for p in found if p not in claimed)
        claimed.update(found)
    return tuple(sorted(users))


def _occurrences(ids: bytes, needle: bytes, n: int) -> Sequence[int]:
    """Token positions where `needle` (whole int32s) starts in `ids`, overlaps included."""
    if not needle:
        return range(n)  # no tokens to compare: std::equal matches everywhere
    out = []
    find = ids.find
    i = find(needle)
    while i >= 0:
        if i & 3:
            i = find(needle, (i | 3) + 1)  # straddles two ids: go on from the next one
        else:
            out.append(i >> 2)
            i = find(needle, i + 4)
    return out
