"""Exact prompt ids for a request, computed on the event loop or beside it."""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from proxy.forwarding.forwarder import PendingPrompt
from proxy.prompt.builder import PromptBuilder
from proxy.prompt.chat_request import PromptError
from proxy.prompt.tokenizer import Plan

T = TypeVar("T")

# Bodies larger than this are rendered and tokenized on the worker thread (~1-4 ms of
# rendering; a 30k-token turn's body is ~200 KiB).
RENDER_INLINE_BYTES = 1 << 20
# A prompt is routed on its head (see PendingPrompt) when that head is at least this many
# tokens and the rest at most this many bytes per head token.
DEFER_MIN_HEAD = 256
DEFER_REST_BYTES_PER_HEAD = 4


class Tokenizing:
    """Exact prompt ids without stalling the loop, and without thread hops that cost more
    than they save.

    Measured (2 shared cores, demo vocabulary): llama_tokenize costs ~0.3-0.9 us per byte
    (a cold 30k-token prompt ~55 ms); a hop to the worker thread and back ~35 us on an
    idle loop, more under load; rendering the template ~1-4 us per KiB of body, and it
    holds the GIL wherever it runs. So the template is rendered and the prompt split and
    looked up in the fragment cache on the loop, and only text no cache holds goes to
    the single worker thread, when it is more than `inline_bytes` (llama_tokenize
    releases the GIL: that work really runs beside the loop). A turn whose history was
    seen thus never leaves the loop. Bodies over `RENDER_INLINE_BYTES` are built on the
    worker whole, so that one huge request leaves the loop slices of time (the GIL's
    switch interval) instead of none.

    The loop and the worker may tokenize at once: FragmentTokenizer locks its caches, and
    llama_tokenize is safe to call concurrently on one vocabulary (llama-server itself
    tokenizes on its HTTP threads). So a short prompt never waits behind a cold one.
    """

    def __init__(self, prompt: PromptBuilder | None, inline_bytes: int) -> None:
        self.prompt = prompt
        self.inline_bytes = inline_bytes
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvroute-tokenize")

    async def run(self, size: int, build: Callable[[], T]) -> T:
        """`build()` on the loop for a body of at most `inline_bytes`, else on the worker."""
        if size <= self.inline_bytes:
            return build()
        return await asyncio.get_running_loop().run_in_executor(self.pool, build)

    async def ids(self, size: int, plan: Callable[[], Plan]) -> array:
        """The ids of the prompt `plan()` renders and looks up (see the class doc)."""
        prompt = self.prompt
        assert prompt is not None
        loop = asyncio.get_running_loop()
        if size > RENDER_INLINE_BYTES:
            return await loop.run_in_executor(
                self.pool, lambda: prompt.finish(prompt.fetch(plan())))
        return await self._complete(plan())

    async def _complete(self, p: Plan) -> array:
        """Tokenize what `p` misses (on the worker when long) and assemble its ids."""
        prompt = self.prompt
        assert prompt is not None
        if p.missing_bytes > self.inline_bytes:
            await asyncio.get_running_loop().run_in_executor(self.pool, prompt.fetch, p)
        else:
            prompt.fetch(p)
        return prompt.finish(p)

    async def prompt_ids(self, size: int, plan: Callable[[], Plan]) -> array | PendingPrompt:
        """`ids`, or the prompt's head when only a short rest of it is new: see
        `PendingPrompt` (the rest is tokenized by a task, beside the send)."""
        prompt = self.prompt
        assert prompt is not None
        if size > RENDER_INLINE_BYTES:
            return await self.ids(size, plan)
        p = plan()
        got = prompt.head(p) if p.missing else None
        if got is not None:
            head, at = got
            rest = len(p.text[at:].encode("utf-8", "surrogatepass"))
            # NOTE: the head must be most of the prompt: a rest as long as it may be a
            # conversation the fragment cache forgot (the tree can still hold it), and
            # routing it on its head alone could miss the backend that has it
            if len(head) >= DEFER_MIN_HEAD and rest <= DEFER_REST_BYTES_PER_HEAD * len(head):
                # every token covers >= 1 byte; ~4 bytes a token in English text and code
                return PendingPrompt(head, len(head) + rest // 4 + 1, len(head) + rest + 1,
                                     asyncio.create_task(self._rest(p)))
        return await self._complete(p)

    async def _rest(self, p: Plan) -> array | None:
        try:
            # started when the handler first waits: after the request is written
            return await self._complete(p)
        except PromptError:
            return None

    def output_tokens(self, text: str) -> Sequence[int]:
        # Answers are short (and mostly cached fragments): inline.
        if self.prompt is None or not text:
            return ()
        return self.prompt.tokenizer.tokenize_ids(text, add_special=False)


