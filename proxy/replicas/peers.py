"""Both directions of the replicas' shared view, without the broker (bus.py carries it).

`Teller`: what this replica's requests do to their slots, as events for the others (the
router's `SlotListener`, and the forwarder's word when a request is sent). An answer's
end names how many tokens of the prompt its slot kept and sends only the rest: every
peer has the prompt from the start.

`PeerView`: the others' events applied to this replica's routers (a start also to the
claims held here, claims.py; a peer's claim that moved is withdrawn). A peer's request
keeps its slot busy and loads its backend here until its end comes; the end settles
what the slot holds. A peer not heard for `PEER_TIMEOUT_S` (gone, or cut off), a
request whose end never comes, and every peer's requests when the broker is lost, end
as an interrupted request does: the slot keeps the prompt (the server keeps what it
prefilled). A replica that joins is sent the requests in flight (`Teller.in_flight`:
their ends are read against their starts) and every idle slot's content (`snapshot`),
with when it last changed: what it knows of a slot since then stands.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import structlog

from proxy.replicas.events import MAX_LIVE, MAX_TOKENS, Event, Kind
from proxy.routing.cache.lora import Lora
from proxy.routing.decision import Handoff, Report
from proxy.routing.routed import Routed
from proxy.routing.router import Router
from proxy.routing.tree.token_bytes import common_len

PEER_TIMEOUT_S = 6.0  # a peer silent this long is gone (it says `alive` every second)
REQUEST_TIMEOUT_S = 900.0  # a peer's request not ended by then: its end was lost
BYE = "said bye"
_TOLD_MAX = MAX_LIVE  # peers' requests in flight remembered (a bound, not a target)
_TOLD_BYTES = 256 << 20  # and their prompts' bytes


@dataclass
class _Sent:
    """One of this replica's requests in flight, as its start told it."""

    backend: str
    slot: int
    prompt: bytes
    prefilled: bool = False
    claim: bool = False  # told as a claim (with its time), not yet as sent
    lora: Lora | None = None  # the LoRA adapters it names


class Teller:
    """This replica's requests in one pool, told to the others through ``send``."""

    def __init__(self, replica: str, pool: str, send: Callable[[Event], None],
                 touched: Callable[[str, str, int], None]) -> None:
        self.replica, self.pool, self.send, self.touched = replica, pool, send, touched
        self._sent: OrderedDict[int, _Sent] = OrderedDict()  # started, not yet ended

    def started(self, backend: str, slot: int, request: int, prompt: bytes,
                lora: Lora | None = None) -> None:
        """``request`` is sent (or about to be) to ``backend``'s ``slot`` with ``prompt``.
        Told again if it was told as a claim: a replica of a version that knows no
        claims drops a start with a claim's time, and would miss it."""
        self.touched(self.pool, backend, slot)
        told = self._sent.get(request)
        if told is not None and not told.claim and (told.backend, told.slot, told.prompt) \
                == (backend, slot, prompt):
            return  # (told already)
        self._tell(_Sent(backend, slot, prompt, lora=lora), request, 0.0)

    def claimed(self, backend: str, slot: int, request: int, prompt: bytes,
                at: float, lora: Lora | None = None) -> None:
        """``request`` claims ``backend``'s ``slot`` as of ``at`` (claims.py), and is
        sent there unless it moves. Its slot changes only once it is sent (`started`)."""
        self._tell(_Sent(backend, slot, prompt, claim=True, lora=lora), request, at)

    def _tell(self, sent: _Sent, request: int, at: float) -> None:
        self._sent[request] = sent
        if len(self._sent) > MAX_LIVE:
            self._sent.popitem(last=False)
        self.send(Event(self.replica, Kind.START, self.pool, sent.backend, sent.slot,
                        request, sent.prompt, at=at, lora=sent.lora))

    def withdrawn(self, backend: str, request: int) -> None:
        """``request`` was not sent where its claim said: it moves (its start is void)."""
        if (sent := self._sent.pop(request, None)) is not None:
            self.send(Event(self.replica, Kind.MOVED, self.pool, backend, sent.slot, request))

    def alive(self) -> Event:
        """Said every second: this replica's requests in flight in the pool."""
        return Event(self.replica, Kind.ALIVE, self.pool,
                     live=tuple(self._sent)[-MAX_LIVE:])

    def in_flight(self) -> list[Event]:
        """This replica's requests in flight, told again (their start, and their first
        token if it came) to a replica that joins or comes back: their ends are read
        against their starts."""
        out = []
        for request, s in self._sent.items():
            out.append(Event(self.replica, Kind.START, self.pool, s.backend, s.slot,
                             request, s.prompt, lora=s.lora))
            if s.prefilled:
                out.append(Event(self.replica, Kind.FIRST, self.pool, s.backend, s.slot,
                                 request))
        return out

    def prefilled(self, backend: str, request: int) -> None:
        if (sent := self._sent.get(request)) is not None:
            sent.prefilled = True
            self.send(Event(self.replica, Kind.FIRST, self.pool, backend, sent.slot, request))

    def freed(self, backend: str, slot: int, request: int, held: bytes | None) -> None:
        self.touched(self.pool, backend, slot)
        prompt = None if (sent := self._sent.pop(request, None)) is None else sent.prompt
        if prompt is None and held is None:
            return  # (the others never heard of it, and there is nothing to tell)
        keep = 0 if prompt is None or held is None else common_len(prompt, held, 0)
        rest = b"" if held is None else held[4 * keep:]
        self.send(Event(self.replica, Kind.END, self.pool, backend, slot, request, rest, keep))


