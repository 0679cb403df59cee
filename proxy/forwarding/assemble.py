"""A non-streamed answer, built from the backend's stream.

Why: a client that leaves a non-streamed request (an SDK timeout, a closed tab) must free
its slot. llama-server notices a gone client when it writes to it; a non-streamed answer is
written only at the end. It also polls the connection while it waits, but only after a
second in which no result at all reached its result queue (server_response_reader::next,
pinned build): any other slot's stream, even a `/slots` query, restarts that wait, so on a
busy server a zombie generation runs to `max_tokens` while the router, which saw the
client go, routes new requests to a slot that is not free. So the proxy asks the backend
for a stream (each token is a write: the server stops at the next one once the proxy drops
the connection) and assembles here the body llama-server would have sent: the same fields
as its non-streamed answer (server-task.cpp `to_json_*`; compared field by field with the
real server in tests/forwarding/test_assemble.py).

Only where that buys something: a short generation (`max_tokens` <= SHORT_GENERATION)
ends soon anyway and takes the plain path, which costs less per request. Requests whose
answer is not one object of a known shape (several prompts or choices, `response_fields`)
take the plain path too, as do those a stream would refuse (chat logprobs with tools).
If such a long one's client leaves, the pipeline lets the exchange run on to its end
(`runs_on_when_left`), so that the router frees the slot when the backend does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from backends.dialect import CHAT_PATH, NATIVE_PATHS, OPENAI_PATHS

JSON = dict[str, Any]

# Generations at most this long are not worth a stream: as a zombie they end within a
# second or so on any backend.
SHORT_GENERATION = 32

# The fields llama-server puts in an OpenAI body around `choices`, in its order.
_TOP = ("created", "model", "system_fingerprint")
# The generation's length: the first of these the body has (server-schema.cpp: n_predict,
# then its aliases in this order), whatever the others say.
_LENGTH_KEYS = ("n_predict", "max_completion_tokens", "max_tokens")
_PATHS = OPENAI_PATHS | NATIVE_PATHS


class Assembler(Protocol):
    def add(self, obj: JSON) -> None:
        """One upstream stream chunk."""

    def body(self) -> JSON | None:
        """The assembled answer; None if the stream never said it was finished."""


def assembler_for(path: str, body: JSON) -> Assembler | None:
    """How to assemble `body`'s answer on `path`, or None to send it as it is."""
    if path not in _PATHS or _short(body) or _several(body) or \
            ("response_fields" in body and path in NATIVE_PATHS):  # (its body's shape)
        return None
    if body.get("logprobs") is True and body.get("tools"):
        return None  # llama-server refuses logprobs with tools in a stream, not without
    if path == CHAT_PATH:
        return ChatAssembler()
    if path == "/v1/completions":
        return TextAssembler()
    return NativeAssembler(keep_tokens=body.get("return_tokens") is not False)


def runs_on_when_left(path: str, body: JSON) -> bool:
    """A non-streamed request sent as it is (no assembler) whose generation may run long:
    its backend goes on generating after the client left (see the module doc). Short
    ones end soon anyway."""
    return (body.get("stream") is not True and path in _PATHS and not _short(body)
            and assembler_for(path, body) is None)


def _short(body: JSON) -> bool:
    n = next((body[key] for key in _LENGTH_KEYS if key in body), None)
    return isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= SHORT_GENERATION


def _several(body: JSON) -> bool:
    """Several answers in one body: n > 1, or several prompts."""
    for key in ("n", "n_cmpl"):
        if key in body and body[key] != 1:
            return True
    prompt = body.get("prompt")
    return isinstance(prompt, list) and len(prompt) > 1 and not any(
        isinstance(x, int) for x in prompt)


def _take(parts: list[str], obj: JSON, key: str) -> None:
    """Append obj[key] to `parts` if it is a string (a text delta)."""
    value = obj.get(key)
    if isinstance(value, str):
        parts.append(value)


@dataclass
class _ToolCall:
    id: str | None = None
    name: list[str] = field(default_factory=list)
    arguments: list[str] = field(default_factory=list)

    def to_json(self) -> JSON:
        tc: JSON = {"type": "function", "function": {"name": "".join(self.name),
                                                     "arguments": "".join(self.arguments)}}
        if self.id:
            tc["id"] = self.id
        return tc


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: dict[int, _ToolCall] = field(default_factory=dict)
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None

    def add_logprobs(self, lp: Any) -> None:
        if isinstance(lp, dict) and isinstance(lp.get("content"), list):
            self.logprobs.extend(lp["content"])


