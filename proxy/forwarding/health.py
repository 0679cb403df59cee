"""Which backends requests may go to: supervisor-ready *and* not tripped by the proxy.

The Supervisor knows whether a process runs; only the proxy sees whether a backend
answers requests. Each backend has a circuit breaker:

    closed --request got no answer / N failed probes--> open --backoff--> half-open probe
      ^                                                   ^                     |
      +--------------------- /health 200 ----------------+---- probe fails -----+

- A request that got no answer at all (connection refused or reset, connect or
  first-byte timeout) opens the breaker at once: that is what a dead or hung backend
  looks like, and the request must be retried *elsewhere* (the Router has no per-request
  exclusion, so a tripped backend leaves the Router; its cache model is forgotten).
- Every `probe_interval_s` each routable backend's `/health` is probed with a short
  timeout (llama-server answers it from its HTTP threads, even while busy); after
  `breaker_failures` consecutive failures the breaker opens. This catches a backend
  that hangs while requests wait on it: they are cut (their `asyncio.timeout` is
  rescheduled to now) and rerouted, since nothing reached their clients yet.
- llama-server answers `/health` even when its main loop (the one that runs every slot)
  is stuck: completions then hang behind a 200 (after a CUDA error: upstream issue
  #13281). `/slots` is answered by that loop, between two batches. So while a backend
  has requests under way, its `/slots` is asked every STALL_PROBE_EVERY_S; unanswered
  within the stall bound (`stall_timeout_s`, or more on a backend whose batches are
  slow), the breaker opens as above and the answers already flowing are cut too (they
  end with an error event); it closes again only once `/slots` answers. Streams of a
  backend whose breaker /health (or a failed request) opened are watched the same way:
  they are cut only when /slots goes unanswered too.
- An open breaker is probed after a backoff (doubling when it re-trips soon after
  closing); one good probe closes it and the backend rejoins the Router fresh and empty
  (what it still holds is forgotten: under-predicting is the safe error). A good probe
  is /health 200 and, where the backend has /slots, a /slots answer with no slot still
  processing (the requests it ran when taken out: new ones would be pinned behind
  them); after REJOIN_WAIT_S out, /health alone will do, unless it was stuck.
- Supervisor events win: a restarted managed backend (cb(name, info)) is a new process,
  closed breaker, empty cache; cb(name, None) removes it whatever the breaker says.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from backends.client import BackendClient, BackendDown, BadResponse, Health
from backends.info import BackendInfo
from proxy.config.settings import HealthSettings
from proxy.forwarding.upstream import Response
from proxy.observability.metrics import ProxyMetrics
from proxy.routing.cache.checkpoints import Memory
from proxy.routing.cache.values import BackendCapacity
from proxy.routing.router import Router

CLOSED, OPEN = "closed", "open"

STALL_PROBE_EVERY_S = 5.0
# A busy main loop answers /slots after the batch it decodes: up to n_batch prompt tokens
# (llama-server's default -b). The stall bound allows STALL_BATCHES of them at the
# backend's learned prefill rate, so that a slow (CPU) backend is not called stuck.
N_BATCH = 2048
STALL_BATCHES = 3
# A backend back from a hang may still run what it ran when taken out: it rejoins once
# that is over, or after this long (a shared external backend may never be idle)
REJOIN_WAIT_S = 120.0


@dataclass
class Breaker:
    """One backend's breaker (mutable; owned by `BackendHealth`)."""

    info: BackendInfo
    state: str = CLOSED
    failures: int = 0                 # consecutive failed probes while closed
    backoff_s: float = 0.0
    retry_at: float = 0.0             # monotonic time of the next half-open probe
    closed_at: float = 0.0
    opened_at: float = 0.0
    last_error: str | None = None
    trips: int = 0
    # asyncio.timeout()s of requests still waiting for their first byte from it
    waiting: set[asyncio.Timeout] = field(default_factory=set)
    relaying: set[Response] = field(default_factory=set)  # answers flowing from it
    stall_probe: asyncio.Task[None] | None = None
    stall_checked_at: float = 0.0
    stalled: bool = False             # opened as stuck: closes on /slots, not /health
    rate: float | None = None         # its learned prefill rate, kept while it is out
    has_slots: bool = True            # False once it answered that it has no /slots


def capacity(info: BackendInfo) -> BackendCapacity:
    m = info.memory
    memory = Memory(n_swa=m.n_swa, recurrent=m.recurrent, swa_cells=m.swa_cells,
                    max_checkpoints=m.max_checkpoints, min_step=m.min_step,
                    n_ubatch=m.n_ubatch, n_batch=m.n_batch, partial_bytes=m.partial_bytes)
    return BackendCapacity(name=info.name, n_slots=info.n_slots, slot_ctx=info.slot_ctx,
                           ram_cache_bytes=info.ram_cache_bytes,
                           kv_bytes_per_token=info.kv_bytes_per_token, memory=memory,
                           lora=info.lora, alora=info.alora)


