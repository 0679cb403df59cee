"""Non-streamed answers assembled from the backend's stream (proxy/forwarding/assemble.py).

Against a real llama-server: the proxy's assembled answer must be the body the server
itself sends for the same non-streamed request (same fields and text; the ids, times and
clock fields aside). Both run with `cache_prompt: false` so both compute the same logits.
Synthetic chunks cover what the demo model cannot produce (tool calls, reasoning).
"""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from proxy_client import proxy
from texts import words

from proxy.forwarding.assemble import (
    SHORT_GENERATION,
    ChatAssembler,
    NativeAssembler,
    TextAssembler,
    assembler_for,
)

pytestmark = pytest.mark.timeout(240)

# Differ between two runs of the same request.
_VOLATILE = {"id", "created", "timings", "prompt_ms", "predicted_ms", "t_prompt_processing",
             "id_slot"}




def same_shape(direct: Any, assembled: Any, path: str = "") -> None:
    """Equal, except for fields that differ between two runs."""
    if isinstance(direct, dict):
        assert isinstance(assembled, dict), path
        assert set(direct) == set(assembled), (path, set(direct) ^ set(assembled))
        for key, value in direct.items():
            if key not in _VOLATILE:
                same_shape(value, assembled[key], f"{path}.{key}")
    elif isinstance(direct, list):
        assert isinstance(assembled, list) and len(direct) == len(assembled), path
        for i, (a, b) in enumerate(zip(direct, assembled, strict=True)):
            same_shape(a, b, f"{path}[{i}]")
    else:
        assert direct == assembled, path


CASES = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": words(40, 1)}],
                              "max_tokens": 48}),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": words(20, 2)},
                                           {"role": "user", "content": words(30, 3)}],
                              "max_tokens": 40, "logprobs": True, "top_logprobs": 2}),
    ("/v1/completions", {"prompt": words(50, 4), "max_tokens": 40}),
    ("/v1/completions", {"prompt": words(50, 5), "max_tokens": 40, "logprobs": 2}),
    ("/completion", {"prompt": words(50, 6), "n_predict": 40}),
    ("/completion", {"prompt": words(50, 7), "n_predict": 40, "n_probs": 2,
                     "return_tokens": True}),
    ("/completion", {"prompt": words(50, 8), "n_predict": 40, "return_tokens": False}),
]


@pytest.mark.parametrize(("path", "body"), CASES)
async def test_assembled_answer_is_the_servers_own(backend_pool: Any, path: str,
                                                   body: dict[str, Any]) -> None:
    sup = await backend_pool()
    info = sup.ready()[0]
    body = {**body, "temperature": 0, "cache_prompt": False}
    assert assembler_for(path, body) is not None
    async with aiohttp.ClientSession() as s, s.post(
            info.url + path, json=body,
            headers={"Authorization": f"Bearer {info.api_key}"}) as r:
        assert r.status == 200
        direct = await r.json()
    async with proxy(sup) as client:
        r = await client.post(path, json=body)
        assert r.status == 200, await r.text()
        assert r.headers["Content-Type"].startswith("application/json")
        assembled = await r.json()
    if path == "/completion" and "return_tokens" not in body:
        # the proxy asks for the generated ids (its feedback uses them), as on the plain
        # path: a client that did not say gets them too
        assert assembled["tokens"] and direct["tokens"] == []
        assembled["tokens"] = []
    same_shape(direct, assembled)


# ----------------------------------------------------------------- pure: which path
@pytest.mark.parametrize(("path", "body", "assembled"), [
    ("/v1/chat/completions", {}, True),                       # server default: long
    ("/v1/chat/completions", {"max_tokens": SHORT_GENERATION}, False),
    ("/v1/chat/completions", {"max_tokens": SHORT_GENERATION + 1}, True),
    ("/v1/chat/completions", {"max_completion_tokens": 8}, False),
    ("/v1/chat/completions", {"max_tokens": -1}, True),      # -1: until the context ends
    ("/v1/chat/completions", {"n": 2}, False),
    ("/v1/chat/completions", {"n": 1}, True),
    ("/v1/completions", {"prompt": ["a", "b"]}, False),      # several prompts, several answers
    ("/v1/completions", {"prompt": [1, 2, 3]}, True),         # one prompt of token ids
    ("/completion", {"n_predict": 4}, False),
    # the server takes n_predict over its aliases: a short max_tokens beside it is not
    # what the generation's length is
    ("/v1/chat/completions", {"max_tokens": 2, "n_predict": -1}, True),
    ("/completion", {"n_predict": 2000, "max_tokens": 4}, True),
    ("/v1/chat/completions", {"max_completion_tokens": 4000, "max_tokens": 4}, True),
    ("/v1/chat/completions", {"max_completion_tokens": 4, "max_tokens": 4000}, False),
    ("/completion", {"response_fields": ["content"]}, False),
    ("/completion", {}, True),
    ("/v1/chat/completions", {"logprobs": True, "tools": [{"type": "function"}]}, False),
    ("/v1/chat/completions", {"logprobs": True}, True),
    ("/tokenize", {}, False),
])
def test_which_requests_are_assembled(path: str, body: dict[str, Any], assembled: bool
                                      ) -> None:
    assert (assembler_for(path, body) is not None) is assembled


# -------------------------------------------------------- pure: synthetic chunk streams
def _chunk(delta: dict[str, Any] | None = None, finish: str | None = None,
           **top: Any) -> dict[str, Any]:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return {"choices": choices, "id": "chatcmpl-1", "created": 5, "model": "m",
            "system_fingerprint": "b1", "object": "chat.completion.chunk", **top}


def test_chat_tool_calls_and_reasoning_are_merged() -> None:
    a = ChatAssembler()
    for obj in [
        _chunk({"role": "assistant", "content": None}),
        _chunk({"reasoning_content": "think "}),
        _chunk({"reasoning_content": "more"}),
        _chunk({"content": "Let me look."}),
        _chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                                "function": {"name": "read_file"}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"path":'}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": ' "a.py"}'}}]}),
        _chunk({"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                                "function": {"name": "ls", "arguments": "{}"}}]}),
        _chunk({}, "tool_calls"),
        _chunk(None, usage={"completion_tokens": 9, "prompt_tokens": 3, "total_tokens": 12},
               timings={"cache_n": 1}),
    ]:
        assert a.body() is None or obj is not None
        a.add(obj)
    assert a.body() == {
        "choices": [{"finish_reason": "tool_calls", "index": 0, "message": {
            "role": "assistant", "content": "Let me look.", "reasoning_content": "think more",
            "tool_calls": [
                {"type": "function", "id": "call_a",
                 "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}},
                {"type": "function", "id": "call_b",
                 "function": {"name": "ls", "arguments": "{}"}}]}}],
        "created": 5, "model": "m", "system_fingerprint": "b1", "object": "chat.completion",
        "usage": {"completion_tokens": 9, "prompt_tokens": 3, "total_tokens": 12},
        "id": "chatcmpl-1", "timings": {"cache_n": 1}}


def test_unfinished_streams_assemble_to_nothing() -> None:
    chat, text, native = ChatAssembler(), TextAssembler(), NativeAssembler()
    chat.add(_chunk({"content": "partial"}))
    text.add({"choices": [{"text": "partial", "index": 0, "finish_reason": None}]})
    native.add({"content": "partial", "tokens": [1], "stop": False})
    assert chat.body() is None and text.body() is None and native.body() is None
