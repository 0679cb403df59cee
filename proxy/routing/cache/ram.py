"""What one backend's host-RAM prompt cache does with slot states: saves, copies of
idle slots, evictions (the rules: proxy/routing/cache/model.py).

:class:`RamTier` is the part of :class:`~proxy.routing.cache.model.BackendCache` that
changes the RAM tier; the cache's start and finish call it. A mixin over
:class:`~proxy.routing.cache.predict.CachePrediction`, like the cache itself: its state
stays in flat attributes the predictions read on every decision.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator

from sortedcontainers import SortedList

from proxy.routing.cache.checkpoints import Checkpoints
from proxy.routing.cache.lora import Scales
from proxy.routing.cache.predict import CachePrediction
from proxy.routing.cache.values import RAM, CacheHolder


class RamTier(CachePrediction):
    """The RAM prompt cache's effects."""

    def _init_ram(self, max_tracked: int, track_min_tokens: int) -> None:
        """An empty RAM tier (BackendCache.__init__)."""
        # RAM entries whose sequences stay in the tree: every one of `track_min_tokens` or
        # more, and smaller ones only while there are no more than `max_tracked` in all
        # (the largest stay). Every prompt of a chat template starts with the same tokens,
        # so every holder is matched by every request: a RAM tier full of small prompts
        # (thousands fit in 1 GiB) would make each decision walk all of them (5.7 ms a
        # decision after 10k small requests on the demo model, against 0.1 ms). Large
        # entries are few (the RAM's size bounds them) and are what a load saves most on:
        # tracking only the 64 largest loses 6.5 points of hit ratio on the Mooncake replay.
        # Untracked entries keep their place in the byte LRU (evictions stay exact) but
        # are not matched: the model may miss a load the server makes.
        self.max_tracked = max_tracked
        self.track_min_tokens = track_min_tokens
        self._tracked: SortedList[tuple[int, int]] = SortedList()  # (tokens, entry id)
        self.ram: OrderedDict[int, int] = OrderedDict()  # entry id -> tokens, oldest first
        self.ram_checkpoints: dict[int, Checkpoints] = {}
        self.ram_lora: dict[int, Scales] = {}
        self.ram_bytes = 0
        self._next_entry = 0

    def ram_by_size(self) -> Iterator[tuple[int, CacheHolder]]:
        """(tokens, holder) of the RAM entries the tree holds, largest first (lazily)."""
        for n, e in reversed(self._tracked):
            yield n, self.ram_holder(e)

    def forget_ram(self, entries: Iterable[int]) -> None:
        """These RAM entries were never made: the start that created them in the model
        never reached the server (see Router.withdraw)."""
        for e in entries:
            if e in self.ram:
                self._drop_entry(e)

    def saved_idle(self, slot: int) -> tuple[int, ...]:
        """A task started on the server after the request in ``slot`` ended there, but
        the model heard of that end later (two slots ending in one server step: the
        first answer read hands a queued request the other slot; a request sent while
        the answer's last step ran): the server saved this slot as an idle one at that
        start (--cache-idle-slots), so the model does now. Returns the entries made."""
        first = self._next_entry
        if self.rules.cache_idle_slots and self.cap.ram_cache_bytes:
            self._save_idle_slot(slot)
        return tuple(e for e in range(first, self._next_entry) if e in self.ram)

    def _save_idle_slot(self, i: int) -> None:
        """--cache-idle-slots: after a task starts, every idle slot is saved to RAM."""
        unified = self.rules.kv_unified
        s = self.slots[i]
        if s.n_tokens == 0:
            return
        if s.ram_copy is None or s.ram_copy not in self.ram:  # else: already saved
            self._save(i, keep=not unified)
        if unified:  # [TAG_IDLE_SLOT_CLEAR]: the slot's KV is freed
            self.tree.drop(self.slot_holder(i))
            s.n_tokens = 0
            s.ram_copy = None
            s.checkpoints, s.floor = (), 0

    def _save(self, slot: int, keep: bool = False) -> set[int]:
        """server_prompt_cache::alloc + update: save a slot's state; returns entries gone.

        ``keep``: the slot keeps its content (an idle-slot copy); otherwise its holder
        moves to the new entry (the slot is about to be overwritten)."""
        s = self.slots[slot]
        h = self.slot_holder(slot)
        limit = self.cap.ram_cache_bytes
        gone: set[int] = set()
        new_bytes = self.cap.entry_bytes(s.n_tokens, len(s.checkpoints))
        if limit == 0 or new_bytes > limit or s.n_tokens == 0:
            return gone
        if s.ram_copy is not None and s.ram_copy in self.ram:
            return gone  # our own copy is still there: "already in the cache, skipping"
        ram_of_me = self._ram_relations(h)
        if any(contains for _, contains in ram_of_me):
            return gone  # "prompt is already in the cache, skipping"
        for e, contains in ram_of_me:
            if not contains:  # an entry that is a prefix of the slot state is obsolete
                self._drop_entry(e)
                gone.add(e)
        e = self._next_entry
        self._next_entry += 1
        if keep:
            self.tree.copy(h, self.ram_holder(e))
            s.ram_copy = e
        else:
            self.tree.move(h, self.ram_holder(e))
        self.ram[e] = s.n_tokens
        if s.checkpoints:
            self.ram_checkpoints[e] = s.checkpoints
        if s.lora:
            self.ram_lora[e] = s.lora
        self.ram_bytes += new_bytes
        self._tracked.add((s.n_tokens, e))
        tracked = self._tracked
        while len(tracked) > self.max_tracked and tracked[0][0] < self.track_min_tokens:
            _, e_small = tracked.pop(0)  # smallest (then oldest) leaves the tree
            self.tree.drop(self.ram_holder(e_small))
        while self.ram_bytes > limit and self.ram:
            old = next(iter(self.ram))
            self._drop_entry(old)
            gone.add(old)
        return gone

    def _ram_relations(self, h: CacheHolder) -> list[tuple[int, bool]]:
        """RAM entries that contain slot ``h``'s sequence (True) or are a prefix of it."""
        name = self.cap.name
        ram = self.ram
        containing, prefixes = self.tree.relations(h)
        out = []
        for x in containing:
            if x[1] == RAM and x[0] == name and x[2] in ram:  # type: ignore[index]
                out.append((x[2], True))  # type: ignore[index]
        for x in prefixes:
            if x[1] == RAM and x[0] == name and x[2] in ram:  # type: ignore[index]
                out.append((x[2], False))  # type: ignore[index]
        return out

    def _drop_entry(self, e: int) -> None:
        self.tree.drop(self.ram_holder(e))
        self._unlist(e)

    def _load_entry(self, e: int, slot: int) -> None:
        """The server loads entry ``e`` into ``slot``: moved out of RAM, not copied."""
        self.tree.move(self.ram_holder(e), self.slot_holder(slot))
        self._unlist(e)

    def _unlist(self, e: int) -> None:
        """Entry ``e`` leaves the RAM tier's accounts (its sequence left the tree)."""
        self.ram_bytes -= self.entry_size(e)
        n = self.ram.pop(e)
        self.ram_checkpoints.pop(e, None)
        self.ram_lora.pop(e, None)
        self._tracked.discard((n, e))
