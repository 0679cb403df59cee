"""The replicas' shared view over NATS (`replicas: {nats: URL}` in the config).

Every replica publishes, on one subject, what each of its requests left in its slot when
it ended (events.py), and applies the others' to its own model (`Router.observe`): a
conversation that one replica routed is found where it is by the next replica its client
reaches. Events are fire and forget: a replica that misses some (the broker was down, it
joined late) predicts those slots wrong until the backends' own reports, or the next
event for the slot, correct it. The broker being away never stops a replica: it routes
on its own view, says so (`connected: false` in /kvroute/status, a warning, a metric),
and publishes again once the client reconnects. NATS is the broker the peers' routers use
for the same job (Dynamo's KV router): plain subjects, no server state to manage.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import structlog

from proxy.replicas.events import Held, decode, encode

SUBJECT = "kvroute.held"
_QUEUE = 1024  # events waiting to be sent; past that the oldest are dropped
_RETRY_S = 2.0  # between connection attempts before the first one succeeds


class ReplicaBus:
    def __init__(self, url: str, replica: str, apply: Callable[[Held], bool],
                 counted: Callable[[str], None]) -> None:
        self.url, self.replica, self.apply, self.counted = url, replica, apply, counted
        self.log = structlog.get_logger()
        self.connected = False
        self._nc: Any = None
        self._queue: asyncio.Queue[bytes] = asyncio.Queue(_QUEUE)
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Connect (in the background until the broker answers) and start sending."""
        self._tasks = [asyncio.create_task(self._connect(), name="kvroute-replicas"),
                       asyncio.create_task(self._send(), name="kvroute-replicas-send")]

    def publish(self, pool: str, backend: str, slot: int, tokens: bytes) -> None:
        """A request of this replica's ended, leaving ``tokens`` in ``backend``'s ``slot``."""
        data = encode(Held(self.replica, pool, backend, slot, tokens))
        if self._queue.full():
            self._queue.get_nowait()
            self.counted("dropped")
        self._queue.put_nowait(data)

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.close()

    async def _connect(self) -> None:
        import nats

        while self._nc is None:
            try:
                self._nc = await nats.connect(
                    servers=[self.url], name=f"kvroute {self.replica}", connect_timeout=2,
                    allow_reconnect=True, max_reconnect_attempts=-1, reconnect_time_wait=1,
                    disconnected_cb=self._down, reconnected_cb=self._up,
                    error_cb=self._error)
            except Exception as e:  # (NoServersError, OSError, a timeout: not up yet)
                if not self.connected and self._nc is None:
                    self.log.warning("replicas.unreachable", url=self.url, error=str(e)[:200])
                await asyncio.sleep(_RETRY_S)
        await self._nc.subscribe(SUBJECT, cb=self._received)
        await self._up()

    async def _send(self) -> None:
        while True:
            data = await self._queue.get()
            if self._nc is None or not self.connected:
                self.counted("dropped")  # (no broker: the peers learn from the next one)
                continue
            try:
                await self._nc.publish(SUBJECT, data)
                self.counted("sent")
            except Exception as e:  # (disconnected meanwhile, its buffer full)
                self.counted("dropped")
                self.log.debug("replicas.publish_failed", error=str(e)[:200])

    async def _received(self, msg: Any) -> None:
        held = decode(msg.data)
        if held is None:
            self.counted("invalid")
            return
        if held.replica == self.replica:
            return  # (its own)
        self.counted("applied" if self.apply(held) else "ignored")

    async def _up(self) -> None:
        self.connected = True
        self.log.info("replicas.connected", url=self.url, replica=self.replica)

    async def _down(self) -> None:
        self.connected = False
        self.log.warning("replicas.disconnected", url=self.url,
                         consequence="routing on this replica's own view")

    async def _error(self, e: Exception) -> None:
        self.log.debug("replicas.error", error=str(e)[:200])
