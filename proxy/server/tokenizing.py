"""Exact prompt ids for a request, computed on the event loop or beside it."""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from backends.info import BackendInfo
from proxy.errors import BadRequest, NoBackendAvailable, ProxyError
from proxy.forwarding.asked import PendingPrompt
from proxy.observability.logging import get_logger
from proxy.prompt.builder import PromptBuilder
from proxy.prompt.chat_request import PromptError
from proxy.prompt.tokenizer import Plan
from proxy.server.backend_tokens import (
    CONTINUATION,
    CONTINUATION_PROBE,
    INEXACT,
    NO_TOKENIZER,
    RENDER_FAILED,
    BackendTokens,
    Mismatch,
    NoBackendIds,
    continues,
)

T = TypeVar("T")

# Bodies larger than this are rendered and tokenized on the worker thread (~1-4 ms of
# rendering; a 30k-token turn's body is ~200 KiB).
RENDER_INLINE_BYTES = 1 << 20
# A prompt is routed on its head (see PendingPrompt) when that head is at least this many
# tokens and the rest at most this many bytes per head token.
DEFER_MIN_HEAD = 256
DEFER_REST_BYTES_PER_HEAD = 4


def _refused(e: PromptError) -> ProxyError:
    """What llama-server answers for a prompt it cannot build: a 400, or a 500 (a
    template failing under a specialized handler)."""
    return BadRequest(str(e)) if e.status < 500 else ProxyError(str(e))


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

    def __init__(self, prompt: PromptBuilder | None, inline_bytes: int,
                 remote: BackendTokens | None = None) -> None:
        self.prompt = prompt
        self.inline_bytes = inline_bytes
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvroute-tokenize")
        # the backends' own ids, where the local ones cannot be had or are not exact
        self.remote = remote
        self.inexact: Mismatch | None = None  # the local template renders differently
        self.continuation: Mismatch | None = None  # ... a continued final message only
        self._checked: set[str] = set()  # backend URLs compared with the local template
        self.verified: set[str] = set()  # ... and found to render it alike

    @property
    def source(self) -> str:
        """Where chat prompt ids come from: "local" or "backend" (and why)."""
        if self.prompt is None:
            return f"backend ({NO_TOKENIZER})"
        if self.inexact:
            return f"backend ({INEXACT}: {self.inexact})"
        return "local" + (f" (backend for {CONTINUATION}s: {self.continuation})"
                          if self.continuation else "")

    async def chat(self, size: int, body: dict[str, Any], plan: Callable[[], Plan] | None,
                   *, head: bool = False, raw: bytes | None = None) -> array | PendingPrompt:
        """Exact ids of a chat body: local (`prompt_ids` when ``head``, else `ids`), or a
        backend's when there is no local tokenizer, the local template is not exact, or
        the local renderer fails on what the backend may render (``raw``: the client's
        bytes ``body`` was parsed from, sent to it as they are). A request the backend
        refuses gets its status and message; `NoBackendIds` when no backend can say."""
        if plan is None:
            return await self._remote().chat(body, NO_TOKENIZER, raw=raw)
        if self.inexact is not None:
            return await self._remote().chat(body, INEXACT, self._tokenize, raw)
        if self.continuation is not None and continues(body):
            return await self._remote().chat(body, CONTINUATION, self._tokenize, raw)
        try:
            return await (self.prompt_ids(size, plan) if head else self.ids(size, plan))
        except PromptError as e:
            if self.remote is None:
                raise _refused(e) from None
            try:
                return await self.remote.chat(body, RENDER_FAILED, self._tokenize, raw)
            except NoBackendAvailable:
                raise _refused(e) from None
            except ProxyError:
                # refused there too: a client error named here is the clearer answer (the
                # server may call a null field its own 500); else the server's words
                if e.status < 500:
                    raise _refused(e) from None
                raise
        except Exception as e:
            # not a refusal the server shares: a limit of this renderer (RecursionError
            # on a tool schema nested deeper than Python's stack), or a fault in it
            get_logger().warning("tokens.render_failed", error=f"{type(e).__name__}: {e}"[:300])
            return await self._remote().chat(body, RENDER_FAILED, self._tokenize, raw)

    async def _tokenize(self, text: str) -> array:
        # (the text the backend rendered, in this GGUF's vocabulary, fragment-cached; a
        # long one the cache misses on the worker, as the local path does)
        prompt = self.prompt
        assert prompt is not None
        return await self.run(len(text), lambda: prompt.tokenizer.tokenize_ids(text))

    def _remote(self) -> BackendTokens:
        if self.remote is None:
            raise NoBackendIds("no backend to tokenize with yet", retry_after=1)
        return self.remote

    async def check(self, info: BackendInfo) -> None:
        """Compare the local template with ``info``'s once; a difference switches chat
        prompts to backend ids (see `source`)."""
        if self.prompt is None or self.remote is None or self.inexact is not None \
                or info.url in self._checked:
            return
        self._checked.add(info.url)
        try:
            got = await self.remote.check(self.prompt, info)
            cont = await self.remote.check(self.prompt, info, (CONTINUATION_PROBE,))
        except Exception as e:  # a probe the local renderer chokes on: say so, keep going
            get_logger().warning("tokens.check_failed", backend=info.name, error=repr(e))
            return
        if cont is not None and self.continuation is None:
            self.continuation = cont
            get_logger().info("tokens.continuation_inexact", backend=info.name,
                              difference=str(cont), now="continued final messages are "
                              "rendered by the backends")
        if got is None:
            self.verified.add(info.url)
        else:
            self.inexact = got
            get_logger().warning("tokens.inexact", backend=info.name, difference=str(got),
                                 now="chat prompt ids come from the backends")

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


