"""What a backend's answer says about its cache, read from responses and stream chunks.

llama-server reports reuse in two places (see shared notes): `timings.cache_n` (+
`prompt_n`, `prompt_ms`) on non-streaming bodies and on the last stream chunk, and
OpenAI `usage.prompt_tokens_details.cached_tokens` (streams: only with
`stream_options.include_usage`). `timings` wins when both are present: it is the
llama.cpp-native number and exists on every endpoint.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Outcome:
    """Everything the proxy learnt from one upstream exchange."""

    started: float                      # perf_counter() when send() began
    sent_at: float | None = None        # perf_counter() when it was written to the backend
    status: int = 0                     # upstream HTTP status (0: never answered)
    reported_cached: int | None = None  # prompt tokens the backend reused
    prompt_n: int | None = None         # prompt tokens it evaluated (uncached part)
    prompt_ms: float | None = None
    predicted_ms: float | None = None
    predicted_n: int | None = None      # tokens the backend generated (sampled)
    finish_reason: str | None = None
    reported_slot: int | None = None    # `id_slot` echoed by /completion
    first_token_at: float | None = None  # perf_counter() of the first generated text
    finished_at: float | None = None
    text: list[str] = field(default_factory=list)   # generated text, in order
    tokens: list[int] | None = None     # exact generated ids, when the backend gave them
    complete: bool = False              # the backend finished the answer normally
    errored: bool = False               # ... or its stream said why not (an error event)
    cancelled: bool = False             # the client left before the answer began
    on_first_token: Callable[[], None] | None = None  # called once, with the first text
    # Router.starts(backend) as the last bytes came; as the last read that brought
    # generated text came, and the read before it (see `starts_before_end`)
    starts_at_end: int | None = None
    # Router.unlaunched(backend) as the last bytes came (see Report.unlaunched_at_end)
    unlaunched_at_end: int = 0
    _starts_at_text: tuple[int | None, int | None] = (None, None)
    _text_seen: int = 0

    @property
    def ttft(self) -> float | None:
        """Seconds to the first generated token.

        Streams: measured. Non-streaming answers arrive whole, so it is the latency less
        the backend's generation time (queue + prompt processing + proxy overhead).
        """
        if self.first_token_at is not None:
            return self.first_token_at - self.started
        if self.finished_at is not None and self.predicted_ms is not None:
            return max(0.0, self.finished_at - self.started - self.predicted_ms / 1000)
        return None

    def read(self, starts: int, unlaunched: int = 0) -> None:
        """Bytes of the answer were read, ``starts`` tasks having started on its backend
        (in the model) so far, ``unlaunched`` of them not heard launched."""
        before, self.starts_at_end = self.starts_at_end, starts
        self.unlaunched_at_end = unlaunched
        if len(self.text) > self._text_seen:
            self._text_seen = len(self.text)
            self._starts_at_text = (before, starts)

    @property
    def starts_before_end(self) -> int | None:
        """Tasks started on the backend (in the model) by the last read of bytes the
        server sent before the step that ended this answer: a task started after it
        reached the server after that step began, and the server launched it after the
        request's slot was freed (its main loop takes new tasks between steps).

        A stream sends its head at launch, then a chunk per generated token: one that
        stopped at its length sent its last token in its last step (the read before
        that token's is the reference), one that stopped on an end-of-generation token
        or a stop word sent its last text a step before. Answers read whole (or without
        text) give the last read: starts after the end was read."""
        before_last, last = self._starts_at_text
        ref = before_last if self.finish_reason == "length" else last
        return ref if ref is not None else self.starts_at_end

    @property
    def output_text(self) -> str:
        return "".join(self.text)

    def absorb(self, obj: Any, *, final: bool = False) -> None:
        """Read one response body or stream chunk (OpenAI chat, completions, native)."""
        if not isinstance(obj, dict):
            return
        timings = obj.get("timings")
        if isinstance(timings, dict):
            self._absorb_timings(timings)
        reused, _ = reported_reuse(obj)
        if reused is not None and (self.reported_cached is None or timings is not None):
            self.reported_cached = reused
        slot = obj.get("id_slot")
        if _count(slot):
            self.reported_slot = slot
        had_text = len(self.text)
        self._absorb_text(obj)
        if len(self.text) > had_text and self.first_token_at is None and not final:
            self.first_token_at = time.perf_counter()
            if self.on_first_token is not None:
                self.on_first_token()

    def _absorb_timings(self, t: dict[str, Any]) -> None:
        # NOTE: only sane values: an external backend may send anything, and these feed
        # Prometheus counters (which refuse negatives) and the learned prefill rate
        if _count(t.get("prompt_n")):
            self.prompt_n = t["prompt_n"]
        if _duration(t.get("prompt_ms")):
            self.prompt_ms = float(t["prompt_ms"])
        if _count(t.get("predicted_n")):
            self.predicted_n = t["predicted_n"]
        if _duration(t.get("predicted_ms")):
            self.predicted_ms = float(t["predicted_ms"])

    def _absorb_text(self, obj: dict[str, Any]) -> None:
        # llama-native /completion: {"content", "tokens"} per chunk or whole.
        content = obj.get("content")
        if isinstance(content, str) and "choices" not in obj:
            if content:
                self.text.append(content)
            toks = obj.get("tokens")
            if isinstance(toks, list) and toks:
                self.tokens = (self.tokens or []) + [t for t in toks if _count(t)]
            return
        choices = obj.get("choices")
        if not isinstance(choices, list) or not choices:
            return
        choice = choices[0]  # n > 1 is not routed differently; index 0 is what the slot holds
        if not isinstance(choice, dict):
            return
        if isinstance(choice.get("finish_reason"), str):
            self.finish_reason = choice["finish_reason"]
        part = choice.get("delta") or choice.get("message")
        if isinstance(part, dict):
            # Reasoning precedes content in what the model generated.
            for key in ("reasoning_content", "content"):
                val = part.get(key)
                if isinstance(val, str) and val:
                    self.text.append(val)
        elif isinstance(choice.get("text"), str) and choice["text"]:
            self.text.append(choice["text"])


def reported_reuse(obj: object) -> tuple[int | None, int | None]:
    """(tokens reused, prompt tokens) as an answer or stream chunk reports them: llama.cpp's
    `timings` (cache_n, + prompt_n) when there, else OpenAI's `usage` (prompt_tokens and
    prompt_tokens_details.cached_tokens; reused None when a server does not say). Only
    sane counts: an external backend may send anything."""
    if not isinstance(obj, dict):
        return None, None
    t = obj.get("timings")
    if isinstance(t, dict) and _count(t.get("cache_n")):
        n = t.get("prompt_n")
        return t["cache_n"], t["cache_n"] + (n if _count(n) else 0)
    u = obj.get("usage")
    if isinstance(u, dict) and _count(u.get("prompt_tokens")):
        d = u.get("prompt_tokens_details")
        reused = d.get("cached_tokens") if isinstance(d, dict) else None
        return (reused if _count(reused) else None), u["prompt_tokens"]
    return None, None


def _count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**31


def _duration(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and 0 <= x < 1e9


def held_output(outcome: Outcome, tokenize: Callable[[str], Sequence[int]]) -> Sequence[int]:
    """The generated tokens the slot keeps after this answer, as far as they are known.

    The server caches every sampled token but the last (it is never decoded), so the slot
    holds prompt + generated[:-1]. /completion gives the ids (`return_tokens`). Chat and
    /v1/completions give text only: re-tokenized, it equals the sampled ids when the
    model sampled the canonical split, which the count check below confirms
    (`predicted_n` = sampled tokens, + 1 for the EOS when it stopped on one). Otherwise
    (non-canonical samples, stop words, parsed tool calls or reasoning) only the prompt is
    claimed: the next turn then reuses at least what was predicted.
    """
    if outcome.tokens is not None:
        return outcome.tokens[:-1]
    n = outcome.predicted_n
    if n is None or not outcome.text:
        return ()
    ids = tokenize(outcome.output_text)
    if outcome.finish_reason == "length" and len(ids) == n:
        return ids[:-1]
    if outcome.finish_reason == "stop" and len(ids) + 1 == n:
        return ids
    return ()

