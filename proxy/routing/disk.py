"""The disk tier in the model: the slots saved to disk, which backends may restore each,
and when restoring one into a slot is worth it.

The tree holds each saved slot's sequence under ``("", DISK, entry)``; a decision that
restores one names its file (``Decision.restore``), and ``Router.restore_failed`` takes
that back when the server did not restore it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from proxy.routing.backend_state import BackendState
from proxy.routing.cache.values import DISK, Placement
from proxy.routing.settings import RouterSettings
from proxy.routing.tree.radix import RadixTree


class DiskIndex:
    """Saved slots the backends may restore, and the backends whose slots are saved."""

    def __init__(self, tree: RadixTree, settings: RouterSettings,
                 backends: Mapping[str, BackendState]) -> None:
        self._tree, self._settings, self._backends = tree, settings, backends
        # disk entry -> its file and the backends that may restore it (see add)
        self._entries: dict[int, tuple[str, frozenset[str]]] = {}
        self._spilling: set[str] = set()  # backends whose displaced slots are saved

    def __bool__(self) -> bool:
        """Is anything saved?"""
        return bool(self._entries)

    def spills(self, backend: str, spills: bool = True) -> None:
        """Does the disk tier save what ``backend``'s slots hold before a queued request
        replaces it? Then a hand-off there carries the slot's content
        (``Handoff.displaced``); elsewhere nothing would read that copy of up to a slot's
        tokens."""
        if spills:
            self._spilling.add(backend)
        else:
            self._spilling.discard(backend)

    def spilling(self, backend: str) -> bool:
        return backend in self._spilling

    def add(self, entry: int, file: str, sequence: bytes, backends: frozenset[str]) -> None:
        """A slot saved to disk as ``file`` holds ``sequence``: each of ``backends`` (those
        that run the model that computed it and read the directory it is in) may have it
        restored into one of its slots. Called again for an entry when they change."""
        self._entries[entry] = (file, backends)
        self._tree.assign(("", DISK, entry), sequence)

    def drop(self, entry: int) -> None:
        if self._entries.pop(entry, None) is not None:
            self._tree.drop(("", DISK, entry))

    def gain(self, held: dict[Any, int], p: Placement, n: int, backend: str
             ) -> tuple[str, bytes, int] | None:
        """The disk file to restore into the placement's slot first, its sequence and
        the tokens it shares with the prompt: when it holds enough more than the slot.
        Never on a checkpointed backend: the server clears a restored slot's
        checkpoints, so a request diverging from it would reuse nothing. Nor on one with
        LoRA adapters: a file does not record the adapters its KV was made under."""
        cache = self._backends[backend].cache
        if not self._entries or cache.checkpointed or cache.lora_global:
            return None
        best = max(((got, idx) for (_, kind, idx), got in held.items()
                    if kind == DISK and backend in self._entries[idx][1]), default=None)
        if best is None or best[0] - p.reuse < self._settings.disk_min_gain_tokens:
            return None
        got, idx = best
        return self._entries[idx][0], self._tree.tokens_of(("", DISK, idx)), min(got, n - 1)
