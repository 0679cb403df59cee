"""Admission control: at most `max_in_flight` requests served at once, `max_queue` waiting.

Every request the proxy holds costs memory (its body, its token ids, a stream buffer),
and llama-server queues without bound itself, so the bound lives here: past it the
client gets 429 with `Retry-After` (in its API's format) at once, instead of a proxy that
grows until it falls over. Waiting requests are admitted first come, first served; one
that waits longer than `queue_timeout_s` is refused the same way.

Admission happens before the body is read, so queued requests hold no body in memory.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass


@dataclass(frozen=True)
class Admitted:
    """The request may go ahead; `release()` the admission when it is done."""


@dataclass(frozen=True)
class Refused:
    """No capacity: the reason is shown to the client, `retry_after_s` in the header."""

    reason: str
    retry_after_s: float


ADMITTED = Admitted()


class Admission:
    def __init__(self, max_in_flight: int, max_queue: int, queue_timeout_s: float,
                 retry_after_s: float = 1.0) -> None:
        self.max_in_flight = max_in_flight
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.retry_after_s = retry_after_s
        self.in_flight = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> Admitted | Refused:
        if self.in_flight < self.max_in_flight and not self._waiters:
            self.in_flight += 1
            return ADMITTED
        if len(self._waiters) >= self.max_queue:
            return Refused(f"too many requests: {self.in_flight} in flight and "
                           f"{len(self._waiters)} queued", self.retry_after_s)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.queue_timeout_s)
        except TimeoutError:
            if not fut.done():
                self._waiters.remove(fut)
                fut.cancel()
                return Refused(f"queued for {self.queue_timeout_s:g} s without a free "
                               "place", self.retry_after_s)
        except asyncio.CancelledError:
            # the client left while queued: give a place handed to us to the next one
            if fut.done() and not fut.cancelled():
                self.release()
            elif fut in self._waiters:
                self._waiters.remove(fut)
            raise
        return ADMITTED  # release() handed its place over: in_flight already counts us

    def release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the place passes to the oldest waiter
                return
        self.in_flight -= 1
