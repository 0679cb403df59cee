"""Requests routed by other replicas (proxy/replicas/), and this one's told to them.

A mixin of :class:`~proxy.routing.router.Router`. Another replica's request, as that
replica tells it, is placed in the model as if routed here: its slot is busy, its
prefill loads the backend, and what it leaves there counts for this replica's next
decisions. The other way, a `SlotListener` hears what this replica's own requests do
to their slots: their prefill ending, and what each slot holds once a request leaves
it, before a queued request takes it over.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from proxy.routing.decision import Handoff
from proxy.routing.policy import Candidate, Choice
from proxy.routing.tree.token_bytes import common_len

if TYPE_CHECKING:
    from proxy.routing.backend_state import BackendState
    from proxy.routing.cache.predict import Placement
    from proxy.routing.routed import Inflight, Routed


class SlotListener(Protocol):
    def prefilled(self, backend: str, request: int) -> None:
        """The request's first token came."""

    def freed(self, backend: str, slot: int, request: int, held: bytes | None) -> None:
        """The request left ``slot``, which holds ``held`` (None: not known)."""


class ObservedRequests:
    """Others' requests placed in the model (over the Router's records)."""

    _backends: dict[str, BackendState]
    _inflight: dict[int, Inflight]
    _next_id: int
    # requests placed by `observe_start` (told to no listener)
    _observed: set[int]
    listener: SlotListener | None
    _apply_unplaced: Callable[[], None]
    _candidates: Callable[..., tuple[list[Candidate], object] | object]
    _place: Callable[..., tuple[Placement | None, bytes | None]]
    _record: Callable[..., Routed]
    complete: Callable[..., list[Handoff]]

    def observe_start(self, backend: str, slot: int, sequence: bytes, *, now: float = 0.0,
                      wait: bool = True) -> Routed | None:
        """Another replica's request was sent to ``backend``'s ``slot``, with ``sequence``
        (int32 token bytes) as its prompt: the model places it there as if routed here;
        it ends with ``complete`` (or ``abort``) as any. A slot busy in this model has
        it next: the server runs it once the request there ends, before any this
        replica holds for that slot (those are not sent yet). None when the backend is
        not routed here (or, without ``wait``, the slot is busy)."""
        self._apply_unplaced()
        st = self._backends.get(backend)
        n = len(sequence) // 4
        if st is None or not 0 <= slot < len(st.cache.slots) or n < 2 or len(sequence) % 4:
            return None
        found = self._candidates(sequence, n, False, (backend,))
        if not isinstance(found, tuple):
            return None
        (cand,), _ = found
        why = {"why": "another replica's request"}
        if st.cache.slots[slot].busy:
            if not wait:
                return None
            choice = Choice(backend, slot, None, why, cand.predict_queued(n, None)[0])
        else:
            p = st.cache.predict(slot, cand.slot_lcp, cand.ram_lcp, n)
            choice = Choice(backend, slot, p, why)
        rid = self._next_id
        self._next_id += 1
        placed, _ = self._place(rid, choice, cand, sequence, n, False, False, None, ())
        self._observed.add(rid)
        return self._record(rid, choice, cand, placed, sequence, n, now, None, None,
                            False, None, ())

    def observe(self, backend: str, slot: int, sequence: bytes, *, now: float = 0.0
                ) -> bool:
        """Another replica's request on ``backend``'s ``slot`` ended, leaving ``sequence``
        there: ``observe_start`` and ``complete`` at once (what it displaces goes to RAM
        as the server's would). False when the backend is not routed here or the slot
        is busy in this model (the request there settles what it holds)."""
        decision = self.observe_start(backend, slot, sequence, now=now, wait=False)
        if decision is None:
            return False
        self.complete(decision, now=now)
        return True

    def observed_state(self, routed: Routed) -> str | None:
        """Where another replica's request (``observe_start``) is in this model: "slot"
        (it has its slot), "waiting" (for it), or None (gone: its backend was removed)."""
        f = routed.entry
        if not f.live:
            return None
        return "waiting" if f.slot is None else "slot"

    def routes_slot(self, backend: str, slot: int) -> bool:
        st = self._backends.get(backend)
        return st is not None and 0 <= slot < len(st.cache.slots)

    def ran_first(self, backend: str, slot: int, held: bytes) -> None:
        """Another replica's request waiting here for ``slot`` got its first token (or
        ended), leaving ``held`` there, while the request this model has in the slot did
        not: the server runs that one first, and the one here reuses what it leaves
        (its record's prediction says so)."""
        for rid, f in self._inflight.items():
            if f.backend == backend and f.slot == slot and rid not in self._observed \
                    and not f.prefilled:
                f.revise(min(common_len(held, f.prompt, 0), f.n - 1), "slot")
                return

    def _waiters_first(self, targets: dict[int, int]) -> list[tuple[int, int]]:
        """Requests waiting for a given slot, others' first: they are in the server's
        queue already; this replica's own are held here until handed the slot."""
        return sorted(targets.items(), key=lambda t: t[0] not in self._observed)

    def _told_prefilled(self, backend: str, rid: int) -> None:
        if self.listener is not None and rid not in self._observed:
            self.listener.prefilled(backend, rid)

    def _told_freed(self, backend: str, slot: int | None, rid: int) -> None:
        """``rid`` left ``slot`` (None: it is not known where it ended): the listener
        hears what the slot holds, unless the request was another replica's."""
        if rid in self._observed:
            self._observed.discard(rid)
            return
        if self.listener is None or slot is None:
            return
        st = self._backends.get(backend)  # (None: removed: what it holds is not known)
        self.listener.freed(backend, slot, rid, None if st is None else st.cache.held(slot))

    def held_slots(self, backend: str) -> list[tuple[int, bytes]]:
        """What each idle slot of ``backend`` holds (told to a replica that joins)."""
        st = self._backends.get(backend)
        if st is None:
            return []
        return [(i, held) for i in range(len(st.cache.slots))
                if (held := st.cache.held(i)) is not None]
