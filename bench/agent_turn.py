"""A coding agent's turn as an OpenAI chat request: what Claude Code-like clients send.

Tool schemas (~55k characters, as Claude Code's ~48k), a long system prompt, and a
history of assistant tool calls and tool results; each body adds one new call and its
result, so everything but the last two messages was seen on the turn before. Used by
bench_proxy.py (the proxy's overhead on such a turn) and for profiling the prompt path.
"""

from __future__ import annotations

import random
from typing import Any

WORDS = ("amber", "falcon", "harbor", "meadow", "quartz", "saddle", "tundra", "velvet",
         "walnut", "lantern", "pepper", "copper", "ember", "glacier", "orbit", "prism")


def _words(n: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def tools(rng: random.Random, n: int = 18) -> list[dict[str, Any]]:
    def schema() -> dict[str, Any]:
        props = {f"p{j}": {"type": "string", "description": _words(30, rng)}
                 for j in range(8)}
        props["limit"] = {"type": "integer", "minimum": 1, "default": 100}
        return {"type": "object", "properties": props, "required": ["p0"],
                "additionalProperties": False,
                "$schema": "http://json-schema.org/draft-07/schema#"}
    return [{"type": "function", "function": {"name": f"Tool{i}",
                                              "description": _words(150, rng),
                                              "parameters": schema()}}
            for i in range(n)]


def _call(i: int, rng: random.Random) -> list[dict[str, Any]]:
    call_id = f"call_{i:05d}"
    return [{"role": "assistant", "content": _words(30, rng), "tool_calls": [{
                "id": call_id, "type": "function", "function": {
                    "name": "Tool1", "arguments": f'{{"p0": "ls {i}", "limit": 20}}'}}]},
            {"role": "tool", "tool_call_id": call_id, "content": _words(150, rng)}]


def agent_bodies(n: int, seed: int = 0, history_calls: int = 30) -> list[dict[str, Any]]:
    """`n` turns of one session: the same history, each with its own newest call."""
    rng = random.Random(seed)
    base: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. " + _words(2500, rng)},
        {"role": "user", "content": _words(200, rng)}]
    for i in range(history_calls):
        base += _call(i, rng)
    tl = tools(rng)
    return [{"messages": [*base, *_call(1000 + k, rng)], "tools": tl, "max_tokens": 1,
             "stream": True} for k in range(n)]
