"""PromptBuilder against a real llama-server on the demo model: same text, same token ids.

Every corpus request is rendered by the backend (`/apply-template`) and tokenized by it
(`/tokenize`, add_special + parse_special, as the chat endpoint does); ours must equal
both. For a few, the chat endpoint's own `prompt_tokens` is checked too, and then the
slot's content is probed with our ids: a `/completion` of exactly our ids reusing
`len - 1` tokens proves the slot cached those very ids.

`bench_tokenization()` (run `python tests/prompt/test_prompt.py`) reports cold vs warm time for a
30k-token conversation; it is a helper, not a timed test.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prompt_corpus import COMPLETION_PROMPTS, CORPUS, INVALID, Backend

from proxy.prompt.builder import PromptBuilder
from proxy.prompt.caps import TemplateCaps
from proxy.prompt.chat_request import PromptError, dump_compact
from proxy.prompt.template import _tojson, llama_tojson

# -- template and caps ----------------------------------------------------------------


def test_backend_caps_and_template(backend: Backend, builder: PromptBuilder) -> None:
    props = backend.ok("/props")
    caps = props["chat_template_caps"]
    for name in ("supports_tools", "supports_tool_calls", "supports_object_arguments",
                 "supports_system_role", "supports_string_content"):
        assert caps[name] is True, (name, caps)
    # Our locally probed caps drive the same normalisation as the server's.
    assert builder.caps == TemplateCaps.from_props(caps)
    assert props["chat_template"] == builder.template.source


def test_apply_template_renders_tools(backend: Backend) -> None:
    prompt = backend.apply_template(CORPUS["tools_with_system"])
    assert "<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\"" in prompt
    assert prompt.startswith("<|im_start|>system\nUse tools.\n\n# Tools")


def test_backend_parses_tool_calls_with_our_template(backend: Backend,
                                                     builder: PromptBuilder) -> None:
    """llama-server turns `<tool_call>{json}</tool_call>` output into OpenAI tool_calls.

    Random weights never write a tool call, so the assistant text is prefilled (a trailing
    assistant message is continued, and the server parses prefill + output together) and
    EOS is forced right after it.
    """
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}},
             {"type": "function", "function": {"name": "ping"}}]
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris 🙂"}}\n</tool_call>\n<tool_call>\n{"name": "ping", '
            '"arguments": {}}\n</tool_call>')
    body = {"messages": [{"role": "user", "content": "weather?"},
                         {"role": "assistant", "content": text}],
            "tools": tools, "max_tokens": 2, "temperature": 0,
            "logit_bias": {str(builder.tokenizer.eos_id): 100}}
    choice = backend.ok("/v1/chat/completions", body)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert msg["content"] == "Let me check.\n"
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
             for c in msg["tool_calls"]]
    assert calls == [("get_weather", {"city": "Paris 🙂"}), ("ping", {})]
    # Sent back as history, the parsed turn renders exactly as it was generated, so the
    # tokens the slot cached remain a prefix of the next prompt.
    nxt = {"messages": [{"role": "user", "content": "weather?"}, msg,
                        {"role": "tool", "content": "18C"}], "tools": tools}
    assert "<|im_start|>assistant\n" + text + "<|im_end|>" in builder.render_chat(nxt)


# -- exactness corpus -----------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_chat_tokens_equal_backend(name: str, backend: Backend, builder: PromptBuilder) -> None:
    body = CORPUS[name]
    server_prompt = backend.apply_template(body)
    assert builder.render_chat(body) == server_prompt
    assert builder.chat_tokens(body) == backend.tokenize(server_prompt)


@pytest.mark.parametrize("name", sorted(INVALID))
def test_invalid_requests_raise_like_backend(name: str, backend: Backend,
                                             builder: PromptBuilder) -> None:
    status, _ = backend.call("/apply-template", INVALID[name])
    assert status >= 400
    with pytest.raises(PromptError):
        builder.chat_tokens(INVALID[name])


@pytest.mark.parametrize("name", ["multi_turn", "tool_calls_string_args", "unicode",
                                  "special_token_text", "prefill_assistant"])
def test_chat_endpoint_caches_our_tokens(name: str, backend: Backend,
                                         builder: PromptBuilder) -> None:
    body = {**CORPUS[name], "max_tokens": 1, "temperature": 0}
    tokens = builder.chat_tokens(body)
    out = backend.ok("/v1/chat/completions", body)
    assert out["usage"]["prompt_tokens"] == len(tokens)
    cache_n, prompt_n = backend.slot_reuse(tokens)
    # The slot holds the chat prompt (+ one generated token): all of ours but the last
    # one (always re-evaluated) is reused only if every id matches.
    assert (cache_n, prompt_n) == (len(tokens) - 1, 1)


@pytest.mark.parametrize("name", sorted(COMPLETION_PROMPTS))
def test_completion_tokens_equal_backend(name: str, backend: Backend,
                                         builder: PromptBuilder) -> None:
    prompt = COMPLETION_PROMPTS[name]
    assert builder.completion_tokens(prompt) == backend.tokenize(
        prompt["prompt_string"] if isinstance(prompt, dict) else prompt)


def test_completion_endpoint_counts(backend: Backend, builder: PromptBuilder) -> None:
    for prompt in (COMPLETION_PROMPTS["mixed_string_first"], ["first prompt", "second"]):
        tokens = builder.completion_tokens(prompt)
        out = backend.ok("/completion", {"prompt": prompt, "n_predict": 1})
        out = out[0] if isinstance(out, list) else out
        assert out["timings"]["cache_n"] + out["timings"]["prompt_n"] == len(tokens)


def test_completion_prompt_errors(builder: PromptBuilder) -> None:
    for bad in ([], [["a"]], 3.5, {"x": 1}, [1, 2.5]):
        with pytest.raises(PromptError):
            builder.completion_tokens(bad)


# -- random conversations against the backend -----------------------------------------

_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40) | \
    st.sampled_from(["<|im_start|>", "<|im_end|>", "<tool_call>", "\n", " ", "🙂", "",
                     "<|endoftext|>x", "é"])
_ARGS = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12) | _TEXT
    | st.floats(allow_nan=False, allow_infinity=False, width=32),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(_TEXT, kids, max_size=3),
    max_leaves=8)


@st.composite
def conversations(draw: st.DrawFn) -> dict[str, Any]:
    msgs: list[dict[str, Any]] = []
    if draw(st.booleans()):
        msgs.append({"role": "system", "content": draw(_TEXT)})
    for _ in range(draw(st.integers(1, 4))):
        parts = draw(st.lists(_TEXT, max_size=3))
        msgs.append({"role": "user", "content": draw(st.sampled_from([
            "".join(parts), [{"type": "text", "text": p} for p in parts]]))})
        if draw(st.booleans()):
            call = {"type": "function", "function": {
                "name": "f", "arguments": draw(st.dictionaries(_TEXT, _ARGS, max_size=3))}}
            msgs.append({"role": "assistant", "content": draw(_TEXT), "tool_calls": [call]})
            msgs.append({"role": "tool", "content": draw(_TEXT)})
        msgs.append({"role": "assistant", "content": draw(_TEXT)})
    body: dict[str, Any] = {"messages": msgs[:-1] if draw(st.booleans()) else msgs}
    if draw(st.booleans()):
        body["tools"] = [{"type": "function", "function": {
            "name": "f", "description": draw(_TEXT),
            # the backend builds a grammar from the schema: keep it a valid schema
            "parameters": {"type": "object", "properties": draw(st.dictionaries(
                _TEXT, st.fixed_dictionaries({"type": st.sampled_from(["string", "number"]),
                                              "description": _TEXT, "default": _ARGS}),
                max_size=2))}}}]
    return body


@settings(max_examples=60, deadline=None, suppress_health_check=[
    HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=conversations())
def test_random_conversations_equal_backend(body: dict[str, Any], backend: Backend,
                                            builder: PromptBuilder) -> None:
    server_prompt = backend.apply_template(body)
    assert builder.render_chat(body) == server_prompt
    assert builder.chat_tokens(body) == backend.tokenize(server_prompt)


# -- fragment cache ---------------------------------------------------------------------


_PIECES = st.lists(
    st.sampled_from(["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>",
                     "</tool_call>", "<|im_start", "im_end|>", " ", "  ", "\n", "\n\n",
                     "\t", "a", "Hello", " world", "🙂", "日本", "e\u0301", "'s", "123"])
    | st.text(max_size=12), max_size=30)


@settings(max_examples=400, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pieces=_PIECES)
def test_fragment_cache_equals_cold(pieces: list[str], builder: PromptBuilder) -> None:
    tok = builder.tokenizer
    text = "".join(pieces)
    expected = tok.tokenize_uncached(text)
    head = "".join(pieces[:len(pieces) // 2])
    assert tok.tokenize(head) == tok.tokenize_uncached(head)  # remembered as a prefix
    assert tok.tokenize(text) == expected  # resumes from `head`, may fill the cache
    assert tok.tokenize(text) == expected  # served from the caches
    assert tok.tokenize(text, add_special=False) == tok.tokenize_uncached(text, False)


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pieces=_PIECES, add_special=st.booleans())
def test_head_is_the_ids_before_the_first_unseen_fragment(
        pieces: list[str], add_special: bool, builder: PromptBuilder) -> None:
    """What a request is routed on before its rest is tokenized: the whole ids up to the
    text no cache holds, and that text's offset (`head` then `rest` = the cold ids)."""
    tok = builder.tokenizer
    seen = "".join(pieces[:len(pieces) // 2])
    tok.tokenize(seen, add_special)
    text = "".join(pieces)
    plan = tok.plan(text, add_special)
    got = builder.head(plan)
    assert got is not None
    head, at = got
    whole = tok.tokenize_uncached(text, add_special)
    assert whole[:len(head)] == head.tolist()
    if not plan.missing:
        assert at == len(text) and len(head) == len(whole)
    else:  # the head ends at a fragment boundary before the first unseen fragment
        assert text[at:].startswith(next(iter(plan.missing)))
        assert len(head) == len(tok.tokenize_uncached(text[:at], add_special)) - (
            1 if add_special and tok.add_eos else 0)
    tok.fetch(plan)
    assert tok.finish(plan).tolist() == whole


def test_fragment_cache_is_used_and_bounded(demo_model: Path) -> None:
    b = PromptBuilder.load(demo_model, max_cached_tokens=2_000)
    body = CORPUS["multi_turn"]
    first = b.chat_tokens(body)
    misses = b.tokenizer.stats.misses
    assert b.chat_tokens(body) == first and b.tokenizer.stats.misses == misses
    for i in range(200):
        b.chat_tokens({"messages": [{"role": "user", "content": f"filler {i} " * 20}]})
    assert b.tokenizer.stats.tokens <= 2_000
    assert b.chat_tokens(body) == first


def test_tojson_matches_llama_cpp_format() -> None:
    value = {"s": "<&>'\"\\\n\x01é🙂", "f": [1.0, 0.5, 1e-7, 1e21, -0.0, 123456789.0],
             "i": [0, -3, 2**40], "b": [True, False, None], "e": {}, "a": []}
    assert llama_tojson(value) == (
        '{"s": "<&>\'\\"\\\\\\n\\u0001é🙂", "f": [1, 0.5, 1e-07, 1e+21, -0, 1.23457e+08], '
        '"i": [0, -3, 1099511627776], "b": [true, false, null], "e": {}, "a": []}')
    assert llama_tojson({"a": [1, {"b": 2}], "c": []}, indent=2) == \
        '{\n  "a": [\n    1,\n    {\n      "b": 2\n    }\n  ],\n  "c": []\n}'
    assert llama_tojson(["é"], ensure_ascii=True) == '["\\u00e9"]'


# JSON values as requests carry them, plus the floats (and non-finite ones) a template
# could make: what the tojson memo and the compact dump must never confuse.
_SCALARS = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
            | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8))