class BackendHealth:
    """Keeps `routable` (the app's live backend map) and the Router's membership in sync
    with supervisor events, request failures and probes."""

    def __init__(self, router: Router, routable: MutableMapping[str, BackendInfo],
                 metrics: ProxyMetrics, settings: HealthSettings, log: Any) -> None:
        self.router = router
        self.routable = routable
        self.metrics = metrics
        self.settings = settings
        self.log = log
        self.breakers: dict[str, Breaker] = {}
        self._now: Callable[[], float] = time.monotonic

    # ------------------------------------------------------------ supervisor events
    def backend_up(self, info: BackendInfo) -> None:
        """A (re)started backend: a fresh process with an empty cache."""
        old = self.breakers.get(info.name)
        if old is not None and old.stall_probe is not None:
            old.stall_probe.cancel()
        self._cut_waiting(old, "restarted")
        self.breakers[info.name] = Breaker(info, closed_at=self._now(),
                                           has_slots=info.dialect.has_slots)
        self._join(info)

    def backend_down(self, name: str) -> None:
        b = self.breakers.pop(name, None)
        if b is not None and b.stall_probe is not None:
            b.stall_probe.cancel()
        self._leave(name)
        self._cut_waiting(b, "went down")

    # -------------------------------------------------------------- request outcomes
    def failed(self, name: str, reason: str) -> None:
        """A request to `name` got no answer: open its breaker now."""
        b = self.breakers.get(name)
        if b is not None and b.state == CLOSED:
            self._trip(b, reason)

    @contextlib.contextmanager
    def waiting(self, name: str, timeout: asyncio.Timeout) -> Iterator[None]:
        """Register a request waiting for `name`'s first byte: a trip cuts it short."""
        b = self.breakers.get(name)
        if b is None or b.state != CLOSED:
            timeout.reschedule(asyncio.get_running_loop().time())
            yield
            return
        b.waiting.add(timeout)
        try:
            yield
        finally:
            b.waiting.discard(timeout)

    @contextlib.contextmanager
    def relaying(self, name: str, upstream: Response) -> Iterator[None]:
        """Register an answer being relayed from `name`: a stall cuts it."""
        b = self.breakers.get(name)
        if b is None:
            yield
            return
        b.relaying.add(upstream)
        try:
            yield
        finally:
            b.relaying.discard(upstream)

    def state(self, name: str) -> dict[str, object] | None:
        b = self.breakers.get(name)
        if b is None:
            return None
        return {"breaker": b.state, "failures": b.failures, "trips": b.trips,
                "last_error": b.last_error}

    # ---------------------------------------------------------------------- probing
    async def run(self, session: aiohttp.ClientSession) -> None:
        """Probe forever (cancelled with the app)."""
        s = self.settings
        timeout = s.probe_timeout_s
        try:
            while True:
                now = self._now()
                due = [b for b in self.breakers.values()
                       if b.state == CLOSED or now >= b.retry_at]
                if due:
                    await asyncio.gather(*(self._probe(session, b, timeout) for b in due))
                for b in self.breakers.values():
                    if self._stall_check_due(b):
                        b.stall_probe = asyncio.create_task(self._stall_probe(session, b))
                await asyncio.sleep(s.probe_interval_s)
        finally:
            for b in self.breakers.values():
                if b.stall_probe is not None:
                    b.stall_probe.cancel()

    async def _probe(self, session: aiohttp.ClientSession, b: Breaker,
                     timeout: float) -> None:
        info = b.info
        client = BackendClient(session, info.url, info.api_key, timeout=timeout)
        if info.dialect.has_health:
            got: object = await client.health()
            error = None if isinstance(got, Health) and got.ok else _failed("/health", got)
        else:  # a server of the OpenAI API only: up while it lists its models
            got = await client.models()
            error = None if isinstance(got, list) else _failed("/v1/models", got)
        if error is None and b.state == OPEN and b.has_slots:
            error = await self._not_yet(client, b)
        if self.breakers.get(info.name) is not b:
            return  # restarted or removed while the probe ran
        if error is None:
            b.failures = 0
            if b.state == OPEN:
                self._close(b)
            return
        b.last_error = error
        if b.state == OPEN:
            b.retry_at = self._now() + b.backoff_s
            b.backoff_s = min(b.backoff_s * 2, self.settings.open_backoff_max_s)
            return
        b.failures += 1
        if b.failures >= self.settings.breaker_failures:
            self._trip(b, f"{error} ({b.failures} probes in a row)")

    async def _not_yet(self, client: BackendClient, b: Breaker) -> str | None:
        """Why `b`, answering /health, may not rejoin yet (None: it may). It rejoins the
        model with idle slots: the requests it ran when taken out (a hang it recovered
        from) must be over (for at most REJOIN_WAIT_S), or new ones would be pinned
        behind them; and once stuck, its main loop must answer /slots again."""
        got = await client.slots()
        if _no_slots(got):
            b.has_slots = False
            return None
        waited_out = self._now() - b.opened_at >= REJOIN_WAIT_S
        if isinstance(got, list):
            busy = sum(s.is_processing for s in got)
            if busy and not waited_out:
                return f"{busy} slot(s) still busy with requests from before it was out"
            return None
        if waited_out and not b.stalled:
            return None
        return _failed("/slots", got) + (" (was stuck)" if b.stalled else "")

    def _stall_check_due(self, b: Breaker) -> bool:
        # (an open breaker's waiting requests were cut; its streams were not: a /health
        # that fails says nothing of them, an unanswered /slots does)
        under_way = b.waiting or b.relaying if b.state == CLOSED else b.relaying
        return (self.settings.stall_timeout_s > 0 and b.has_slots and bool(under_way)
                and (b.stall_probe is None or b.stall_probe.done())
                and self._now() - b.stall_checked_at
                >= min(STALL_PROBE_EVERY_S, self.settings.stall_timeout_s))

    async def _stall_probe(self, session: aiohttp.ClientSession, b: Breaker) -> None:
        b.stall_checked_at = self._now()
        # NOTE: the router forgets a backend the breaker took out: its rate is kept here,
        # or a slow backend's streams would be held to the bare stall_timeout_s
        b.rate = self.router.prefill_rate(b.info.name) or b.rate
        bound = self.settings.stall_timeout_s
        if b.rate:
            bound = max(bound, STALL_BATCHES * N_BATCH / b.rate)
        got = await BackendClient(session, b.info.url, b.info.api_key, timeout=bound).slots()
        if self.breakers.get(b.info.name) is not b:
            return
        if _no_slots(got):  # (an external backend run with --no-slots)
            b.has_slots = False
            self.log.info("backend.no_stall_check", backend=b.info.name)
        elif isinstance(got, BackendDown) and got.timed_out and (b.waiting or b.relaying):
            b.stalled = True
            if b.state == CLOSED:
                self._trip(b, f"stuck: /slots unanswered for {bound:.0f} s with requests "
                           "under way (its main loop does not run; /health may answer)")
            for upstream in list(b.relaying):
                upstream.cut(f"backend {b.info.name} is stuck")

    # -------------------------------------------------------------------- internals
    def _trip(self, b: Breaker, reason: str) -> None:
        s, now = self.settings, self._now()
        # NOTE: re-tripping soon after a probe closed it (alive but not serving) backs off
        recent = b.trips and now - b.closed_at < 30.0
        b.backoff_s = min(b.backoff_s * 2, s.open_backoff_max_s) if recent else s.open_backoff_s
        b.state, b.retry_at, b.last_error, b.opened_at = OPEN, now + b.backoff_s, reason, now
        b.trips += 1
        self.metrics.breaker_trips.labels(b.info.name).inc()
        self.log.warning("backend.breaker_open", backend=b.info.name, reason=reason,
                         retry_in_s=round(b.backoff_s, 2))
        self._leave(b.info.name)
        self._cut_waiting(b, reason)

    def _close(self, b: Breaker) -> None:
        b.state, b.failures, b.closed_at, b.stalled = CLOSED, 0, self._now(), False
        self.log.info("backend.breaker_closed", backend=b.info.name)
        self._join(b.info)

    def _join(self, info: BackendInfo) -> None:
        self.routable[info.name] = info
        self.router.add_backend(capacity(info))  # fresh: what it held is unknown
        self.metrics.backend_up.labels(info.name).set(1)

    def _leave(self, name: str) -> None:
        if self.routable.pop(name, None) is not None:
            self.router.remove_backend(name)
        self.metrics.backend_up.labels(name).set(0)

    @staticmethod
    def _cut_waiting(b: Breaker | None, why: str) -> None:
        if b is None or not b.waiting:
            return
        loop = asyncio.get_running_loop()
        for t in list(b.waiting):
            # one already expiring is about to raise anyway (several requests timing out
            # together: the first one's failure trips the breaker), and may not be moved
            if not t.expired():
                t.reschedule(loop.time())  # the waiting request raises TimeoutError: retry
        b.waiting.clear()


def _no_slots(got: object) -> bool:
    return isinstance(got, BadResponse) and got.status in (404, 501)


def _failed(path: str, got: object) -> str:
    if isinstance(got, BackendDown):
        return f"{path}: {got.reason}"
    return f"{path} answered {got.status}" if isinstance(got, BadResponse | Health) else path
