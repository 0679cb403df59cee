"""Render a GGUF chat template in Python the way llama-server's own Jinja engine does.

llama-server (`common/jinja/`) is not Python Jinja: it always runs with `trim_blocks` and
`lstrip_blocks`, keeps a trailing newline, treats attribute access on undefined values as
undefined, and its `tojson` writes `", "` / `": "` separators, raw UTF-8 and floats the
way C++ `ostream << double` does (`%g`: `1.0` -> `1`). jinja2's builtin `tojson`
HTML-escapes `<`, `>`, `&`, `'` and would change the prompt, so it is replaced.

What the template supports (proxy/prompt/caps.py) decides how llama-server normalises
messages before rendering.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import jinja2
import orjson
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.parser import Parser
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment

# llama.cpp's fallback when a model has no template (common/chat.cpp CHATML_TEMPLATE_SRC).
CHATML_TEMPLATE_SRC = (
    "{%- for message in messages -%}\n"
    "  {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "  {{- '<|im_start|>assistant\\n' -}}\n"
    "{%- endif -%}"
)


class TemplateError(ValueError):
    """The template failed to render these inputs (`raise_exception` or a runtime error)."""


def _g(value: float) -> str:
    # C++ `ostream << double` with default precision is printf("%g"); Python's %g agrees,
    # including "inf"/"nan" spelling.
    return f"{value:g}"


def _needs_slow_json(value: Any) -> bool:
    """True if `value` holds a float or an int json.dumps would print differently."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, bool) or v is None or isinstance(v, str):
            continue
        if isinstance(v, float):
            return True
        if isinstance(v, int):
            if not -(2**63) <= v < 2**63:
                return True
        elif isinstance(v, Mapping):
            stack.extend(v.values())
        elif isinstance(v, list | tuple):
            stack.extend(v)
    return False


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r",
            "\t": "\\t"}
_ESCAPE_RE = re.compile(r'["\\\x00-\x1f]')


def _json_str(s: str) -> str:
    return '"' + _ESCAPE_RE.sub(lambda m: _ESCAPES.get(m.group(), f"\\u{ord(m.group()):04x}"),
                                s) + '"'


def _slow_json(v: Any, item_sep: str, key_sep: str, indent: int, lvl: int) -> str:
    # Mirrors value_to_json_internal (common/jinja/value.cpp) line by line.
    nl = "\n" if indent >= 0 else ""
    pad = " " * (lvl * indent) if indent > 0 else ""
    step = " " * indent if indent > 0 else ""
    if v is None or isinstance(v, jinja2.Undefined):
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        if -(2**63) <= v < 2**63:
            return str(v)
        # from_json reads JSON integers as int64_t: an unsigned one in [2^63, 2^64) wraps
        return str(v - 2**64) if v < 2**64 else _g(float(v))
    if isinstance(v, float):
        return _g(v)
    if isinstance(v, str):
        return _json_str(v)
    if isinstance(v, list | tuple):
        if not v:
            return "[]"
        items = [pad + step + _slow_json(x, item_sep, key_sep, indent, lvl + 1) for x in v]
        return "[" + nl + (item_sep + nl).join(items) + nl + pad + "]"
    if isinstance(v, Mapping):
        if not v:
            return "{}"
        items = [pad + step + _json_str(str(k)) + key_sep
                 + _slow_json(x, item_sep, key_sep, indent, lvl + 1) for k, x in v.items()]
        return "{" + nl + (item_sep + nl).join(items) + nl + pad + "}"
    return "null"