_JSON = st.recursive(_SCALARS, lambda kids: st.lists(kids, max_size=4)
                     | st.dictionaries(st.text(max_size=4), kids, max_size=4), max_leaves=12)


@settings(max_examples=400, deadline=None)
@given(st.lists(_JSON, min_size=2, max_size=6), st.sampled_from([None, 2]),
       st.booleans())
def test_tojson_memo_is_exact(values: list[Any], indent: int | None,
                              ascii_: bool) -> None:
    """Each value prints as it does with the memo bypassed, whatever was printed before
    (NaN after null, 1 after 1.0, True after 1, other separators and indents)."""
    for v in values + values[::-1]:
        want = _tojson(v, ascii_, -1 if indent is None else indent,
                       ", " if indent is None else ",", ": ")
        assert llama_tojson(v, ensure_ascii=ascii_, indent=indent) == want, v


def test_tojson_memo_keeps_nan_apart_from_null() -> None:
    assert llama_tojson({"a": None, "b": [1]}) == '{"a": null, "b": [1]}'
    assert llama_tojson({"a": float("nan"), "b": [1]}) == '{"a": nan, "b": [1]}'
    assert llama_tojson([1.0, 2]) == "[1, 2]" and llama_tojson([1, 2]) == "[1, 2]"
    assert llama_tojson([True]) == "[true]" and llama_tojson([1]) == "[1]"


