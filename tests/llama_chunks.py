"""llama-server's chat stream chunks, and the named server-sent events a relay writes
back (Anthropic's and the Responses API's), for the relays' tests."""

from __future__ import annotations

import json
from typing import Any


def chunk(delta: dict[str, Any] | None, finish: str | None = None,
          timings: dict[str, int] | None = None, usage: bool = False) -> dict[str, Any]:
    # tools/server/server-task.cpp to_json_oaicompat_chat*: one choice, or none for usage
    out: dict[str, Any] = {"id": "chatcmpl-x", "model": "kvroute-demo",
                           "object": "chat.completion.chunk",
                           "choices": [] if usage else [
                               {"index": 0, "finish_reason": finish, "delta": delta or {}}]}
    if usage:
        out["usage"] = {"completion_tokens": 9, "prompt_tokens": 120, "total_tokens": 129,
                        "prompt_tokens_details": {"cached_tokens": 100}}
    if timings:
        out["timings"] = timings
    return out


def named_events(raw: list[bytes]) -> list[dict[str, Any]]:
    """The `event:`/`data:` pairs of a relayed stream, each data's type its event's name."""
    out = []
    for ev in b"".join(raw).decode().split("\n\n"):
        lines = ev.strip().splitlines()
        if lines:
            assert lines[0].startswith("event: ") and lines[1].startswith("data: ")
            data = json.loads(lines[1][6:])
            assert data["type"] == lines[0][7:]
            out.append(data)
    return out