class _JsonMemo:
    """`tojson` outputs of recent containers, keyed by their content.

    Templates write every tool schema (Claude Code's: ~50k characters) and every tool
    call's arguments with `tojson`, on every turn: exact but slow (the float check walks
    the value, then the encoder runs), ~40% of rendering an agent turn. The key is the
    value's orjson text, which tells apart every value that prints differently except a
    non-finite float (orjson writes NaN/Infinity as `null`): a key holding a bare `null`
    is never memoised. Values orjson cannot write (Undefined, huge ints, non-string
    keys) are not either. Renders may run on the loop and the tokenizing thread at once:
    locked.
    """

    def __init__(self, max_chars: int = 8 << 20) -> None:
        self._memo: dict[tuple[bytes, str, str, int, bool], str] = {}
        self._chars = 0
        self._max_chars = max_chars
        self._lock = threading.Lock()

    @staticmethod
    def key_of(value: Any) -> bytes | None:
        if not isinstance(value, dict | list) or not value:
            return None  # scalars and empty containers are cheap to write
        try:
            key = orjson.dumps(value)
        except TypeError:
            return None
        if b":null" in key or b",null" in key or b"[null" in key:
            return None  # might be a NaN or an infinity (see the class doc)
        return key

    def get(self, key: tuple[bytes, str, str, int, bool]) -> str | None:
        return self._memo.get(key)

    def put(self, key: tuple[bytes, str, str, int, bool], out: str) -> None:
        with self._lock:
            if key in self._memo or len(out) > self._max_chars // 8:
                return
            self._memo[key] = out
            self._chars += len(out) + len(key[0])
            while self._chars > self._max_chars:  # oldest first (dict order)
                k = next(iter(self._memo))
                self._chars -= len(self._memo.pop(k)) + len(k[0])


_TOJSON_MEMO = _JsonMemo()


def llama_tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
                 separators: Any = None, sort_keys: bool = False) -> str:
    """`tojson` byte for byte as llama.cpp's Jinja engine writes it."""
    if isinstance(value, Iterator):
        value = list(value)  # `map` and `select` give arrays in llama.cpp, not generators
    if sort_keys:
        raise TemplateError("tojson sort_keys=true not implemented")  # as llama.cpp
    ind = indent if isinstance(indent, int) and not isinstance(indent, bool) else -1
    seps = list(separators) if isinstance(separators, list | tuple) else []
    item_sep = str(seps[0]) if seps else (", " if ind < 0 else ",")
    key_sep = str(seps[1]) if len(seps) > 1 else ": "
    content = _TOJSON_MEMO.key_of(value)
    if content is None:
        return _tojson(value, ensure_ascii, ind, item_sep, key_sep)
    key = (content, item_sep, key_sep, ind, bool(ensure_ascii))
    out = _TOJSON_MEMO.get(key)
    if out is None:
        out = _tojson(value, ensure_ascii, ind, item_sep, key_sep)
        _TOJSON_MEMO.put(key, out)
    return out


def _tojson(value: Any, ensure_ascii: bool, ind: int, item_sep: str, key_sep: str) -> str:
    if ind < 0 and not _needs_slow_json(value):
        # Fast path (C encoder): identical output when there are no floats/huge ints.
        try:
            out = json.dumps(value, ensure_ascii=False, separators=(item_sep, key_sep),
                             default=_undefined_to_none)
        except (TypeError, ValueError):
            out = _slow_json(value, item_sep, key_sep, ind, 0)
    else:
        out = _slow_json(value, item_sep, key_sep, ind, 0)
    if ensure_ascii:
        out = _ascii_preserving(out)
    return out


def _ascii_preserving(s: str) -> str:
    # json_ensure_ascii_preserving_format: only non-ASCII inside strings is escaped, and the
    # text is already valid JSON, so escaping every non-ASCII char is equivalent.
    return "".join(c if ord(c) < 0x80 else _u_escape(c) for c in s)


def _u_escape(c: str) -> str:
    cp = ord(c)
    if cp < 0x10000:
        return f"\\u{cp:04x}"
    cp -= 0x10000
    return f"\\u{0xD800 + (cp >> 10):04x}\\u{0xDC00 + (cp & 0x3FF):04x}"


def _undefined_to_none(o: Any) -> Any:
    if isinstance(o, jinja2.Undefined):
        return None
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def _as_is(value: Any) -> Any:
    return value


def _raise_exception(message: str) -> None:
    raise TemplateError(f"Jinja Exception: {message}")


def _strftime_now(fmt: str) -> str:
    return time.strftime(fmt, time.localtime())


class _GenerationTags(Extension):
    """`{% generation %}` / `{% endgeneration %}` (transformers' marks of what the assistant
    wrote): llama.cpp parses both as no-ops and renders what lies between them."""

    tags: ClassVar[set[str]] = {"generation", "endgeneration"}

    def parse(self, parser: Parser) -> list[nodes.Node]:
        next(parser.stream)
        return []


