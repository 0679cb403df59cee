"""The replicas' shared view over NATS (`replicas: {nats: URL}` in the config).

Every replica publishes, on one subject, what its requests do to the backends' slots
(events.py: a request's start with its prompt, its first token, its end with what its
slot kept), and applies the others' to its own model (peers.py): a conversation one
replica routed is found where it is by the next replica its client reaches, and a slot
busy with another replica's request is busy here too. Each says `alive` every second,
naming its requests in flight (the others end those whose end they missed); one that
joins (or comes back after losing the broker) says `hello` and tells its requests in
flight again; the others send it theirs and what their slots hold, on a subject of its
own and a path of their own (a large view and the live events do not crowd each other
out). One that reads a start relative to a base it lacks asks to `resync`: the others
send it their requests in flight only. An event larger than the broker takes in one
message goes in parts (parts.py).

Events are fire and forget. A replica that misses some predicts those slots wrong until
the backends' own reports, or the next event for the slot, correct it. The broker being
away never stops a replica: it routes on its own view, says so (`connected: false` in
/kvroute/status, a warning, a metric), ends the others' requests in its model (their
ends cannot come), and rebuilds from the others' snapshots once the client reconnects.
NATS is the broker the peers' routers use for the same job (Dynamo's KV router): plain
subjects, request-reply inboxes, no server state to manage.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import structlog

from proxy.replicas.bases import Bases
from proxy.replicas.events import Event, Kind, decode, encode
from proxy.replicas.parts import Assembler, is_part, split
from proxy.replicas.peers import BYE, PeerView, Teller

SUBJECT = "kvroute.events"
LIVE_QUEUE = 1024  # live events waiting to be sent; past that the oldest are dropped
# replicas waiting for this one's view (its own path: a large view neither drops live
# events nor is dropped by them); past that the oldest get none
_SNAPSHOTS = 64
_RETRY_S = 2.0  # between connection attempts before the first one succeeds
ALIVE_S = 1.0
RESYNC_S = 5.0  # at least between two resyncs asked for unreadable starts
_PING_S = 2


def snapshot_subject(replica: str) -> str:
    """Where a joining ``replica`` is sent the others' view (NATS subject tokens
    cannot hold every character a replica's name may)."""
    return f"kvroute.snapshot.{hashlib.sha256(replica.encode()).hexdigest()[:20]}"


