"""Pure half of the backend cache model: where a request would land.

:class:`CachePrediction` answers what llama-server would do with a request on one
backend (which slot, what it reuses, whether the slot is saved to RAM first, what KV is
lost for good) without changing anything; :class:`~proxy.routing.cache.model.BackendCache`
inherits it and applies the effects. The server rules it mirrors are listed in
proxy/routing/cache/model.py. A mixin rather than a helper object: the policy predicts for every
request and backend, and an extra call level would cost on that hot path.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING

from proxy.routing.cache.checkpoints import Checkpoints, loaded_floor, reusable
from proxy.routing.cache.lora import Lora, Scales, launched, scales, should_clear
from proxy.routing.cache.values import (
    RAM,
    SLOT,
    BackendCapacity,
    CacheHolder,
    Placement,
    ServerRules,
    Slot,
)

if TYPE_CHECKING:
    from proxy.routing.tree.radix import RadixTree


class CachePrediction:
    """Predictions over a backend's slots and RAM tier (state owned by BackendCache)."""

    cap: BackendCapacity
    tree: RadixTree
    rules: ServerRules
    slots: list[Slot]
    ram: OrderedDict[int, int]  # entry id -> tokens, oldest first
    ram_checkpoints: dict[int, Checkpoints]  # entry id -> checkpoints saved with it
    ram_lora: dict[int, Scales]  # entry id -> the adapters its slot's KV was made under
    ram_bytes: int
    checkpointed: bool  # the server reuses only up to checkpoints (cap.memory)
    lora_global: Scales  # the server's global adapter scales (see proxy/routing/cache/lora.py)

    # ---------------------------------------------------------------- holders
    def slot_holder(self, i: int) -> CacheHolder:
        return (self.cap.name, SLOT, i)

    def ram_holder(self, e: int) -> CacheHolder:
        return (self.cap.name, RAM, e)

    # ------------------------------------------------------------- prediction
    def server_pick(self, slot_lcp: dict[int, int], n_prompt: int) -> int | None:
        """The idle slot the server picks for an unpinned request (None: all busy)."""
        thr = self.rules.slot_similarity
        best, sim_best = None, 0.0
        if thr > 0.0:  # 0 disables the similarity pass in the server
            for i, s in enumerate(self.slots):
                if s.busy or s.n_tokens == 0:
                    continue
                sim = slot_lcp.get(i, 0) / n_prompt
                if sim > sim_best and sim > thr:
                    best, sim_best = i, sim
        if best is not None:
            return best
        # NOTE: the server keeps the *last* slot among equally old ones (`<=`)
        idle = [(s.last_used, -i) for i, s in enumerate(self.slots) if not s.busy]
        return -min(idle)[1] if idle else None

    def _saves(self, n_slot: int, lcp: int, n_prompt: int, pinned: bool) -> bool:
        """get_available_slot's ``update_cache`` for a slot holding ``n_slot`` tokens."""
        thr = self.rules.slot_similarity
        if thr == 0.0:  # no similarity pass: only an LRU pick (unpinned) updates the cache
            return not pinned
        if lcp / n_prompt <= thr:  # LRU pick, or pinned with its kept fraction taken as 0
            return True
        return lcp < self.rules.keep_threshold * n_slot

    def predict(
        self,
        slot: int | None,
        slot_lcp: dict[int, int],
        ram_lcp: dict[int, int],
        n_prompt: int,
        *,
        after_busy: bool = False,
        lora: Lora | None = None,
        prompt: bytes = b"",
    ) -> Placement | None:
        """Where a request would land and what it would reuse; pure. None: no idle slot.

        ``after_busy``: ``slot`` is busy and the request would wait for it (held by the
        proxy, sent pinned once it frees): predicted against what it holds now, its
        running request's prompt (the output it adds is not foreseen).

        ``lora``: the adapters the request names (None: no `lora` field: kvroute names
        the global scales for it, see proxy/routing/cache/lora.py); ``prompt``: its token
        bytes, where an aLoRA it names finds its invocation (b"": not looked for)."""
        pinned = slot is not None
        if slot is None:
            slot = self.server_pick(slot_lcp, n_prompt)
            if slot is None:
                return None
        s = self.slots[slot]
        assert after_busy or not s.busy, "never place a request on a busy slot"
        lcp = slot_lcp.get(slot, 0)
        if lcp > s.n_tokens:
            lcp = s.n_tokens
        entry, got, displaced, saved, destroyed = None, lcp, 0, False, 0
        if s.n_tokens > 0 and self._saves(s.n_tokens, lcp, n_prompt, pinned):
            saved = True
            displaced = s.n_tokens - lcp
            gone = self._evicted_by_save(slot)
            entry, got = self._best_ram(ram_lcp, n_prompt, lcp, s.n_tokens, gone)
            kept = self._set_kept(slot, lora)
            # no room in RAM, or a copy there no slot of its adapters is left to load:
            # truncated or replaced
            if not kept or not self._can_save(s.n_tokens):
                destroyed = self._unique_tail(slot, 0 if entry is not None else lcp, lcp,
                                              n_prompt, kept)
        elif s.n_tokens == 0 and not pinned:
            entry, got = self._best_ram(ram_lcp, n_prompt, 0, 0, set())
        elif lcp < s.n_tokens:  # kept: tail truncated
            destroyed = self._unique_tail(slot, lcp, lcp, n_prompt, self._set_kept(slot, lora))
        reuse, tier, recompute = self.landed(slot, entry, got, n_prompt, lora, prompt)
        return Placement(slot, reuse, tier, entry, displaced, saved, destroyed, recompute,
                         s.n_tokens)

    def landed(self, slot: int, entry: int | None, got: int, n_prompt: int,
               lora: Lora | None, prompt: bytes = b"") -> tuple[int, str, bool]:
        """(reuse, tier, recompute) of a request landing in ``slot`` with ``got`` tokens
        shared with what it holds then, RAM entry ``entry`` loaded into it (None: none)."""
        recompute = False
        if self.lora_global:  # (none: nothing to compare)
            if self.clears(slot, lora):
                got = 0  # (a RAM entry loaded is lost with the rest)
            elif self._foreign(entry, lora):
                got, recompute = 0, True
            elif (most := self.alora_most(lora, prompt)) is not None:
                got = min(got, most)
        if self.checkpointed and got:
            got = (self._from_entry(entry, got, n_prompt) if entry is not None
                   else self._from_slot(slot, got, n_prompt))
        reuse = got if got < n_prompt else n_prompt - 1  # the server never reuses it all
        if reuse < 0:
            reuse = 0
        tier = "none" if reuse == 0 else ("ram" if entry is not None else "slot")
        return reuse, tier, recompute

    def predict_queued(
        self,
        slot_lcp: dict[int, int],
        ram_lcp: dict[int, int],
        ahead: list[tuple[int, int]],
        n_prompt: int,
        lora: Lora | None = None,
    ) -> Placement:
        """Where an unpinned request deferred by the server (no idle slot) will land.

        ``ahead``: (tokens shared with this prompt, prompt tokens) of each request queued
        before it on this backend, oldest first. The server hands a released slot to its
        oldest deferred request; assuming slots free in the order their requests started
        (FIFO service), the k-th waiting request gets the (k mod n_slots)-th slot of that
        order, which then holds the prompt of its current occupant (k < n_slots) or of
        the request k - n_slots ahead. It is the only idle slot then: the server keeps its
        common prefix, or saves it and loads the best RAM entry still there: every start
        until then saves its slot's content, and the oldest entries make room (a small
        RAM tier loses the entry a busy backend was chosen for before its turn comes)."""
        k, n_slots = len(ahead), len(self.slots)
        behind = ahead[k - n_slots] if k >= n_slots else None
        saved = sum(self.save_bytes(n) for _, n in ahead[:max(0, k - n_slots + 1)])
        return self.predict_behind(slot_lcp, ram_lcp, k, behind, saved, n_prompt, lora)

    def predict_behind(
        self,
        slot_lcp: dict[int, int],
        ram_lcp: dict[int, int],
        k: int,
        behind: tuple[int, int] | None,
        ahead_saved: int,
        n_prompt: int,
        lora: Lora | None = None,
    ) -> Placement:
        """``predict_queued`` from what it reads of the requests ahead: their number
        ``k``; once they outnumber the slots, (tokens shared, prompt tokens) of the one
        whose slot this request gets (``ahead[k - n_slots]``), and ``save_bytes`` of each
        of the first ``k - n_slots + 1`` of them, summed: the prompts their slots hold
        when the starts after theirs save them. ``behind``'s tokens shared are those
        this request may reuse under its adapters (none when they differ: see
        `Candidate.shared`); with no request ahead, the slot's own adapters decide. (An
        aLoRA's cap on the reuse is left to the caller: `alora_most`.)"""
        order = sorted(range(len(self.slots)), key=lambda i: self.slots[i].last_used)
        slot = order[k % len(order)]
        if behind is None:
            n_slot = self.slots[slot].n_tokens
            lcp = min(slot_lcp.get(slot, 0), n_slot)
        else:
            lcp, n_slot = behind
        entry, got, displaced, saved, destroyed = None, lcp, 0, False, 0
        if n_slot == 0 or self._saves(n_slot, lcp, n_prompt, pinned=False):
            saved = n_slot > 0
            displaced = n_slot - lcp
            # each start before ours saves what its slot held (taken as another
            # conversation's), then ours saves its own: the oldest entries make room
            pushed = sum(self.save_bytes(self.slots[i].n_tokens)
                         for i in order[:k + 1])  # (their checkpoints not foreseen)
            gone = self._fifo_evicted(pushed + (ahead_saved if behind is not None else 0))
            entry, got = self._best_ram(ram_lcp, n_prompt, lcp, n_slot, gone)
        elif behind is None and lcp < n_slot:
            destroyed = self._unique_tail(slot, lcp, lcp, n_prompt)
        recompute = False
        if behind is None and self.lora_global and self.clears(slot, lora):
            got = 0
        elif self.lora_global and self._foreign(entry, lora):
            got, recompute = 0, True
        if self.checkpointed and got:
            if entry is not None:
                got = self._from_entry(entry, got, n_prompt)
            elif behind is None:
                got = self._from_slot(slot, got, n_prompt)
            else:  # the prompt of a request ahead, its checkpoints not foreseen
                got = reusable(self.cap.memory, got, n_prompt, n_slot, (), 0).n_past
        reuse = max(0, min(got, n_prompt - 1))
        tier = "none" if reuse == 0 else ("ram" if entry is not None else "slot")
        return Placement(slot, reuse, tier, entry, displaced, saved, destroyed, recompute,
                         n_slot)

    def alora_most(self, lora: Lora | None, prompt: bytes) -> int | None:
        """The most a request under ``lora`` of ``prompt`` (token bytes) reuses because an
        aLoRA it names runs from its invocation (None: no such limit)."""
        if not self.cap.alora or not prompt:
            return None
        return launched(self.lora_set(lora), self.cap.alora, prompt)[1]

    def clears(self, slot: int, lora: Lora | None) -> bool:
        """A request naming ``lora`` (None: the global scales, which kvroute names for
        it) finds ``slot`` cleared: the slot's last request ran under another set (that
        an aLoRA does not keep: see proxy/routing/cache/lora.py)."""
        return should_clear(self.slots[slot].lora, self.lora_set(lora), self.cap.alora)

    def _foreign(self, entry: int | None, lora: Lora | None) -> bool:
        """Was RAM entry ``entry`` made under adapters whose KV ``lora``'s cannot use
        (those a slot of the entry's set would be cleared for)?"""
        return entry is not None and should_clear(self.ram_lora.get(entry, ()),
                                                  self.lora_set(lora), self.cap.alora)

    def lora_set(self, lora: Lora | None) -> Scales:
        """The adapters a request naming ``lora`` (None: no `lora` field) runs under."""
        return self.lora_global if lora is None else scales(lora, len(self.lora_global))

    def save_bytes(self, n_tokens: int) -> int:
        """The bytes a save of a slot holding ``n_tokens`` adds to the RAM tier (0: none)."""
        return self.cap.entry_bytes(n_tokens) if n_tokens and self._can_save(n_tokens) else 0

    def _from_slot(self, slot: int, lcp: int, n_prompt: int) -> int:
        """What a checkpointed slot's memory gives of ``lcp`` shared tokens."""
        s = self.slots[slot]
        return reusable(self.cap.memory, lcp, n_prompt, s.n_tokens, s.checkpoints,
                        s.floor).n_past

    def _from_entry(self, e: int, lcp: int, n_prompt: int) -> int:
        """What a checkpointed RAM entry gives of ``lcp`` shared tokens once loaded."""
        mem, n = self.cap.memory, self.ram[e]
        return reusable(mem, lcp, n_prompt, n, self.ram_checkpoints.get(e, ()),
                        loaded_floor(mem, n)).n_past

    def _can_save(self, n_tokens: int, n_checkpoints: int = 0) -> bool:
        limit = self.cap.ram_cache_bytes
        return limit > 0 and self.cap.entry_bytes(n_tokens, n_checkpoints) <= limit

    def entry_size(self, e: int) -> int:
        """Bytes of RAM entry ``e`` (with its checkpoints)."""
        return self.cap.entry_bytes(self.ram[e], len(self.ram_checkpoints.get(e, ())))

    def _set_kept(self, slot: int, lora: Lora | None) -> bool:
        """Is a slot of ``slot``'s adapters left once a request under ``lora`` takes it
        (it, or another)? Else its owner's next request, naming them, finds every slot
        cleared for it, and a RAM copy of its content is of no use."""
        if not self.lora_global:
            return True
        own = self.slots[slot].lora
        inv = self.cap.alora
        return not should_clear(self.lora_set(lora), own, inv) or any(
            i != slot and not should_clear(s.lora, own, inv) for i, s in enumerate(self.slots))

    def _unique_tail(self, slot: int, lcp: int, new_lcp: int, n_new: int,
                     ram_ok: bool = True) -> int:
        """Tokens of ``slot``'s sequence beyond its first ``lcp`` that no other holder
        keeps: another slot (any backend), another backend's RAM entry, or one of this
        backend's RAM entries that a later request could still load (``ram_ok``: a slot
        of its adapters is left to load it into).
        ``new_lcp``/``n_new``: what the slot will hold instead (tokens shared
        with the old sequence, length)."""
        s = self.slots[slot]
        h = self.slot_holder(slot)
        name = self.cap.name
        tree = self.tree

        def local_ram(x: object) -> bool:
            return x[0] == name and x[1] == RAM  # type: ignore[index]

        other = tree.shared_len(h, local_ram)
        if max(lcp, other) >= s.n_tokens:
            return 0
        with_ram = tree.shared_len(h)
        if with_ram > other and ram_ok and self._ram_loadable(slot, new_lcp, n_new):
            other = with_ram
        return max(0, s.n_tokens - max(lcp, other))

    def _ram_loadable(self, slot: int, new_lcp: int, n_new: int) -> bool:
        """Could the owner of ``slot``'s sequence, coming back (a longer prompt), load it
        from this backend's RAM tier once ``slot`` holds the new prompt? Only through a
        slot that the server saves first (shares < keep_threshold of its own tokens, or
        too little of the prompt to be picked by similarity), or an empty one that an
        unpinned request reaches by LRU (no slot is similar enough to be picked first).
        With every slot holding the same family's prompts, the RAM copy is unreachable."""
        h = self.slot_holder(slot)
        n_own = max(1, self.slots[slot].n_tokens)
        thr, keep = self.rules.slot_similarity, self.rules.keep_threshold
        empty, similar = False, False
        for i, s in enumerate(self.slots):
            if i == slot:
                n_i, cp = n_new, new_lcp
            else:
                n_i = s.n_tokens
                cp = self.tree.common_prefix(self.slot_holder(i), h) if n_i else 0
            if n_i == 0:
                empty = True
                continue
            if cp <= thr * n_own or cp < keep * n_i:
                return True
            similar = True
        return empty and not similar

    def _best_ram(
        self, ram_lcp: dict[int, int], n_prompt: int, lcp: int, n_slot: int,
        gone: AbstractSet[int],
    ) -> tuple[int | None, int]:
        """server_prompt_cache::load: the entry beating the slot on kept fraction and sim."""
        if not ram_lcp:
            return None, lcp
        f_best = lcp / n_slot if n_slot else 0.0
        best, got = None, lcp
        ram, min_share = self.ram, self.rules.ram_min_share
        # the server scans its entries oldest first and a later one must beat the best so
        # far on both counts, so the order decides between two that each win on one;
        # entry ids grow with each save and a loaded entry leaves: id order is that order
        for e in sorted(ram_lcp):
            n_lcp = ram_lcp[e]
            # sim = n_lcp / n_prompt must beat the best's, got / n_prompt: most entries
            # share only the template's first tokens and stop here
            if n_lcp <= got:
                continue
            n_entry = ram.get(e)
            if n_entry is None or e in gone:
                continue
            f = n_lcp / n_entry
            if f >= min_share and f > f_best:
                best, got, f_best = e, n_lcp, f
        return best, got

    def _evicted_by_save(self, slot: int) -> AbstractSet[int]:
        """RAM entries the LRU would drop to make room for a saved slot (approximate:
        ignores entries the save removes as prefixes, so it may over-estimate)."""
        s = self.slots[slot]
        if s.ram_copy is not None and s.ram_copy in self.ram:
            return set()  # already saved: the server skips the save
        n, k = s.n_tokens, len(s.checkpoints)
        return self._fifo_evicted(self.cap.entry_bytes(n, k) if n and self._can_save(n, k)
                                  else 0)

    def _fifo_evicted(self, new: int) -> AbstractSet[int]:
        """RAM entries the byte LRU drops, oldest first, to take in ``new`` bytes."""
        limit = self.cap.ram_cache_bytes
        if limit == 0 or self.ram_bytes + new <= limit:
            return set()
        if new >= limit:
            # all of them (a queue of long prompts ahead, typically), without a walk
            # over every entry; a view: read at once, before anything changes
            return self.ram.keys()
        gone, freed, need = set(), 0, self.ram_bytes + new - limit
        for e in self.ram:
            if freed >= need:
                break
            gone.add(e)
            freed += self.entry_size(e)
        return gone