@settings(max_examples=400, deadline=None)
@given(_JSON)
def test_dump_compact_is_json_dumps(value: Any) -> None:
    """The orjson fast path writes what nlohmann-like json.dumps writes, or is skipped."""
    assert dump_compact(value) == json.dumps(value, ensure_ascii=False,
                                             separators=(",", ":"))


# -- micro-benchmark helper (not a test) -------------------------------------------------


def long_conversation(n_tokens: int = 30_000, seed: int = 0) -> dict[str, Any]:
    """An agent-like conversation of about `n_tokens` demo-vocabulary tokens."""
    rng = random.Random(seed)
    words = ["the", "function", "returns", "a", "list", "of", "files", "in", "src/", "ok",
             "error:", "line", "42", "def", "class", "import", "🙂", "数据", "résumé"]
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."}]
    approx = 0
    i = 0
    while approx < n_tokens:
        text = " ".join(rng.choice(words) for _ in range(rng.randint(50, 400)))
        role = ("user", "assistant")[i % 2]
        msgs.append({"role": role, "content": text})
        approx += len(text) // 4 + 5
        i += 1
    if msgs[-1]["role"] == "assistant":
        msgs.append({"role": "user", "content": "continue"})
    return {"messages": msgs}


def bench_tokenization(builder: PromptBuilder, n_tokens: int = 30_000,
                       repeat: int = 5) -> dict[str, float]:
    """Cold (empty fragment cache) vs warm (history seen, one new message) chat_tokens time
    in ms, and the uncached single-call llama_tokenize of the same text."""
    body = long_conversation(n_tokens)
    nxt = {"messages": [*body["messages"], {"role": "assistant", "content": "Sure."},
                        {"role": "user", "content": "And now the tests, please."}]}
    text = builder.render_chat(nxt)
    cold, warm, render, raw = [], [], [], []
    for _ in range(repeat):
        builder.tokenizer.clear_cache()
        t0 = time.perf_counter()
        tokens = builder.chat_tokens(nxt)
        cold.append(time.perf_counter() - t0)
        builder.tokenizer.clear_cache()
        builder.chat_tokens(body)  # the previous turn: its fragments are now cached
        t0 = time.perf_counter()
        assert builder.chat_tokens(nxt) == tokens
        warm.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        builder.render_chat(nxt)
        render.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        builder.tokenizer.tokenize_uncached(text)
        raw.append(time.perf_counter() - t0)
    return {"tokens": float(len(tokens)), "cold_ms": 1e3 * min(cold),
            "warm_ms": 1e3 * min(warm), "render_ms": 1e3 * min(render),
            "llama_tokenize_ms": 1e3 * min(raw)}


def test_bench_helper_runs(builder: PromptBuilder) -> None:
    out = bench_tokenization(builder, n_tokens=2_000, repeat=1)
    assert out["tokens"] > 1_000


if __name__ == "__main__":
    from backends.demo_model import DemoModelParams, ensure_demo_model

    print(bench_tokenization(PromptBuilder.load(ensure_demo_model(DemoModelParams()))))
