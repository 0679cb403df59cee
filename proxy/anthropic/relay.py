"""Chat-completions answers -> Anthropic Messages answers (bodies and SSE events).

kvroute sends `/v1/messages` to a backend's `/v1/chat/completions` (so a slot can be
pinned: the server ignores `id_slot` on `/v1/messages`; see BENCHMARKS.md, "Anthropic
API"), and these relays turn what comes back into what llama-server itself would
have answered on `/v1/messages` (`to_json_anthropic*` in tools/server/server-task.cpp):

- stop reason: finish `stop` -> `end_turn`, `tool_calls` -> `tool_use`, else `max_tokens`;
- content blocks in the order thinking (`reasoning_content`), text, one `tool_use` per
  tool call (`input` = the parsed arguments, `{}` if they are not JSON); a thinking
  block carries an empty `signature` (no cryptographic signature for local models);
- usage: `cache_read_input_tokens` = the tokens the slot reused, `input_tokens` = the
  rest of the prompt, `output_tokens` = generated tokens.

Streams differ from the server's in two deliberate ways, both within Anthropic's
protocol: a block is closed (`content_block_stop`) before the next one starts, as
Anthropic's API does (llama-server closes them all at the end), and `message_delta`
repeats the input usage next to `output_tokens`, as Anthropic's API does.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from proxy.errors import ErrorFormat, anthropic_error
from proxy.forwarding.answer import JSON, Relay, first_choice
from proxy.reporting.outcome import reported_reuse

_STOP_REASONS = {"stop": "end_turn", "tool_calls": "tool_use"}

def error_from_upstream(status: int, body: bytes) -> JSON:
    """An upstream error body (llama-server: `{"error": {"code", "message", "type"}}`) in
    Anthropic's shape, keeping its message."""
    message, etype = "", None
    try:
        obj = json.loads(body)
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        if obj.get("type") == "error" and isinstance(obj.get("error"), dict):
            return obj  # already Anthropic's
        err = obj.get("error")
        if isinstance(err, dict):
            message = str(err.get("message", ""))
            etype = err.get("type") if isinstance(err.get("type"), str) else None
        elif isinstance(err, str):
            message = err
    if not message:
        message = body.decode("utf-8", errors="replace")[:500] or f"backend error {status}"
    return anthropic_error(status, message, etype)


def sse(event: str, data: JSON) -> bytes:
    """One Anthropic SSE event (`format_anthropic_sse`)."""
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def _tool_input(arguments: Any) -> Any:
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments) if isinstance(arguments, str) else None
    except ValueError:
        value = None
    return value if value is not None else {}


def _usage(cached: int, prompt_tokens: int, output: int) -> JSON:
    return {"cache_read_input_tokens": cached, "input_tokens": max(0, prompt_tokens - cached),
            "output_tokens": output}


class AnthropicErrors(Relay):
    """Relays answers as they are, translating only errors to Anthropic's format (for a
    backend's own `/v1/messages`, which already answers in that format)."""

    error_format = ErrorFormat.ANTHROPIC

    def error(self, status: int, body: bytes) -> bytes | None:
        return json.dumps(error_from_upstream(status, body)).encode()