@dataclass
class _Told:
    """A peer's request, as its start said, placed in this model."""

    pool: str
    backend: str
    slot: int
    prompt: bytes
    decision: Routed
    at: float
    prefilled: bool = False


@dataclass(frozen=True)
class PoolPort:
    """What the view drives in one pool: its router, the forwarder's hand-offs of
    requests waiting for a slot that a peer's request freed, and the claims held here
    (claims.py) that a peer's start may beat."""

    router: Router
    hand_off: Callable[[list[Handoff]], None]
    heard_start: Callable[[Event], None] = lambda e: None


_Key = tuple[str, str, int]  # (peer, pool, its id of the request)


class PeerView:
    def __init__(self, replica: str, pools: Mapping[str, PoolPort],
                 clock: Callable[[], float] = time.time) -> None:
        self.replica, self.pools, self.clock = replica, pools, clock
        self.log = structlog.get_logger()
        self._seen: dict[str, float] = {}  # peer -> when last heard
        self._told: OrderedDict[_Key, _Told] = OrderedDict()
        self._told_bytes = 0
        # (pool, backend, slot) -> when its content last changed, as far as this replica
        # knows (the wall clock: snapshots compare it across hosts)
        self._changed: dict[tuple[str, str, int], float] = {}

    def touched(self, pool: str, backend: str, slot: int) -> None:
        """A request here or a peer's started in or left that slot."""
        self._changed[pool, backend, slot] = self.clock()

    @property
    def peers(self) -> list[str]:
        return sorted(self._seen)

    @property
    def in_flight(self) -> int:
        """Peers' requests in this replica's model (in their slot, or waiting for it)."""
        return len(self._told)

    def routes(self, e: Event) -> bool:
        """Is the slot ``e`` names in this replica's model?"""
        port = self.pools.get(e.pool)
        return port is not None and port.router.peers.routes_slot(e.backend, e.slot)

    def heard(self, peer: str, now: float) -> None:
        joined = peer not in self._seen
        self._seen[peer] = now
        if joined:
            self.log.info("replicas.peer_joined", peer=peer)
            self._spread()

    def _spread(self) -> None:
        """Each replica takes the empty slots of a backend in an order of its own (its
        rank among the replicas it knows: see Router.spread)."""
        names = sorted({self.replica, *self._seen})
        for port in self.pools.values():
            port.router.spread(names.index(self.replica), len(names))

    def apply(self, e: Event, now: float) -> bool:
        """Apply a peer's event; False when it changes nothing here."""
        port = self.pools.get(e.pool)
        if port is None:
            return False
        if e.kind == Kind.ALIVE:
            return self._alive(e, now)
        if not port.router.peers.routes_slot(e.backend, e.slot):
            return False
        key = e.pool, e.backend, e.slot
        if e.kind == Kind.HELD:
            # (a snapshot older than what this replica knows of the slot is not news; one
            # of a slot untouched since it was restored from disk, at 0, is news to a
            # replica that knows nothing of that slot)
            known = self._changed.get(key)
            if (known is not None and e.at <= known) \
                    or not port.router.observe(e.backend, e.slot, e.tokens, now=now,
                                               lora=e.lora):
                return False
            self._changed[key] = e.at
            return True
        told_key = e.replica, e.pool, e.request
        if e.kind == Kind.MOVED:
            if (told := self._pop(told_key)) is None:
                return False
            port.hand_off(port.router.withdraw(told.decision, now=now))
            return True
        if e.kind == Kind.START:
            port.heard_start(e)
            old = self._told.get(told_key)
            if old is not None and (old.backend, old.slot, old.prompt) == (
                    e.backend, e.slot, e.tokens):
                return False  # (told again, to a replica that joined or came back)
            if (old := self._pop(told_key)) is not None:
                self._end(old, now)  # (the peer restarted: its ids begin again)
            d = port.router.observe_start(e.backend, e.slot, e.tokens, now=now, lora=e.lora)
            if d is None:
                return False
            self.touched(*key)
            self._keep(told_key, _Told(e.pool, e.backend, e.slot, e.tokens, d, now), now)
            return True
        if e.kind == Kind.FIRST:
            told = self._told.get(told_key)
            state = None if told is None else port.router.peers.observed_state(told.decision)
            if told is None or state is None or told.prefilled:
                return False
            told.prefilled = True
            if state == "waiting":
                # (it waits here behind a request that has no token yet: it runs first)
                port.router.peers.ran_first(told.backend, told.slot, told.prompt)
            port.router.prefilled(told.decision)
            return True
        self.touched(*key)
        return self._ended(port, e, self._pop(told_key), now)

    def _ended(self, port: PoolPort, e: Event, told: _Told | None, now: float) -> bool:
        if e.keep and (told is None or e.keep * 4 > len(told.prompt)):
            held = None  # (its start was missed: what it kept is not known here)
        elif e.keep * 4 + len(e.tokens) > MAX_TOKENS * 4:
            held = None
        else:
            held = (b"" if told is None else told.prompt[:4 * e.keep]) + e.tokens
        router = port.router
        state = None if told is None else router.peers.observed_state(told.decision)
        if told is None or state is None:
            return bool(held) and router.observe(e.backend, e.slot, held, now=now)
        if state == "waiting":
            # over while it waited here for the slot: the server ran it first, and the
            # request this model has there reuses what it left, then leaves its own
            port.hand_off(router.abort(told.decision, now=now))
            if held:
                router.peers.ran_first(told.backend, told.slot, held)
            return True
        if held and e.slot == told.slot and held.startswith(told.prompt):
            out = Report(output_tokens=held[len(told.prompt):])
            port.hand_off(router.complete(told.decision, out, now=now))
            return True
        # (it ended elsewhere than it started, or holding what its prompt was not)
        port.hand_off(router.abort(told.decision, now=now))
        if held:
            router.observe(e.backend, e.slot, held, now=now)
        return True

    def _alive(self, e: Event, now: float) -> bool:
        """The peer's requests in flight in the pool are ``e.live``: the others it had
        here are over (their end was lost: the broker dropped it, or the peer removed
        their backend)."""
        live = set(e.live)
        gone = [k for k in self._told if k[0] == e.replica and k[1] == e.pool
                and k[2] not in live]
        for key in gone:
            self._end(self._told.pop(key), now)
        return bool(gone)

    def _keep(self, key: _Key, told: _Told, now: float) -> None:
        self._told[key] = told
        self._told_bytes += len(told.prompt)
        while len(self._told) > _TOLD_MAX or self._told_bytes > _TOLD_BYTES:
            self._end(self._pop(next(iter(self._told))), now)  # type: ignore[arg-type]

    def _pop(self, key: _Key) -> _Told | None:
        told = self._told.pop(key, None)
        if told is not None:
            self._told_bytes -= len(told.prompt)
        return told

    def snapshot(self) -> list[Event]:
        """What every idle slot holds in this model, for a replica that joins."""
        return [Event(self.replica, Kind.HELD, pool, backend, slot, 0, held,
                      at=self._changed.get((pool, backend, slot), 0.0), lora=lora)
                for pool, port in self.pools.items() for backend in port.router.backends
                for slot, held, lora in port.router.peers.held_slots(backend)]

    def left(self, peer: str, now: float, why: str) -> None:
        """``peer`` left (said so, or was not heard for long): its requests end."""
        if self._seen.pop(peer, None) is not None:
            # (one that said so left on purpose: not a fault)
            (self.log.info if why == BYE else self.log.warning)(
                "replicas.peer_gone", peer=peer, why=why)
            self._spread()
        for key in [k for k in self._told if k[0] == peer]:
            self._end(self._pop(key), now)  # type: ignore[arg-type]

    def expire(self, now: float) -> None:
        """Forget peers not heard for long, and requests whose end was lost."""
        for peer, at in list(self._seen.items()):
            if now - at > PEER_TIMEOUT_S:
                self.left(peer, now, "not heard")
        for key in [k for k, t in self._told.items() if now - t.at > REQUEST_TIMEOUT_S]:
            self._end(self._pop(key), now)  # type: ignore[arg-type]

    def lost(self, now: float) -> None:
        """The broker is gone: no peer's end can come; every peer's request ends."""
        for peer in list(self._seen):
            self.left(peer, now, "broker lost")
        while self._told:
            self._end(self._pop(next(iter(self._told))), now)  # type: ignore[arg-type]

    def _end(self, told: _Told, now: float) -> None:
        port = self.pools.get(told.pool)
        if port is not None:
            port.hand_off(port.router.abort(told.decision, now=now, prefilled=True))