class _OpenAI:
    """Shared by chat and text completions: top-level fields, usage, timings, choices."""

    object = ""

    def __init__(self) -> None:
        self.top: JSON = {}
        self.choices: dict[int, _Choice] = {}
        self.usage: Any = None
        self.timings: Any = None
        self.verbose: Any = None  # `__verbose` (asked for with `verbose`): the last one's
        self.done = False

    def add(self, obj: JSON) -> None:
        for key in (*_TOP, "id"):
            if key in obj:
                self.top[key] = obj[key]
        if "__verbose" in obj:
            self.verbose = obj["__verbose"]
        if "usage" in obj:
            self.usage = obj["usage"]
        if "timings" in obj:
            self.timings = obj["timings"]
        for ch in obj.get("choices") or ():
            if isinstance(ch, dict):
                index = ch.get("index", 0)
                c = self.choices.setdefault(index if isinstance(index, int) else 0,
                                            _Choice())
                self._add_choice(c, ch)
                if isinstance(ch.get("finish_reason"), str):
                    c.finish_reason = ch["finish_reason"]
                    self.done = True

    def _add_choice(self, c: _Choice, ch: JSON) -> None:
        raise NotImplementedError

    def _choice(self, index: int, c: _Choice) -> JSON:
        raise NotImplementedError

    def body(self) -> JSON | None:
        if not self.done:
            return None
        out: JSON = {"choices": [self._choice(i, c) for i, c in sorted(self.choices.items())]}
        out.update((k, self.top[k]) for k in _TOP if k in self.top)
        out["object"] = self.object
        if self.usage is not None:
            out["usage"] = self.usage
        if "id" in self.top:
            out["id"] = self.top["id"]
        if self.timings is not None:
            out["timings"] = self.timings
        if self.verbose is not None:
            out["__verbose"] = self.verbose
        return out


class ChatAssembler(_OpenAI):
    object = "chat.completion"

    def _add_choice(self, c: _Choice, ch: JSON) -> None:
        delta = ch.get("delta")
        if isinstance(delta, dict):
            _take(c.text, delta, "content")
            _take(c.reasoning, delta, "reasoning_content")
            for tc in delta.get("tool_calls") or ():
                if isinstance(tc, dict):
                    index = tc.get("index", 0)
                    call = c.tool_calls.setdefault(index if isinstance(index, int) else 0,
                                                   _ToolCall())
                    if isinstance(tc.get("id"), str):
                        call.id = tc["id"]
                    fn = tc.get("function")
                    if isinstance(fn, dict):
                        _take(call.name, fn, "name")
                        _take(call.arguments, fn, "arguments")
        c.add_logprobs(ch.get("logprobs"))

    def _choice(self, index: int, c: _Choice) -> JSON:
        msg: JSON = {"role": "assistant", "content": "".join(c.text)}
        if c.reasoning:
            msg["reasoning_content"] = "".join(c.reasoning)
        if c.tool_calls:
            msg["tool_calls"] = [t.to_json() for _, t in sorted(c.tool_calls.items())]
        out: JSON = {"finish_reason": c.finish_reason, "index": index, "message": msg}
        if c.logprobs:
            out["logprobs"] = {"content": c.logprobs}
        return out


class TextAssembler(_OpenAI):
    object = "text_completion"

    def _add_choice(self, c: _Choice, ch: JSON) -> None:
        _take(c.text, ch, "text")
        c.add_logprobs(ch.get("logprobs"))

    def _choice(self, index: int, c: _Choice) -> JSON:
        return {"text": "".join(c.text), "index": index,
                "logprobs": {"content": c.logprobs} if c.logprobs else None,
                "finish_reason": c.finish_reason}


class NativeAssembler:
    """llama.cpp `/completion`: the final chunk is the whole answer but for the text, the
    token ids and the probabilities, which came in the chunks before it."""

    def __init__(self, keep_tokens: bool = True) -> None:
        # streams always carry the ids; a non-streamed answer only with return_tokens
        self.keep_tokens = keep_tokens
        self.text: list[str] = []
        self.tokens: list[Any] = []
        self.probs: list[Any] = []
        self.final: JSON | None = None

    def add(self, obj: JSON) -> None:
        _take(self.text, obj, "content")
        if isinstance(obj.get("tokens"), list):
            self.tokens.extend(obj["tokens"])
        if isinstance(obj.get("completion_probabilities"), list):
            self.probs.extend(obj["completion_probabilities"])
        if obj.get("stop") is True:
            self.final = obj

    def body(self) -> JSON | None:
        if self.final is None:
            return None
        out = {**self.final, "content": "".join(self.text),
               "tokens": self.tokens if self.keep_tokens else []}
        if self.probs:
            out["completion_probabilities"] = self.probs
        settings = out.get("generation_settings")
        if isinstance(settings, dict) and "stream" in settings:
            out["generation_settings"] = {**settings, "stream": False}
        return out