class AnthropicRelay(AnthropicErrors):
    """Translates one chat-completions answer (a body or a stream) to Anthropic's format.

    One instance per request: the stream translation is stateful.
    """

    translates_events = True

    def __init__(self, model: str = "", stops: Sequence[object] = ()) -> None:
        self.model = model        # fallback when the upstream names none
        # the client's stop sequences: a stopping word that is none of them (a stop the
        # chat template adds) is not reported as one
        self.stops = frozenset(x for x in stops if isinstance(x, str))
        self.started = False      # message_start sent
        self.msg_id = ""
        self.cached = 0           # cache_read_input_tokens
        self.prompt_tokens = 0
        self.output_tokens = 0
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None  # the stop sequence that ended it
        self.index = -1           # index of the open block (-1: none)
        self.kind: str | None = None   # type of the open block
        self.tool_blocks: dict[int, int] = {}  # OpenAI tool_call index -> block index
        self.next_index = 0

    # ---------------------------------------------------------- non-streaming
    def body(self, obj: JSON) -> JSON | None:
        choice, msg = first_choice(obj)
        content: list[JSON] = []
        reasoning = msg.get("reasoning_content")
        if isinstance(reasoning, str) and reasoning:
            content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
        text = msg.get("content")
        if isinstance(text, str) and text:
            content.append({"type": "text", "text": text})
        calls = msg.get("tool_calls")
        for call in calls if isinstance(calls, list) else ():
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                continue  # (an external backend's malformed call)
            cid = call.get("id")
            content.append({"type": "tool_use", "id": cid if isinstance(cid, str) else "",
                            "name": fn["name"], "input": _tool_input(fn.get("arguments"))})
        cached, prompt = reported_reuse(obj)
        usage = obj.get("usage") if isinstance(obj.get("usage"), dict) else {}
        output = usage.get("completion_tokens")
        if not isinstance(output, int):
            t = obj.get("timings") or {}
            output = t.get("predicted_n", 0) if isinstance(t, dict) else 0
        finish = choice.get("finish_reason") if isinstance(choice, dict) else None
        stop = self._stopping_word(obj)
        return {
            "id": obj.get("id", ""), "type": "message", "role": "assistant",
            "content": content, "model": obj.get("model") or self.model,
            "stop_reason": "stop_sequence" if stop else
            _STOP_REASONS.get(str(finish), "max_tokens"),
            "stop_sequence": stop,
            "usage": _usage(cached or 0, prompt or 0, output or 0),
        }

    # --------------------------------------------------------------- streaming
    def event(self, obj: JSON) -> list[bytes] | None:
        if "error" in obj:  # llama-server's mid-stream error chunk
            err = obj["error"] if isinstance(obj["error"], dict) else {"message": obj["error"]}
            code = err.get("code")
            status = code if isinstance(code, int) else 500
            return [sse("error", anthropic_error(status, str(err.get("message", "")),
                                                 err.get("type")))]
        cached, prompt = reported_reuse(obj)
        if prompt is not None:
            self.cached, self.prompt_tokens = cached or 0, prompt
        self.stop_sequence = self._stopping_word(obj) or self.stop_sequence
        t = obj.get("timings")
        if isinstance(t, dict) and isinstance(t.get("predicted_n"), int):
            self.output_tokens = t["predicted_n"]
        usage = obj.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.output_tokens = usage["completion_tokens"]
        if not self.msg_id and isinstance(obj.get("id"), str):
            self.msg_id = obj["id"]
        if isinstance(obj.get("model"), str) and obj["model"]:
            self.model = obj["model"]  # the server's model name, as its own answers give
        choices = obj.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return []  # the usage-only chunk: its numbers go into message_delta
        choice = choices[0]
        delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
        out: list[bytes] = []
        # NOTE: the first chunk (`role` only) arrives without timings when the first
        # token produced text (the timings ride on the text chunk): message_start waits
        # for a chunk that knows the prompt's reuse, as the server's own does.
        if not self.started and (cached is not None or self._has_content(delta)):
            out.append(self._message_start())
        reasoning = delta.get("reasoning_content")
        if isinstance(reasoning, str) and reasoning:
            out += self._open("thinking", {"type": "thinking", "thinking": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": reasoning}))
        text = delta.get("content")
        if isinstance(text, str) and text:
            out += self._open("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": text}))
        calls = delta.get("tool_calls")
        for call in calls if isinstance(calls, list) else ():
            out += self._tool_delta(call)
        finish = choice.get("finish_reason")
        if isinstance(finish, str):
            self.stop_reason = _STOP_REASONS.get(finish, "max_tokens")
        return out

    def done(self) -> list[bytes] | None:
        out = [] if self.started else [self._message_start()]
        out += self._close()
        out.append(sse("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": "stop_sequence" if self.stop_sequence else
                      self.stop_reason or "end_turn", "stop_sequence": self.stop_sequence},
            "usage": _usage(self.cached, self.prompt_tokens, self.output_tokens)}))
        out.append(sse("message_stop", {"type": "message_stop"}))
        return out

    # ----------------------------------------------------------------- helpers
    def _stopping_word(self, obj: JSON) -> str | None:
        """The client's stop sequence that ended the answer, from `__verbose` (asked for
        when the request has stop sequences: a chat answer does not say which matched)."""
        v = obj.get("__verbose")
        word = v.get("stopping_word") if isinstance(v, dict) else None
        return word if isinstance(word, str) and word in self.stops else None

    @staticmethod
    def _has_content(delta: JSON) -> bool:
        return bool(delta.get("content") or delta.get("reasoning_content")
                    or delta.get("tool_calls"))

    def _message_start(self) -> bytes:
        self.started = True
        return sse("message_start", {"type": "message_start", "message": {
            "id": self.msg_id, "type": "message", "role": "assistant", "content": [],
            "model": self.model, "stop_reason": None, "stop_sequence": None,
            "usage": _usage(self.cached, self.prompt_tokens, 0)}})

    def _close(self) -> list[bytes]:
        if self.index < 0:
            return []
        out = []
        if self.kind == "thinking":
            # Anthropic's protocol has a signature_delta before a thinking block ends.
            out.append(self._delta({"type": "signature_delta", "signature": ""}))
        out.append(sse("content_block_stop", {"type": "content_block_stop",
                                              "index": self.index}))
        self.index, self.kind = -1, None
        return out

    def _open(self, kind: str, block: JSON) -> list[bytes]:
        if self.kind == kind and kind != "tool_use":
            return []
        out = self._close()
        self.index, self.kind = self.next_index, kind
        self.next_index += 1
        out.append(sse("content_block_start", {"type": "content_block_start",
                                               "index": self.index, "content_block": block}))
        return out

    def _delta(self, delta: JSON) -> bytes:
        return sse("content_block_delta", {"type": "content_block_delta",
                                           "index": self.index, "delta": delta})

    def _tool_delta(self, call: Any) -> list[bytes]:
        if not isinstance(call, dict):
            return []
        fn = call.get("function") if isinstance(call.get("function"), dict) else {}
        tc_index = call.get("index", 0)
        if not isinstance(tc_index, int):
            return []  # (an external backend's malformed call: nothing to place it in)
        out: list[bytes] = []
        name = fn.get("name")
        if isinstance(name, str) and name and tc_index not in self.tool_blocks:
            cid = call.get("id")
            out += self._open("tool_use", {"type": "tool_use",
                                           "id": cid if isinstance(cid, str) else "",
                                           "name": name, "input": {}})
            self.tool_blocks[tc_index] = self.index
        elif self.tool_blocks.get(tc_index) != self.index:
            return out  # arguments for a block already closed: cannot be sent any more
        args = fn.get("arguments")
        if isinstance(args, str) and args:
            out.append(self._delta({"type": "input_json_delta", "partial_json": args}))
        return out
