"""Requests routed by other replicas (proxy/replicas/), and this one's told to them.

Another replica's request, as that replica tells it, is placed in the model as if routed
here (``Router.observe_start``, ``Router.observe``): its slot is busy, its
prefill loads the backend, and what it leaves there counts for this replica's next
decisions. The other way, a `SlotListener` hears what this replica's own requests do
to their slots: their prefill ending, and what each slot holds once a request leaves
it, before a queued request takes it over.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from proxy.routing.backend_state import BackendState
from proxy.routing.cache.lora import Lora
from proxy.routing.routed import Inflight, Ledger, Routed
from proxy.routing.tree.token_bytes import common_len


class SlotListener(Protocol):
    def prefilled(self, backend: str, request: int) -> None:
        """The request's first token came."""

    def freed(self, backend: str, slot: int, request: int, held: bytes | None) -> None:
        """The request left ``slot``, which holds ``held`` (None: not known)."""

    def withdrawn(self, backend: str, request: int) -> None:
        """The request is not sent where it was decided (it never reached the server)."""


class PeerRequests:
    """Others' requests in the model: what a listener hears of this replica's, and what
    the queue owes the others' (they are in the server's queue already)."""

    def __init__(self, backends: Mapping[str, BackendState], ledger: Ledger) -> None:
        self._backends, self._ledger = backends, ledger
        self.listener: SlotListener | None = None  # hears this replica's slots change

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
        for _, f in self._ledger.on(backend):
            if f.slot == slot and not f.observed and not f.prefilled:
                f.revise(min(common_len(held, f.prompt, 0), f.n - 1), "slot")
                return

    def waiters_first(self, targets: dict[int, int]) -> list[tuple[int, int]]:
        """Requests waiting for a given slot, others' first: they are in the server's
        queue already; this replica's own are held here until handed the slot."""
        return sorted(targets.items(), key=lambda t: not self._ledger[t[0]].observed)

    def told_prefilled(self, f: Inflight, rid: int) -> None:
        if self.listener is not None and not f.observed:
            self.listener.prefilled(f.backend, rid)

    def told_freed(self, f: Inflight, slot: int | None, rid: int) -> None:
        """``rid`` (whose entry is ``f``) left ``slot`` (None: it is not known where it
        ended): the listener hears what the slot holds, unless it was another replica's."""
        if f.observed or self.listener is None or slot is None:
            return
        st = self._backends.get(f.backend)  # (None: removed: what it holds is not known)
        self.listener.freed(f.backend, slot, rid, None if st is None else st.cache.held(slot))

    def told_withdrawn(self, f: Inflight, rid: int) -> None:
        if self.listener is not None and not f.observed:
            self.listener.withdrawn(f.backend, rid)

    def held_slots(self, backend: str) -> list[tuple[int, bytes, Lora | None]]:
        """What each idle slot of ``backend`` holds, and the adapters its last request
        ran under (told to a replica that joins)."""
        st = self._backends.get(backend)
        if st is None:
            return []
        slots = st.cache.slots
        return [(i, held, tuple(enumerate(slots[i].lora)) or None)
                for i in range(len(slots)) if (held := st.cache.held(i)) is not None]