class ReplicaBus:
    def __init__(self, url: str, replica: str, view: PeerView,
                 counted: Callable[[str], None]) -> None:
        self.url, self.replica, self.view, self.counted = url, replica, view, counted
        self.log = structlog.get_logger()
        self.connected = False
        self._closing = False
        self._nc: Any = None
        # encoded by the sender, not on the request's path
        self._queue: asyncio.Queue[Event] = asyncio.Queue(LIVE_QUEUE)
        # held by each live publish, and by a view's requests in flight as they go out
        self._publishing = asyncio.Lock()
        # their subjects, and whether they want the whole view (else the requests in
        # flight only)
        self._joiners: asyncio.Queue[tuple[str, bool]] = asyncio.Queue(_SNAPSHOTS)
        self._tasks: list[asyncio.Task[None]] = []
        self.tellers: list[Teller] = []  # one per pool: their `alive` goes out each second
        self.bases = Bases()  # (the starts' prompts, told and read on the live path)
        self._resynced = -RESYNC_S  # when it last asked to resync (an unreadable start)
        self._parts = Assembler(counted)  # peers' events larger than the broker's limit

    async def start(self) -> None:
        """Connect (in the background until the broker answers) and start sending."""
        self._tasks = [asyncio.create_task(self._connect(), name="kvroute-replicas"),
                       asyncio.create_task(self._send(), name="kvroute-replicas-send"),
                       asyncio.create_task(self._send_views(), name="kvroute-replicas-views"),
                       asyncio.create_task(self._alive(), name="kvroute-replicas-alive")]

    def publish(self, event: Event) -> None:
        """Send ``event`` (in order, in the background)."""
        if self._queue.full():
            self._queue.get_nowait()
            self.counted("dropped")
        self._queue.put_nowait(event)

    async def close(self) -> None:
        self._closing = True
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        nc = self._nc  # (read once connecting cannot finish any more)
        if nc is not None and self.connected:
            with contextlib.suppress(Exception):  # (said as it leaves: best effort)
                await nc.publish(SUBJECT, encode(Event(self.replica, Kind.BYE)))
                await asyncio.wait_for(nc.flush(), 1.0)
        if nc is not None:
            with contextlib.suppress(Exception):
                await nc.close()

    async def _connect(self) -> None:
        import nats

        while self._nc is None:
            try:
                self._nc = await nats.connect(
                    servers=[self.url], name=f"kvroute {self.replica}", connect_timeout=2,
                    allow_reconnect=True, max_reconnect_attempts=-1, reconnect_time_wait=1,
                    no_echo=True,  # (its own events are not sent back to it to decode)
                    # a broker frozen or cut off is noticed in seconds, not minutes
                    ping_interval=_PING_S, max_outstanding_pings=2,
                    disconnected_cb=self._down, reconnected_cb=self._up,
                    error_cb=self._error)
            except Exception as e:  # (NoServersError, OSError, a timeout: not up yet)
                if not self.connected and self._nc is None:
                    self.log.warning("replicas.unreachable", url=self.url, error=str(e)[:200])
                await asyncio.sleep(_RETRY_S)
        await self._nc.subscribe(SUBJECT, cb=self._received)
        await self._nc.subscribe(snapshot_subject(self.replica), cb=self._received)
        await self._up()

    async def _send(self) -> None:
        while True:
            event = await self._queue.get()
            async with self._publishing:
                # (shortened in this epoch: a hello read while it goes out is one whose
                # replica may not get it)
                epoch = self.bases.epoch
                sent = await self._publish(SUBJECT, event, shorten=True)
            if sent and event.kind in (Kind.START, Kind.END):
                try:
                    (self.bases.told if event.kind == Kind.START else self.bases.ended)(
                        event, epoch=epoch)
                except Exception:  # (a fault here must not stop the live events)
                    self.log.exception("replicas.told_failed")

    async def _send_views(self) -> None:
        """Answer each replica that said hello with this one's view, made as it goes
        out (so what it says holds then): the requests in flight here (their ends are
        read against their starts), then what the idle slots hold; one that asked to
        resync, with the requests in flight only (what the slots hold, it has)."""
        while True:
            subject, whole = await self._joiners.get()
            try:
                # (held throughout: an end or first sent meanwhile on the live path would
                # overtake its start, as a publish awaits a flush past the client's limit)
                async with self._publishing:
                    for event in [e for t in self.tellers for e in t.in_flight()]:
                        await self._publish(subject, event)
                for i, event in enumerate(self.view.snapshot() if whole else ()):
                    await self._publish(subject, event)
                    if i % 16 == 0:
                        await asyncio.sleep(0)  # (a large view: live events go out meanwhile)
            except Exception:  # (a fault here must not stop the next views)
                self.log.exception("replicas.view_failed")

    async def _publish(self, subject: str, event: Event, shorten: bool = False) -> bool:
        """Send ``event`` on ``subject`` (``shorten``: a start as what it adds to a base,
        bases.py); False if it could not go."""
        if self._nc is None or not self.connected:
            self.counted("dropped")  # (no broker: the peers learn from the next one)
            return False
        parts = split(encode(self.bases.shorten(event) if shorten else event),
                      self._nc.max_payload)
        if not parts:
            self.counted("dropped")  # (larger than a peer reads)
            return False
        try:
            for part in parts:
                await self._nc.publish(subject, part)
        except Exception as e:  # (disconnected meanwhile, its buffer full)
            self.counted("dropped")
            self.log.debug("replicas.publish_failed", error=str(e)[:200])
            return False
        self.counted("sent")
        return True

    async def _alive(self) -> None:
        while True:
            await asyncio.sleep(ALIVE_S)
            try:
                if self.connected:
                    for teller in self.tellers:
                        self.publish(teller.alive())
                self.view.expire(time.monotonic())
                self._parts.expire(time.monotonic())
            except Exception:  # (a fault here must not stop the replica saying so)
                self.log.exception("replicas.alive_failed")

    async def _received(self, msg: Any) -> None:
        try:
            data = msg.data
            if is_part(data) and (data := self._parts.add(
                    msg.subject, data, time.monotonic())) is None:
                return  # (more to come, or lost)
            self._apply(data, msg.subject == SUBJECT)
        except Exception:  # (the client's callback: an error there would go unseen)
            self.counted("invalid")
            self.log.exception("replicas.event_failed")

    def _apply(self, data: bytes, live: bool = True) -> None:
        """Apply a peer's event; ``live``: sent to every replica (not only this one,
        joining)."""
        e = decode(data)
        if e is None:
            self.counted("invalid")
            return
        if e.replica == self.replica:
            return  # (another process under this one's name, or one's own echoed)
        if e.kind == Kind.START:
            whole = self.bases.whole(e)
            if whole is None:
                self._unreadable(e)
                return
            if self.view.routes(e):  # (any routed slot: another may name it as a base)
                self.bases.told(whole, everyone=live)
            e = whole
        elif e.kind == Kind.END and self.view.routes(e):
            self.bases.ended(e, everyone=live)
        now = time.monotonic()
        if e.kind == Kind.BYE:
            self.view.left(e.replica, now, BYE)
            return
        self.view.heard(e.replica, now)
        if e.kind in (Kind.HELLO, Kind.RESYNC):
            self.bases.unsure()  # (it holds none of them, or not all)
            if self._joiners.full():
                self._joiners.get_nowait()
                self.counted("dropped")
            self._joiners.put_nowait((snapshot_subject(e.replica), e.kind == Kind.HELLO))
            return
        applied = self.view.apply(e, now)
        if e.kind != Kind.ALIVE or applied:  # (an `alive` that ended nothing: no news)
            self.counted("applied" if applied else "ignored")
        self.log.debug("replicas.event", replica=self.replica, peer=e.replica,
                       kind=e.kind.value, backend=e.backend, slot=e.slot,
                       request=e.request, tokens=len(e.tokens) // 4, keep=e.keep,
                       applied=applied)

    def _unreadable(self, e: Event) -> None:
        """A start relative to a base this replica lacks (it missed an event, or did not
        keep that slot's): it asks to resync, at most every RESYNC_S, and the peers
        send it their requests in flight, then starts whole (else each next start of
        that conversation would be unreadable here too). One whose base is in a slot
        not routed here (whose bases are not kept) cannot be read after a resync either."""
        if not self.view.routes(e) or (e.base_from is not None and not self.view.routes(
                replace(e, backend=e.base_from[0], slot=e.base_from[1]))):
            return
        self.counted("unreadable")
        now = time.monotonic()
        if now - self._resynced >= RESYNC_S:
            self._resynced = now
            self.publish(Event(self.replica, Kind.RESYNC))

    async def _up(self) -> None:
        self.connected = True
        self.bases.unsure()  # (the peers may have missed some, or be new)
        self.log.info("replicas.connected", url=self.url, replica=self.replica)
        self.publish(Event(self.replica, Kind.HELLO))
        for teller in self.tellers:  # (those started while the broker was away were lost)
            for e in teller.in_flight():
                self.publish(e)

    async def _down(self) -> None:
        if self._closing:
            self.connected = False
            return
        if self.connected:
            self.view.lost(time.monotonic())
        self.connected = False
        self.log.warning("replicas.disconnected", url=self.url,
                         consequence="routing on this replica's own view")

    async def _error(self, e: Exception) -> None:
        self.log.debug("replicas.error", error=str(e)[:200])
