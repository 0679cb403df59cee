"""What an `Attempt` (proxy/forwarding/attempt.py) is given: the client's request as
asked, a prompt routed on its head while its rest is tokenized, and what it uses of the
`Forwarder` that runs it and of the replicas' slot claims."""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web

from backends.info import BackendInfo
from proxy.disk.store import SlotStore
from proxy.errors import BadRequest, ProxyError
from proxy.forwarding.answer import JSON, Relay
from proxy.forwarding.health import BackendHealth
from proxy.forwarding.upstream import Upstream
from proxy.forwarding.waits import SlotWaits
from proxy.observability.tracing import Tracing
from proxy.prompt.media import LearnMedia
from proxy.reporting.recorder import Recorder
from proxy.routing.cache.lora import Lora
from proxy.routing.decision import NoBackend
from proxy.routing.routed import Routed
from proxy.routing.router import Router


@dataclass
class PendingPrompt:
    """A prompt routed on its head while its rest is tokenized (Tokenizing.prompt_ids).

    llama.cpp tokenizes ~4 KB/ms here: a coding agent's new tool result would hold the
    request that long before anything is sent, though nothing in it can be matched (no
    cache has seen it). So the request is decided on the head, sent at once, and the rest
    is tokenized while the backend prefills; `Router.extend` records the whole prompt as
    soon as it is known, at the latest before the answer's headers (which carry the
    prediction) are written."""

    head: array
    n_estimate: int            # the whole prompt's tokens, estimated (for the policy)
    n_bound: int               # ... at most (for the context-length check)
    rest: asyncio.Task[array | None]  # the whole prompt's ids; None if they failed


@dataclass(frozen=True)
class Asked:
    """The client's request, as each attempt forwards it."""

    request: web.Request
    endpoint: str
    path: str
    raw: bytes
    body: JSON
    relay: Relay
    hint: str | None  # the session it names (see session_hint)
    started: float  # perf_counter() when it came


class Contest(Protocol):
    """The claims of this replica's requests on their slots, against the other replicas'
    (proxy/replicas/claims.py `Claims`)."""

    async def hold(self, routed: Routed, prompt: Callable[[], Awaitable[bytes]]) -> bool:
        """False: a peer's request won the slot; it must move."""


class Forwarding(Protocol):
    """What an attempt uses of the `Forwarder` that runs it."""

    upstream: Upstream
    router: Router
    backends: Mapping[str, BackendInfo]
    recorder: Recorder
    health: BackendHealth | None
    first_byte_timeout: float | None
    tokenize_output: Callable[[str], Sequence[int]]
    tracing: Tracing
    waits: SlotWaits
    on_sent: Callable[[str, int, int, bytes, Lora | None], None] | None
    claims: Contest | None
    user_starts: Callable[[bytes], tuple[int, ...]] | None
    learn_media: LearnMedia | None
    forget_media: Callable[[Mapping[str, Any]], None] | None

    def serving(self, path: str, media: frozenset[str] = frozenset()
                ) -> frozenset[str] | None: ...

    def no_backend_error(self, nb: NoBackend) -> ProxyError: ...

    def slot_store(self, backend: str) -> SlotStore | None: ...


async def whole_prompt(pending: PendingPrompt) -> array:
    ids = await pending.rest
    if ids is None:
        raise BadRequest("prompt text is not valid Unicode")
    return ids
