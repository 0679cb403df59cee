"""The requests the router holds for a slot, and the records of every request in flight
(its own, and the one decision whose slot model update is deferred).

A mixin of :class:`~proxy.routing.router.Router` (as HolderQueries is of the tree): a request
decided while every slot of its backend is busy is queued in the model, and handed a
slot when one frees, in the server's own order (see ``Handoff``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from proxy.routing.backend_state import BackendState
from proxy.routing.cache.model import BackendCache
from proxy.routing.cache.predict import PENDING, RAM, SLOT, Placement, from_disk
from proxy.routing.decision import Handoff
from proxy.routing.settings import RouterSettings
from proxy.routing.tree.radix import RadixTree


@dataclass
class Inflight:
    """The router's record of one request in flight."""

    backend: str
    slot: int | None  # slot the model placed it in (None: queued on the server)
    prompt: bytes
    n: int
    work: int
    started: float
    # decided on the head of its prompt (see `Router.extend`): what the holder it reuses from
    # had beyond that head, when it held all of it
    beyond: bytes | None = None
    session: str | None = None  # the client's session hint
    # the reuse and tier the deferred slot model update found instead of the predicted
    # ones, until `Router.place` returns them
    replaced: tuple[int, str] | None = None
    user_starts: tuple[int, ...] = ()  # where its prompt's user messages start
    prefilled: bool = False  # its first token came


@dataclass(frozen=True)
class Unplaced:
    """A decision whose slot model update is deferred (``decide(defer=True)``)."""

    request_id: int
    backend: str
    pin: int | None  # the slot pinned, or None: the server's pick (predicted)
    prompt: bytes
    slot_lcp: dict[int, int]
    ram_lcp: dict[int, int]
    n: int
    predicted: Placement
    restore: bytes | None = None  # the slot is first given this sequence from disk
    user_starts: tuple[int, ...] = ()


class QueuedRequests:
    """Hand-offs of queued requests (over ``tree`` and ``_inflight``)."""

    tree: RadixTree
    _inflight: dict[int, Inflight]
    settings: RouterSettings
    _policy: str
    _waiters_first: Callable[[dict[int, int]], list[tuple[int, int]]]  # (ObservedRequests)
    _observed: set[int]  # (ObservedRequests)
    _disk: dict[int, tuple[str, frozenset[str]]]  # (DiskEntries)
    _spilling: set[str]  # (DiskEntries)
    _disk_gain: Callable[[dict[Any, int], Placement, int, str],
                         tuple[str, bytes, int] | None]  # (DiskEntries)

    def _drain_queue(self, st: BackendState, backend: str, now: float) -> list[Handoff]:
        """A slot freed. A request waiting for that very slot gets it, pinned (the first
        of its waiters); otherwise a request waiting for any slot gets the one the
        server would give it unpinned: the waiter that would reuse the most there, at
        least ``wait_min_tokens`` (its conversation's next turn in the freed slot, or
        an entry of the RAM tier), else the oldest. The proxy holds them, so it need not
        hand slots out in arrival order as the server's queue does: a turn that came
        while its slot was busy would otherwise take whichever slot freed first and
        leave its history to the waiter behind it, which recomputes it again; and each
        start ahead of a waiter saves the slot it takes to RAM, which on a small RAM tier
        evicts the entry that waiter was sent here to load. The model records the
        hand-off now."""
        out: list[Handoff] = []
        cache = st.cache
        for rid, slot in self._waiters_first(st.targets):
            if not cache.slots[slot].busy:
                out.append(self._hand(st, backend, rid, slot, now))
        while cache.idle:
            waiting = [r for r in st.queued if r not in st.targets]
            if not waiting:
                break
            out.append(self._hand(st, backend, self._next_waiter(st, backend, waiting),
                                  None, now))
        return out

    def _next_waiter(self, st: BackendState, backend: str, waiting: list[int]) -> int:
        """The waiter an idle slot of ``backend`` goes to (see ``_drain_queue``): the
        one whose unpinned start there (as ``_hand`` makes it) reuses the most, from the
        slot or from RAM; the baseline policies keep the server's order."""
        best, most = waiting[0], self.settings.wait_min_tokens - 1
        if self._policy != "prefix":
            return best
        cache = st.cache
        for rid in waiting:
            f = self._inflight[rid]
            p = cache.predict(None, *self._lcps(cache, f.prompt), f.n)
            if p is not None and p.reuse > most:
                best, most = rid, p.reuse
        return best

    def _hand(self, st: BackendState, backend: str, rid: int, slot: int | None,
              now: float) -> Handoff:
        f = self._inflight[rid]
        self._unqueue(st, backend, rid)
        cache = st.cache
        held = self.tree.match(f.prompt).held
        slot_lcp, ram_lcp = self._split(cache, held)
        p = cache.predict(slot, slot_lcp, ram_lcp, f.n)
        assert p is not None, "handed an idle slot"
        had = cache.held(p.slot) if backend in self._spilling else None
        # a peer's request is restored by the replica that routed it, if at all
        restore = (self._disk_gain(held, p, f.n, backend)
                   if self._disk and rid not in self._observed else None)
        if restore is None:
            p = cache.start(slot, f.prompt, slot_lcp, ram_lcp, f.n, p,
                            user_starts=f.user_starts)
        else:
            cache.restore(p.slot, restore[1])
            p = from_disk(cache.start(p.slot, f.prompt, {**slot_lcp, p.slot: restore[2]},
                                      ram_lcp, f.n, user_starts=f.user_starts))
            if had is not None and restore[1].startswith(had):
                had = None  # (the file holds it already: an earlier point of its conversation)
        assert p is not None
        f.slot = p.slot
        st.occupy(p.slot, f.session)
        f.started = max(f.started, now)  # its duration counts from here, not its wait
        st.expect_free(p.slot, now)
        kept = p.reuse if p.tier == "slot" else 0
        return Handoff(rid, backend, p.slot, p.reuse, p.tier,
                       restore[0] if restore is not None else None,
                       had if had is not None and len(had) // 4 > kept else None)

    def _unqueue(self, st: BackendState, backend: str, rid: int) -> None:
        self.tree.drop((backend, PENDING, rid))
        st.queued_n.pop(rid, None)
        st.targets.pop(rid, None)
        if rid in st.queued:
            st.queued.remove(rid)

    def _lcps(self, cache: BackendCache, q: bytes) -> tuple[dict[int, int], dict[int, int]]:
        return self._split(cache, self.tree.match(q).held)

    @staticmethod
    def _split(cache: BackendCache, held: dict[Any, int]
               ) -> tuple[dict[int, int], dict[int, int]]:
        """What of a prompt ``cache``'s slots and RAM entries hold, from the tree's match."""
        slot_lcp: dict[int, int] = {}
        ram_lcp: dict[int, int] = {}
        for (b, kind, idx), got in held.items():
            if b == cache.cap.name:
                if kind == SLOT:
                    slot_lcp[idx] = got
                elif kind == RAM:
                    ram_lcp[idx] = got
        return slot_lcp, ram_lcp

    def _server_pick_now(self, cache: BackendCache, q: bytes) -> int | None:
        return cache.server_pick(self._lcps(cache, q)[0], max(1, len(q) // 4))
