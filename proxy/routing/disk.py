"""The disk tier in the model: the slots saved to disk, which backends may restore each,
and when restoring one into a slot is worth it.

A mixin of :class:`~proxy.routing.router.Router` (as QueuedRequests is). The tree holds each
saved slot's sequence under ``("", DISK, entry)``; a decision that restores one names its
file (``Decision.restore``), and ``restore_failed`` takes that back when the server did not
restore it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from proxy.routing.backend_state import BackendState
from proxy.routing.cache.predict import DISK, Placement
from proxy.routing.queue import Unplaced
from proxy.routing.routed import Inflight, Routed
from proxy.routing.settings import RouterSettings
from proxy.routing.tree.radix import RadixTree


class DiskEntries:
    """Saved slots the backends may restore (over the Router's tree and records)."""

    tree: RadixTree
    settings: RouterSettings
    _backends: dict[str, BackendState]
    _inflight: dict[int, Inflight]
    # disk entry -> its file and the backends that may restore it (see disk_add)
    _disk: dict[int, tuple[str, frozenset[str]]]
    _spilling: set[str]  # backends whose displaced slots the disk tier saves
    _unplaced: Unplaced | None  # (Router)
    _apply_unplaced: Callable[[], None]  # (Router)

    def held(self, backend: str, slot: int) -> bytes | None:
        """What ``backend``'s idle ``slot`` holds (int32 token bytes; None: busy, empty,
        or no such backend)."""
        st = self._backends.get(backend)
        if st is None or not 0 <= slot < len(st.cache.slots):
            return None
        return st.cache.held(slot)

    def vacant(self, backend: str, slot: int) -> bool:
        """Is ``backend``'s ``slot`` idle and empty (nothing routed there, or seeded)?"""
        st = self._backends.get(backend)
        if st is None or not 0 <= slot < len(st.cache.slots):
            return False
        s = st.cache.slots[slot]
        return not s.busy and not s.n_tokens

    def seed(self, backend: str, slot: int, sequence: bytes) -> bool:
        """``backend``'s empty ``slot`` now holds ``sequence`` (restored from disk)."""
        st = self._backends.get(backend)
        if st is None or not 0 <= slot < len(st.cache.slots):
            return False
        return st.cache.seed(slot, sequence)

    def disk_spills(self, backend: str, spills: bool = True) -> None:
        """Does the disk tier save what ``backend``'s slots hold before a queued request
        replaces it? Then a hand-off there carries the slot's content
        (``Handoff.displaced``); elsewhere nothing would read that copy of up to a slot's
        tokens."""
        if spills:
            self._spilling.add(backend)
        else:
            self._spilling.discard(backend)

    def disk_add(self, entry: int, file: str, sequence: bytes,
                 backends: frozenset[str]) -> None:
        """A slot saved to disk as ``file`` holds ``sequence``: each of ``backends`` (those
        that run the model that computed it and read the directory it is in) may have it
        restored into one of its slots. Called again for an entry when they change."""
        self._disk[entry] = (file, backends)
        self.tree.assign(("", DISK, entry), sequence)

    def disk_drop(self, entry: int) -> None:
        if self._disk.pop(entry, None) is not None:
            self.tree.drop(("", DISK, entry))

    def _disk_gain(self, held: dict[Any, int], p: Placement, n: int, backend: str
                   ) -> tuple[str, bytes, int] | None:
        """The disk file to restore into the placement's slot first, its sequence and
        the tokens it shares with the prompt: when it holds enough more than the slot.
        Never on a checkpointed backend: the server clears a restored slot's
        checkpoints, so a request diverging from it would reuse nothing."""
        if self._backends[backend].cache.checkpointed:
            return None
        best = max(((got, idx) for (_, kind, idx), got in held.items()
                    if kind == DISK and backend in self._disk[idx][1]), default=None)
        if best is None or best[0] - p.reuse < self.settings.disk_min_gain_tokens:
            return None
        got, idx = best
        return self._disk[idx][0], self.tree.tokens_of(("", DISK, idx)), min(got, n - 1)

    def restore_failed(self, routed: Routed) -> Routed:
        """The disk file chosen for the request's slot was not restored: the server
        cleared the slot (or the file was gone), so the request is prefilled from scratch,
        as its record's prediction then says; the model's slot is emptied first."""
        u = self._unplaced
        f, decision = routed.entry, routed.prediction
        st = self._backends.get(f.backend)
        if st is None or not f.live or decision.restore is None:
            return routed
        if u is not None and u.request_id == decision.request_id and u.restore is not None:
            self._unplaced = replace(u, restore=b"")  # an empty slot: start reuses nothing
            self._apply_unplaced()  # (which charges the prefill it adds)
        else:  # applied already: the slot holds the prompt now, as the server's does
            more = decision.predicted_cached
            st.work += more
            f.work += more
            st.busy_until += more / st.rate
        d = routed.prediction
        f.prediction = replace(d, predicted_cached=0, tier="none", restore=None,
                               reasons={**d.reasons, "reuse": 0, "tier": "none",
                                        "restore": "failed"})
        return routed