class JinjaEnv(ImmutableSandboxedEnvironment):
    """jinja2 configured like llama.cpp's lexer/runtime (see module docstring)."""

    def __init__(self) -> None:
        # keep_trailing_newline: ChatTemplate already dropped the one llama.cpp drops.
        super().__init__(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
                         undefined=jinja2.ChainableUndefined,
                         extensions=["jinja2.ext.loopcontrols", _GenerationTags])
        self.filters["tojson"] = llama_tojson
        # llama.cpp has no markup strings: `safe` is a no-op (jinja2's Markup would
        # HTML-escape every string added to it)
        self.filters["safe"] = _as_is
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = _strftime_now

    def getattr(self, obj: Any, attribute: str) -> Any:
        # `message.content` on a plain JSON dict: the sandbox's generic attribute checks
        # dominate render time for long conversations. A key that is not a dict method
        # name resolves to the item in both engines, so answer it directly.
        if type(obj) is dict and attribute not in _DICT_ATTRS:
            try:
                return obj[attribute]
            except KeyError:
                # what the sandbox ends with for a missing key (`message.tool_calls` on
                # every plain message), without its getattr + item lookups first
                return self.undefined(obj=obj, name=attribute)
        # `loop.index0`, `loop.last`, `content.rstrip`: what the sandbox allows anyway
        # (public, read-only), without its checks. str.format is wrapped by the sandbox.
        if (type(obj) is LoopContext and attribute in _LOOP_ATTRS) or (
                type(obj) is str and attribute in _STR_ATTRS):
            return getattr(obj, attribute)
        return super().getattr(obj, attribute)

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        # llama.cpp's arrays have `append` and `pop` (Kimi K2 queues tool-call ids)
        if type(obj) is list and attr in ("append", "pop"):
            return True
        return super().is_safe_attribute(obj, attr, value)


class LenientEnv(JinjaEnv):
    """`JinjaEnv` whose `+` joins a string with none or undefined as if it were "" (llama.cpp's
    binary_expression does; Python raises). Slower: used only for a render the plain
    environment refused."""

    intercepted_binops = frozenset(("+",))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "+":
            left_null = left is None or isinstance(left, jinja2.Undefined)
            right_null = right is None or isinstance(right, jinja2.Undefined)
            if left_null and isinstance(right, str):
                return right
            if right_null and isinstance(left, str):
                return left
        return super().call_binop(context, operator, left, right)


_DICT_ATTRS = frozenset(dir(dict))
_LOOP_ATTRS = frozenset(("index", "index0", "revindex", "revindex0", "first", "last",
                         "length", "depth", "depth0", "previtem", "nextitem"))
_STR_ATTRS = frozenset(a for a in dir(str) if not a.startswith("_")) - {"format",
                                                                          "format_map"}


_ENV = JinjaEnv()
_LENIENT_ENV = LenientEnv()


class ChatTemplate:
    """One compiled chat template plus the tokens llama-server binds into it."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        # jinja::lexer::tokenize: CRLF/CR -> LF, one trailing newline dropped. This is also
        # the source /props reports and the text llama.cpp inspects to pick a handler.
        source = source.replace("\r\n", "\n").replace("\r", "\n")
        self.source = source[:-1] if source.endswith("\n") else source
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._tmpl = _ENV.from_string(self.source)
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template does not compile: {e}") from e
        # jinja2 keeps a template's globals as a ChainMap over the environment's and copies
        # it into every render's context; iterating a ChainMap is a third of a small
        # render's time. Ours are fixed at creation (JinjaEnv), so one plain dict serves.
        self._tmpl.globals = dict(self._tmpl.globals)
        self._lenient: jinja2.Template | None = None

    def render(self, context: Mapping[str, Any]) -> str:
        try:
            return self._tmpl.render(**context)
        except TemplateError:
            raise
        except (TypeError, jinja2.UndefinedError):
            return self._render_lenient(context)
        except (jinja2.TemplateError, ValueError, KeyError, IndexError,
                AttributeError, ZeroDivisionError) as e:
            raise TemplateError(f"chat template failed to render: {e}") from e

    def _render_lenient(self, context: Mapping[str, Any]) -> str:
        if self._lenient is None:
            self._lenient = _LENIENT_ENV.from_string(self.source)
            self._lenient.globals = dict(self._lenient.globals)
        try:
            return self._lenient.render(**context)
        except TemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError,
                AttributeError, ZeroDivisionError) as e:
            raise TemplateError(f"chat template failed to render: {e}") from e
