"""Chat-completions answers -> OpenAI Responses answers (bodies and SSE events).

kvroute sends `/v1/responses` to a backend's `/v1/chat/completions` (see routes.py for
why), and this relay turns what comes back into what llama-server itself answers on
`/v1/responses` (`to_json_oaicompat_resp*` in tools/server/server-task.cpp):

- output items in the order reasoning (`reasoning_content`, one `reasoning_text`
  part, an empty `encrypted_content`), message (one `output_text` part), one
  `function_call` per tool call (`id` = `fc_<call id>`, `call_id` = `call_<call id>`);
- `status` is always `completed` (the server says so for a truncated answer too);
- usage: `input_tokens` = the whole prompt, `input_tokens_details.cached_tokens` = the
  tokens the slot reused, `output_tokens` = generated tokens.

The stream has the server's events in the server's order (`response.created`,
`response.in_progress`, items added and their deltas as they come, then the `.done`
events and `response.completed` with usage and `timings`), plus the fields the Responses
protocol gives every event and the server leaves out: `sequence_number`,
`output_index`, `content_index` and `logprobs` (the OpenAI SDK's stream helper needs
them), and a whole response object in the lifecycle events. A mid-stream error passes
as the server writes it (`data: {"error": ...}`, which the SDK raises).
"""

from __future__ import annotations

import json
import secrets
import string
import time
from typing import Any

from proxy.forwarding.answer import JSON, Relay, first_choice
from proxy.reporting.outcome import reported_reuse

_ALPHABET = string.ascii_letters + string.digits


def random_id(prefix: str) -> str:
    """An id like the server's (`random_string()`: 32 alphanumerics)."""
    return prefix + "".join(secrets.choice(_ALPHABET) for _ in range(32))


def sse(data: JSON) -> bytes:
    """One Responses SSE event (`format_oai_resp_sse`)."""
    return f"event: {data['type']}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def usage(cached: int, prompt_tokens: int, output: int) -> JSON:
    return {"input_tokens": prompt_tokens, "output_tokens": output,
            "total_tokens": prompt_tokens + output,
            "input_tokens_details": {"cached_tokens": cached}}


def reasoning_item(item_id: str, text: str | None, status: str) -> JSON:
    content = [] if text is None else [{"text": text, "type": "reasoning_text"}]
    return {"id": item_id, "summary": [], "type": "reasoning", "content": content,
            "encrypted_content": "", "status": status}


def text_part(text: str) -> JSON:
    return {"type": "output_text", "annotations": [], "logprobs": [], "text": text}


def message_item(item_id: str, text: str | None, status: str) -> JSON:
    return {"content": [] if text is None else [text_part(text)], "id": item_id,
            "role": "assistant", "status": status, "type": "message"}


def call_item(call_id: str, name: str, arguments: str, status: str) -> JSON:
    return {"id": "fc_" + call_id, "type": "function_call", "status": status,
            "arguments": arguments, "call_id": "call_" + call_id, "name": name}


def _output_tokens(obj: JSON) -> int | None:
    u = obj.get("usage")
    if isinstance(u, dict) and isinstance(u.get("completion_tokens"), int):
        return int(u["completion_tokens"])
    t = obj.get("timings")
    if isinstance(t, dict) and isinstance(t.get("predicted_n"), int):
        return int(t["predicted_n"])
    return None


def _calls(msg: JSON) -> list[JSON]:
    calls = msg.get("tool_calls")
    out = []
    for call in calls if isinstance(calls, list) else ():
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            continue  # (an external backend's malformed call)
        cid, args = call.get("id"), fn.get("arguments")
        out.append(call_item(cid if isinstance(cid, str) else "", fn["name"],
                             args if isinstance(args, str) else json.dumps(args), "completed"))
    return out


class _Call:
    """A tool call being streamed: its output index and what it has said so far."""

    def __init__(self, index: int, call_id: str, name: str) -> None:
        self.index, self.call_id, self.name = index, call_id, name
        self.arguments = ""


