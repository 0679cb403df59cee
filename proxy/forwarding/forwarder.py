"""A pool's forwarder: routed requests with their retries elsewhere, unrouted calls.

`Forwarder.routed` is what every prefix-routed endpoint calls (chat, completions,
Anthropic messages): it runs one `Attempt` (proxy/forwarding/attempt.py: decide -> send
with id_slot -> feedback) per backend tried. `Forwarder.passthrough` forwards the rest as
it is. The Forwarder holds what every attempt shares: the router, the backends, their
health, the slot waits and the disk tier.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import aiohttp
from aiohttp import web

from backends.crash_loop import Unavailable
from backends.info import BackendInfo
from proxy.disk.store import SlotStore
from proxy.disk.tier import DiskTier
from proxy.errors import (
    BadRequest,
    NoBackendAvailable,
    ProxyError,
    UpstreamError,
    UpstreamTimeout,
)
from proxy.forwarding.answer import AS_IS, JSON, Relay
from proxy.forwarding.asked import Asked, Contest, PendingPrompt, whole_prompt
from proxy.forwarding.attempt import Attempt
from proxy.forwarding.health import BackendHealth
from proxy.forwarding.payload import with_own_name
from proxy.forwarding.send import Exchange, Target, send
from proxy.forwarding.upstream import Upstream
from proxy.forwarding.waits import BackendLeft, SlotWaits
from proxy.observability.tracing import Tracing
from proxy.prompt.builder import PromptBuilder
from proxy.prompt.delimiters import user_starts
from proxy.prompt.media import LearnMedia
from proxy.reporting.outcome import Outcome
from proxy.reporting.recorder import Recorder
from proxy.routing.cache.lora import Lora
from proxy.routing.decision import NoBackend
from proxy.routing.router import Router


def session_hint(request: web.Request, body: JSON) -> str | None:
    """A conversation/session id the client volunteers (ties broken per session)."""
    for name in ("X-Claude-Code-Session-Id", "X-Session-Id"):
        value = request.headers.get(name)
        if value:
            return _printable(value[:200])
    user = body.get("user")
    return _printable(user[:200]) if isinstance(user, str) and user else None


def _printable(value: str) -> str:
    # Header bytes arrive surrogate-escaped and JSON may hold lone surrogates: neither
    # encodes to UTF-8, which the policy hashes the hint with.
    if value.isascii():
        return value
    return value.encode("utf-8", "backslashreplace").decode("utf-8")


@dataclass(frozen=True)
class Services:
    """What a pool's forwarder is given by the app (the same for every pool): the client
    to the backends, the recorder, the session for /slots (None: not asked), the disk
    tier (None: off), tracing; and the retry and first-byte limits."""

    upstream: Upstream
    recorder: Recorder
    session: aiohttp.ClientSession | None = None
    disk: DiskTier | None = None
    tracing: Tracing | None = None
    max_attempts: int = 3
    first_byte_timeout: float | None = None
    log_prompts: bool = False


class Forwarder:
    """decide -> send with id_slot -> feedback: one routed request, start to finish.

    A request that got nothing back from its backend (refused, reset, timed out, or cut
    because the backend was found hung) is retried on another backend: the failed one's
    breaker is opened, which takes it out of the Router, so the next `decide` cannot pick
    it. At most `max_attempts` backends are tried; the client never sees the failures.
    """

    def __init__(self, services: Services, router: Router,
                 backends: Mapping[str, BackendInfo],
                 tokenize_output: Callable[[str], Sequence[int]],
                 health: BackendHealth | None = None, *,
                 prompt: PromptBuilder | None = None,
                 why_down: Callable[[], Unavailable | None] = lambda: None) -> None:
        upstream, recorder, session = services.upstream, services.recorder, services.session
        max_attempts, first_byte_timeout = services.max_attempts, services.first_byte_timeout
        log_prompts, disk, tracing = services.log_prompts, services.disk, services.tracing
        self.upstream = upstream
        self.router = router
        self.backends = backends        # live view of routable backends, kept by the app
        self.recorder = recorder
        self.health = health
        self.max_attempts = max_attempts
        self.first_byte_timeout = first_byte_timeout
        self.log_prompts = log_prompts
        self.tokenize_output = tokenize_output
        self.session = session  # for /slots (see `SlotWaits.free_when_idle`)
        self.disk = disk  # slots saved to disk (kv_disk), if on
        # OpenTelemetry spans, if on (proxy.otel)
        self.tracing = tracing if tracing is not None else Tracing()
        # told (backend, slot, request id, prompt) of each request sent to a slot, for
        # the other replicas (proxy/replicas/peers.py `Teller`), if any: they subscribe
        # once their bus is up, which needs the pools (and their forwarders) first
        self.on_sent: Callable[[str, int, int, bytes, Lora | None], None] | None = None
        # the claims of its requests on their slots, against the other replicas'
        # (proxy/replicas/claims.py), if any
        self.claims: Contest | None = None
        # where a chat prompt's user messages start, as the server finds them (its
        # template's message delimiters): it checkpoints there on sliding-window and
        # hybrid models; None when the template is not known here
        self.user_starts: Callable[[bytes], tuple[int, ...]] | None = None
        # learns an image size's positions from a server's count, and forgets them when
        # a count disagrees (PromptBuilder.learn_media, forget_media)
        self.learn_media: LearnMedia | None = None
        self.forget_media: Callable[[Mapping[str, Any]], None] | None = None
        if prompt is not None:  # (the pool tokenizes locally)
            self.user_starts = partial(user_starts, delimiters=prompt.message_delimiters)
            self.learn_media = prompt.learn_media
            self.forget_media = prompt.forget_media
        self.waits = SlotWaits(router, backends, recorder, first_byte_timeout, session)
        # why the pool's backends cannot serve, as their supervisor knows it (crash loops)
        self.why_down = why_down
        # the media kinds each backend seen ready took (kept while it is down)
        self._took: dict[str, frozenset[str]] = {}

    def unavailable(self, reason: str) -> NoBackendAvailable:
        """The 503 when no backend can take a request: ``reason``, and what keeps the
        pool's backends down (what died, the fix) when their supervisor knows."""
        why = self.why_down()
        if why is None:
            return NoBackendAvailable(reason, retry_after=1)
        return NoBackendAvailable(f"{reason}: {why.reason}", retry_after=why.retry_after)

    def no_backend_error(self, nb: NoBackend) -> ProxyError:
        """What the client is told when the router found no backend for its request: a
        400 for a prompt that is empty or too long for every backend, else the 503."""
        # NOTE: prompts too long for every *ready* backend are mostly rejected before
        # `decide` (`routed`: max_context counts tripped backends too, which may come back)
        if nb.kind in ("too_long", "empty"):
            return BadRequest(nb.reason, code="context_length_exceeded"
                              if nb.kind == "too_long" else "invalid_request_error")
        return self.unavailable(nb.reason)

    def slot_store(self, backend: str) -> SlotStore | None:
        """The disk tier's store of the directory ``backend`` reads (None: it has none)."""
        return None if self.disk is None else self.disk.of(backend)

    def max_context(self) -> int | None:
        """The largest slot context of any ready backend (tripped ones included)."""
        infos = (b.info for b in self.health.breakers.values()) if self.health else \
            self.backends.values()
        return max((i.slot_ctx for i in infos), default=None)

    def serving(self, path: str, media: frozenset[str] = frozenset()) -> frozenset[str] | None:
        """The backends that serve ``path`` (None: all): any but the OpenAI API's
        endpoints only on llama-servers; for a request carrying ``media`` (vision,
        audio, video: proxy/prompt/media.py), those whose projector takes it, if any
        (else any: its server then refuses it in its own words), or a 503 while the
        backends that took it are down."""
        ok = [n for n, b in self.backends.items() if b.dialect.serves(path)]
        if media:
            self._took.update((n, b.modalities) for n, b in self.backends.items())
            taking = [n for n in ok if media <= self.backends[n].modalities]
            if not taking and any(media <= took for took in self._took.values()):
                # (its backend is restarting: the others would refuse the media)
                raise self.unavailable(f"no backend that takes {', '.join(sorted(media))} "
                                       "input is ready")
            ok = taking or ok
        return None if len(ok) == len(self.backends) else frozenset(ok)

    def _room_for(self, n: int) -> str:
        """What to change so that an ``n``-token prompt fits: the next power of two that
        leaves at least 1024 tokens for the answer."""
        fit = 1 << (n + 1024 - 1).bit_length()
        if any(b.managed for b in self.backends.values()):
            return f"set ctx_per_slot: {fit} (tokens per slot) on the backends in config.yaml"
        return f"start the backends' llama-servers with {fit} tokens per slot (-c {fit} x -np)"

    async def routed(self, request: web.Request, *, endpoint: str, path: str, raw: bytes,
                     body: JSON, tokens: Sequence[int] | PendingPrompt,
                     relay: Relay = AS_IS) -> web.StreamResponse:
        """Route `tokens`, send `body` to `path` on the chosen backend, learn from it."""
        started = time.perf_counter()
        ctx = self.max_context()
        pending = tokens if isinstance(tokens, PendingPrompt) else None
        if pending is not None and ctx is not None and pending.n_bound >= ctx:
            pending, tokens = None, await whole_prompt(pending)  # may not fit: know it first
        if pending is None and ctx is not None and len(tokens) >= ctx:
            # NOTE: the server needs room for the prompt and one generated token
            raise BadRequest(f"prompt is {len(tokens)} tokens, more than any backend's "
                             f"context ({ctx} tokens per slot): shorten the conversation, "
                             f"or {self._room_for(len(tokens))}",
                             code="context_length_exceeded")
        hint = session_hint(request, body)
        if self.log_prompts:
            self.recorder.log.debug("prompt", endpoint=endpoint,
                                    prompt=raw[:65536].decode("utf-8", "replace"))
        asked = Asked(request, endpoint, path, raw, body, relay, hint, started)
        attempt = 1
        while True:
            try:
                return await Attempt(self, asked, tokens, pending).run()
            except (UpstreamError, UpstreamTimeout, BackendLeft) as e:
                # nothing reached the client: the backend is out (breaker), try another
                if attempt >= self.max_attempts or not self.backends:
                    raise
                attempt += 1
                self.recorder.retried(endpoint, e)
                if pending is not None:  # the next try is decided on the whole prompt
                    pending, tokens = None, await whole_prompt(pending)

    async def close(self) -> None:
        """Stop watching slots to free (the app is closing)."""
        await self.waits.close()

    async def passthrough(self, request: web.Request, path: str, info: BackendInfo,
                          raw: bytes, *, relay: Relay = AS_IS,
                          pick: Callable[[], BackendInfo] | None = None,
                          method: str = "POST") -> web.StreamResponse:
        """Forward an unrouted call (/tokenize, /props, ...) to `info` as it is; when it
        gets no answer and `pick` is given, once more to the backend `pick` returns."""
        for attempt in (1, 2):
            outcome = Outcome(started=time.perf_counter())
            try:
                payload = with_own_name(raw, info) if method == "POST" else raw
                return await send(Exchange(
                    self.upstream, request, Target(info), path, payload, outcome, relay=relay,
                    method=method, health=self.health,
                    first_byte_timeout=self.first_byte_timeout))
            except (UpstreamError, UpstreamTimeout) as e:
                if self.health is not None:
                    self.health.failed(info.name, e.message)
                if attempt == 2 or pick is None or not self.backends:
                    raise
                self.recorder.retried("passthrough", e)
                info = pick()
        raise AssertionError("unreachable")