class ResponsesRelay(Relay):
    """Translates one chat-completions answer (a body or a stream) to the Responses format.

    One instance per request: the stream translation is stateful.
    """

    translates_events = True

    def __init__(self, model: str = "") -> None:
        self.model = model          # fallback when the upstream names none
        self.resp_id = random_id("resp_")
        self.created_at = int(time.time())
        self.seq = 0                # sequence_number of the next event
        self.started = False        # response.created sent
        self.next_index = 0         # output_index of the next item
        self.reasoning: tuple[int, str, list[str]] | None = None  # index, id, text
        self.message: tuple[int, str, list[str]] | None = None
        self.calls: dict[int, _Call] = {}  # chat tool_call index -> its item
        self.cached = self.prompt_tokens = self.output_tokens = 0
        self.timings: JSON | None = None

    # ---------------------------------------------------------- non-streaming
    def body(self, obj: JSON) -> JSON | None:
        _, msg = first_choice(obj)
        output: list[JSON] = []
        reasoning = msg.get("reasoning_content")
        if isinstance(reasoning, str) and reasoning:
            output.append(reasoning_item(random_id("rs_"), reasoning, "completed"))
        text = msg.get("content")
        if isinstance(text, str) and text:
            output.append(message_item(random_id("msg_"), text, "completed"))
        output += _calls(msg)
        cached, prompt = reported_reuse(obj)
        now = int(time.time())
        return {"completed_at": now, "created_at": now, "id": self.resp_id,
                "model": obj.get("model") or self.model, "object": "response",
                "output": output, "status": "completed",
                "usage": usage(cached or 0, prompt or 0, _output_tokens(obj) or 0)}

    # --------------------------------------------------------------- streaming
    def event(self, obj: JSON) -> list[bytes] | None:
        if "error" in obj:
            return None  # as the server's own stream ends: `data: {"error": ...}`
        self._absorb(obj)
        choices = obj.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return []  # the usage-only chunk: its numbers go into response.completed
        delta = choices[0].get("delta")
        delta = delta if isinstance(delta, dict) else {}
        out = self._start()
        reasoning = delta.get("reasoning_content")
        if isinstance(reasoning, str) and reasoning:
            out += self._reasoning_delta(reasoning)
        text = delta.get("content")
        if isinstance(text, str) and text:
            out += self._text_delta(text)
        calls = delta.get("tool_calls")
        for call in calls if isinstance(calls, list) else ():
            out += self._call_delta(call)
        return out

    def done(self) -> list[bytes] | None:
        out = self._start()
        items: list[tuple[int, JSON]] = []
        if self.reasoning is not None:
            index, rid, parts = self.reasoning
            item = reasoning_item(rid, "".join(parts), "completed")
            out.append(self._sse("response.output_item.done", output_index=index, item=item))
            items.append((index, item))
        if self.message is not None:
            out += self._message_done()
            index, mid, parts = self.message
            items.append((index, message_item(mid, "".join(parts), "completed")))
        for call in self.calls.values():
            item = call_item(call.call_id, call.name, call.arguments, "completed")
            out.append(self._sse("response.output_item.done", output_index=call.index,
                                 item=item))
            items.append((call.index, item))
        response = self._response("completed", [item for _, item in sorted(
            items, key=lambda pair: pair[0])])
        response["usage"] = usage(self.cached, self.prompt_tokens, self.output_tokens)
        extra = {} if self.timings is None else {"timings": self.timings}
        out.append(self._sse("response.completed", response=response, **extra))
        return out

    # ----------------------------------------------------------------- helpers
    def _absorb(self, obj: JSON) -> None:
        cached, prompt = reported_reuse(obj)
        if prompt is not None:
            self.cached, self.prompt_tokens = cached or 0, prompt
        output = _output_tokens(obj)
        if output is not None:
            self.output_tokens = output
        if isinstance(obj.get("timings"), dict):
            self.timings = obj["timings"]
        if isinstance(obj.get("model"), str) and obj["model"]:
            self.model = obj["model"]  # the server's model name, as its own answers give

    def _sse(self, etype: str, **fields: Any) -> bytes:
        data = {"type": etype, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(data)

    def _response(self, status: str, output: list[JSON]) -> JSON:
        return {"id": self.resp_id, "object": "response", "created_at": self.created_at,
                "status": status, "model": self.model, "output": output}

    def _start(self) -> list[bytes]:
        if self.started:
            return []
        self.started = True
        return [self._sse(etype, response=self._response("in_progress", []))
                for etype in ("response.created", "response.in_progress")]

    def _add(self, item: JSON) -> tuple[int, bytes]:
        index = self.next_index
        self.next_index += 1
        return index, self._sse("response.output_item.added", output_index=index, item=item)

    def _reasoning_delta(self, text: str) -> list[bytes]:
        out = []
        if self.reasoning is None:
            rid = random_id("rs_")
            index, added = self._add(reasoning_item(rid, None, "in_progress"))
            self.reasoning = (index, rid, [])
            out.append(added)
        index, rid, parts = self.reasoning
        parts.append(text)
        out.append(self._sse("response.reasoning_text.delta", item_id=rid,
                             output_index=index, content_index=0, delta=text))
        return out

    def _text_delta(self, text: str) -> list[bytes]:
        out = []
        if self.message is None:
            mid = random_id("msg_")
            index, added = self._add(message_item(mid, None, "in_progress"))
            self.message = (index, mid, [])
            out += [added, self._sse("response.content_part.added", item_id=mid,
                                     output_index=index, content_index=0,
                                     part=text_part(""))]
        index, mid, parts = self.message
        parts.append(text)
        out.append(self._sse("response.output_text.delta", item_id=mid, output_index=index,
                             content_index=0, delta=text, logprobs=[]))
        return out

    def _message_done(self) -> list[bytes]:
        assert self.message is not None
        index, mid, parts = self.message
        text = "".join(parts)
        where = {"item_id": mid, "output_index": index, "content_index": 0}
        return [self._sse("response.output_text.done", **where, text=text, logprobs=[]),
                self._sse("response.content_part.done", **where, part=text_part(text)),
                self._sse("response.output_item.done", output_index=index,
                          item=message_item(mid, text, "completed"))]

    def _call_delta(self, call: Any) -> list[bytes]:
        if not isinstance(call, dict) or not isinstance(call.get("index", 0), int):
            return []  # (an external backend's malformed call: nothing to place it in)
        fn = call.get("function") if isinstance(call.get("function"), dict) else {}
        key = call.get("index", 0)
        out: list[bytes] = []
        name = fn.get("name")
        if isinstance(name, str) and name and key not in self.calls:
            cid = call.get("id")
            cid = cid if isinstance(cid, str) else ""
            index, added = self._add(call_item(cid, name, "", "in_progress"))
            self.calls[key] = _Call(index, cid, name)
            out.append(added)
        state = self.calls.get(key)
        args = fn.get("arguments")
        if state is not None and isinstance(args, str) and args:
            state.arguments += args
            out.append(self._sse("response.function_call_arguments.delta",
                                 item_id="fc_" + state.call_id, output_index=state.index,
                                 delta=args))
        return out
