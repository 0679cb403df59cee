"""What one llama-server backend's slots and host-RAM prompt cache hold.

Mirrors the pinned build (../shared/notes/llama-server.md, "Slots", "The prompt cache",
"Observed on the pinned build"):

- A slot holds one sequence (prompt + generated tokens). A new request reuses the longest
  common prefix, but never the whole prompt (``reuse <= prompt - 1``).
- If the new prompt keeps less than ``keep_threshold`` (0.5) of the slot's tokens, the
  slot's state is *saved* to the RAM cache first (unless an entry already contains it;
  entries that are prefixes of it are removed; an entry larger than the cache is
  skipped) and the cache is LRU-evicted by bytes (tokens * kv_bytes_per_token).
- Then the best RAM entry is *loaded* (moved out of the cache, not copied): candidates
  share >= 25% of their own tokens with the prompt and must beat the slot's current
  state on both kept fraction and similarity.
- The save-then-load step runs whenever the server does not select the slot by similarity:
  an unpinned request that lands by LRU, or a pinned one sharing no more than
  ``slot_similarity`` of its prompt with the slot (its kept fraction is then taken as 0).
- A request pinned to an *empty* slot does not consult the RAM cache (upstream #28139).
- If the slot is kept (not saved), the tail of its sequence beyond the common prefix is
  truncated: gone for good unless another slot or a (loadable) RAM entry holds it.
  ``Placement.destroyed`` counts those tokens, so the policy can charge for them.
- ``--cache-idle-slots`` (default on): once a request has taken its slot, every *idle*
  slot's state is saved to the RAM cache too (same rules as above; with a unified KV
  cache the slot is then cleared, otherwise it keeps its copy). So the prefix of a slot
  that has since become busy is usually still loadable from RAM by another slot
  (server-context.cpp, ``__TEST_TAG_CACHE_IDLE_SLOT__``).
- Unpinned: the idle slot with the highest LCP similarity (lcp / prompt) above 0.10,
  otherwise the least recently used idle slot (never-used slots first, the last of equals).
- A request the server cannot place is deferred; when a slot is released the oldest
  deferred request is retried and lands in the idle slot(s) by the rules above
  (``predict_queued`` guesses which slot that will be, at decision time).

The sequences themselves live in a shared :class:`~proxy.tree.RadixTree` under holders
``(backend, SLOT, i)`` and ``(backend, RAM, entry_id)``; this class keeps the lengths the
server has (the tree may have evicted tails) and the RAM LRU order. No I/O.
"""

from __future__ import annotations

from bisect import insort
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

from proxy.tree import RadixTree

SLOT = 0
RAM = 1
PENDING = 2  # a queued request's prompt, recorded before it has a slot (router-level)

Holder = tuple[str, int, int]  # (backend, kind, index)


@dataclass(frozen=True)
class BackendCapacity:
    name: str
    n_slots: int
    slot_ctx: int  # tokens per slot
    ram_cache_bytes: int  # 0 = no RAM tier
    kv_bytes_per_token: int

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name: must be non-empty")
        if self.n_slots < 1:
            raise ValueError("n_slots: must be >= 1")
        if self.slot_ctx < 2:
            raise ValueError("slot_ctx: must be >= 2")
        if self.ram_cache_bytes < 0:
            raise ValueError("ram_cache_bytes: must be >= 0")
        if self.kv_bytes_per_token < 1:
            raise ValueError("kv_bytes_per_token: must be >= 1")


@dataclass(frozen=True)
class ServerRules:
    """llama-server constants this model mirrors (defaults of the pinned build)."""

    keep_threshold: float = 0.5  # below this kept fraction the slot state is saved to RAM
    ram_min_share: float = 0.25  # a RAM entry must share this fraction of its own tokens
    slot_similarity: float = 0.10  # --slot-prompt-similarity for unpinned requests
    cache_idle_slots: bool = True  # --cache-idle-slots: save idle slots when a task starts
    kv_unified: bool = False  # --kv-unified (auto -np): idle slots are cleared once saved


class Placement(NamedTuple):  # not a frozen dataclass: its __init__ is ~4x slower
    """Where a request lands on one backend and what it reuses."""

    slot: int  # slot the request runs in
    reuse: int  # tokens reused (<= prompt - 1)
    tier: str  # "slot" | "ram" | "none"
    ram_entry: int | None  # RAM entry loaded into the slot, if any
    displaced: int  # tokens of the slot's previous content moved out to RAM (when saved)
    saved: bool = False  # the server saves the slot's state to RAM before using it
    destroyed: int = 0  # tokens of the previous content lost for good (held nowhere else)


@dataclass
class _Slot:
    busy: bool = False
    n_tokens: int = 0  # tokens the server holds in this slot
    last_used: int = -1  # logical clock; -1 = never used (picked first by LRU)
    ram_copy: int | None = None  # RAM entry saved from this content (valid while in RAM)
    prompt: bytes | None = None  # while busy: the prompt it started with (finish extends it)


class BackendCache:
    """Model of one backend's slots and RAM prompt cache."""

    def __init__(self, cap: BackendCapacity, tree: RadixTree, rules: ServerRules | None = None):
        self.cap = cap
        self.tree = tree
        self.rules = rules or ServerRules()
        self.slots = [_Slot() for _ in range(cap.n_slots)]
        # indices of the idle slots, ascending; read-only outside start/_free/clear (the
        # policy scans them for every request and backend, and most slots are busy)
        self.idle: list[int] = list(range(cap.n_slots))
        self.ram: OrderedDict[int, int] = OrderedDict()  # entry id -> tokens, oldest first
        self.ram_bytes = 0
        self._next_entry = 0
        self._clock = 0

    # ---------------------------------------------------------------- holders
    def slot_holder(self, i: int) -> Holder:
        return (self.cap.name, SLOT, i)

    def ram_holder(self, e: int) -> Holder:
        return (self.cap.name, RAM, e)

    def idle_slots(self) -> list[int]:
        return list(self.idle)

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
    ) -> Placement | None:
        """Where a request would land and what it would reuse; pure. None: no idle slot."""
        pinned = slot is not None
        if slot is None:
            slot = self.server_pick(slot_lcp, n_prompt)
            if slot is None:
                return None
        s = self.slots[slot]
        assert not s.busy, "never place a request on a busy slot"
        lcp = slot_lcp.get(slot, 0)
        if lcp > s.n_tokens:
            lcp = s.n_tokens
        entry, got, displaced, saved, destroyed = None, lcp, 0, False, 0
        if s.n_tokens > 0 and self._saves(s.n_tokens, lcp, n_prompt, pinned):
            saved = True
            displaced = s.n_tokens - lcp
            gone = self._evicted_by_save(slot)
            entry, got = self._best_ram(ram_lcp, n_prompt, lcp, s.n_tokens, gone)
            if not self._can_save(s.n_tokens):  # no room in RAM: truncated or replaced
                destroyed = self._unique_tail(slot, 0 if entry is not None else lcp, lcp, n_prompt)
        elif s.n_tokens == 0 and not pinned:
            entry, got = self._best_ram(ram_lcp, n_prompt, 0, 0, set())
        elif lcp < s.n_tokens:
            destroyed = self._unique_tail(slot, lcp, lcp, n_prompt)  # kept: tail truncated
        reuse = got if got < n_prompt else n_prompt - 1  # the server never reuses it all
        if reuse < 0:
            reuse = 0
        tier = "none" if reuse == 0 else ("ram" if entry is not None else "slot")
        return Placement(slot, reuse, tier, entry, displaced, saved, destroyed)

    def predict_queued(
        self,
        slot_lcp: dict[int, int],
        ram_lcp: dict[int, int],
        ahead: list[tuple[int, int]],
        n_prompt: int,
    ) -> Placement:
        """Where an unpinned request deferred by the server (no idle slot) will land.

        ``ahead``: (tokens shared with this prompt, prompt tokens) of each request queued
        before it on this backend, oldest first. The server hands a released slot to its
        oldest deferred request; assuming slots free in the order their requests started
        (FIFO service), the k-th waiting request gets the (k mod n_slots)-th slot of that
        order, which then holds the prompt of its current occupant (k < n_slots) or of
        the request k - n_slots ahead. It is the only idle slot then: the server keeps its
        common prefix, or saves it and loads the best RAM entry (the RAM tier as it is
        now: later saves and loads are not foreseen)."""
        order = sorted(range(len(self.slots)), key=lambda i: self.slots[i].last_used)
        k = len(ahead)
        slot = order[k % len(order)]
        if k < len(order):
            n_slot = self.slots[slot].n_tokens
            lcp = min(slot_lcp.get(slot, 0), n_slot)
        else:
            lcp, n_slot = ahead[k - len(order)]
        entry, got, displaced, saved, destroyed = None, lcp, 0, False, 0
        if n_slot == 0 or self._saves(n_slot, lcp, n_prompt, pinned=False):
            saved = n_slot > 0
            displaced = n_slot - lcp
            entry, got = self._best_ram(ram_lcp, n_prompt, lcp, n_slot, set())
        elif k < len(order) and lcp < n_slot:
            destroyed = self._unique_tail(slot, lcp, lcp, n_prompt)
        reuse = max(0, min(got, n_prompt - 1))
        tier = "none" if reuse == 0 else ("ram" if entry is not None else "slot")
        return Placement(slot, reuse, tier, entry, displaced, saved, destroyed)

    def _can_save(self, n_tokens: int) -> bool:
        limit = self.cap.ram_cache_bytes
        return limit > 0 and n_tokens * self.cap.kv_bytes_per_token <= limit

    def _unique_tail(self, slot: int, lcp: int, new_lcp: int, n_new: int) -> int:
        """Tokens of ``slot``'s sequence beyond its first ``lcp`` that no other holder
        keeps: another slot (any backend), another backend's RAM entry, or one of this
        backend's RAM entries that a later request could still load. Pending prompts
        are no KV. ``new_lcp``/``n_new``: what the slot will hold instead (tokens shared
        with the old sequence, length)."""
        s = self.slots[slot]
        h = self.slot_holder(slot)
        name = self.cap.name
        tree = self.tree

        def not_kv_or_local_ram(x: object) -> bool:
            return x[1] == PENDING or (x[0] == name and x[1] == RAM)  # type: ignore[index]

        other = tree.shared_len(h, not_kv_or_local_ram)
        if max(lcp, other) >= s.n_tokens:
            return 0
        with_ram = tree.shared_len(h, lambda x: x[1] == PENDING)  # type: ignore[index]
        if with_ram > other and self._ram_loadable(slot, new_lcp, n_new):
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

    def best_ram(self, ram_lcp: dict[int, int], n_prompt: int) -> tuple[int | None, int]:
        """The RAM entry a freshly displaced slot would load, and its reuse (0: none)."""
        return self._best_ram(ram_lcp, n_prompt, 0, 0, set())

    def _best_ram(
        self, ram_lcp: dict[int, int], n_prompt: int, lcp: int, n_slot: int, gone: set[int]
    ) -> tuple[int | None, int]:
        """server_prompt_cache::load: the entry beating the slot on kept fraction and sim."""
        if not ram_lcp:
            return None, lcp
        f_best = lcp / n_slot if n_slot else 0.0
        sim_best = lcp / n_prompt
        best, got = None, lcp
        for e, n_lcp in ram_lcp.items():
            n_entry = self.ram.get(e)
            if n_entry is None or e in gone:
                continue
            f = n_lcp / n_entry
            if f < self.rules.ram_min_share:
                continue
            sim = n_lcp / n_prompt
            if f > f_best and sim > sim_best:
                best, got, f_best, sim_best = e, n_lcp, f, sim
        return best, got

    def _evicted_by_save(self, slot: int) -> set[int]:
        """RAM entries the LRU would drop to make room for a saved slot (approximate:
        ignores entries the save removes as prefixes, so it may over-estimate)."""
        s = self.slots[slot]
        if s.ram_copy is not None and s.ram_copy in self.ram:
            return set()  # already saved: the server skips the save
        new = s.n_tokens * self.cap.kv_bytes_per_token
        limit = self.cap.ram_cache_bytes
        if limit == 0 or new > limit or self.ram_bytes + new <= limit:
            return set()
        gone, freed, need = set(), 0, self.ram_bytes + new - limit
        for e, n in self.ram.items():
            if freed >= need:
                break
            gone.add(e)
            freed += n * self.cap.kv_bytes_per_token
        return gone

    # ---------------------------------------------------------------- effects
    def start(
        self,
        slot: int | None,
        prompt: bytes,
        slot_lcp: dict[int, int],
        ram_lcp: dict[int, int],
        n_prompt: int,
        predicted: Placement | None = None,
    ) -> Placement | None:
        """Apply a request starting now: the slot becomes busy and holds the prompt.

        ``predicted``: what ``predict`` just returned for these same arguments (saves
        computing it again)."""
        p = predicted or self.predict(slot, slot_lcp, ram_lcp, n_prompt)
        if p is None:
            return None
        s = self.slots[p.slot]
        if p.saved:
            gone = self._save(p.slot)
            lcp = min(slot_lcp.get(p.slot, 0), s.n_tokens)
            entry, got = self._best_ram(ram_lcp, n_prompt, lcp, s.n_tokens, gone)
            reuse = max(0, min(got, n_prompt - 1))
            tier = "none" if reuse == 0 else ("ram" if entry is not None else "slot")
            p = Placement(p.slot, reuse, tier, entry, p.displaced, True, p.destroyed)
        if p.ram_entry is not None:
            n = self.ram.pop(p.ram_entry)
            self.ram_bytes -= n * self.cap.kv_bytes_per_token
            self.tree.move(self.ram_holder(p.ram_entry), self.slot_holder(p.slot))
        self.tree.assign(self.slot_holder(p.slot), prompt)
        s.n_tokens = n_prompt
        s.ram_copy = None
        s.prompt = prompt
        s.busy = True
        self.idle.remove(p.slot)
        self._clock += 1
        s.last_used = self._clock
        if self.rules.cache_idle_slots and self.cap.ram_cache_bytes:
            self._save_idle_slots()
        return p

    def _save_idle_slots(self) -> None:
        """--cache-idle-slots: after a task starts, save every idle slot to RAM."""
        unified = self.rules.kv_unified
        ram = self.ram
        slots = self.slots
        for i in self.idle:
            s = slots[i]
            if s.n_tokens == 0:
                continue
            if s.ram_copy is None or s.ram_copy not in ram:  # else: already saved
                self._save(i, keep=not unified)
            if unified:  # [TAG_IDLE_SLOT_CLEAR]: the slot's KV is freed
                self.tree.drop(self.slot_holder(i))
                s.n_tokens = 0
                s.ram_copy = None

    def finish(self, slot: int, sequence: bytes | None, n_tokens: int) -> None:
        """The request in ``slot`` ended; the slot now holds ``sequence`` (None: unknown)."""
        s = self.slots[slot]
        prompt = self._free(slot)
        h = self.slot_holder(slot)
        if sequence is None:
            # NOTE: content unknown (aborted): claiming nothing is the safe error
            self.tree.drop(h)
            s.n_tokens = 0
            return
        if (
            prompt is not None
            and sequence.startswith(prompt)
            and self.tree.held_len(h) * 4 == len(prompt)
        ):
            self.tree.extend(h, sequence[len(prompt) :])  # prompt + generated tokens
        else:
            self.tree.assign(h, sequence)
        s.n_tokens = n_tokens

    def finish_generated(self, slot: int, generated: bytes) -> None:
        """Like ``finish(slot, prompt + generated, ...)`` for a slot started by ``start``,
        without building that sequence (``generated``: int32 token bytes)."""
        s = self.slots[slot]
        prompt = self._free(slot)
        assert prompt is not None, "the slot was not started by start()"
        h = self.slot_holder(slot)
        if self.tree.held_len(h) * 4 == len(prompt):
            self.tree.extend(h, generated)
        else:  # the tree evicted part of the prompt: assign it in full
            self.tree.assign(h, prompt + generated)
        s.n_tokens = (len(prompt) + len(generated)) // 4

    def _free(self, slot: int) -> bytes | None:
        """Mark a slot idle; returns the prompt it was started with (if known)."""
        s = self.slots[slot]
        if s.busy:
            insort(self.idle, slot)
        s.busy = False
        self._clock += 1
        s.last_used = self._clock
        prompt, s.prompt, s.ram_copy = s.prompt, None, None
        return prompt

    def _save(self, slot: int, keep: bool = False) -> set[int]:
        """server_prompt_cache::alloc + update: save a slot's state; returns entries gone.

        ``keep``: the slot keeps its content (an idle-slot copy); otherwise its holder
        moves to the new entry (the slot is about to be overwritten)."""
        s = self.slots[slot]
        h = self.slot_holder(slot)
        kvb = self.cap.kv_bytes_per_token
        limit = self.cap.ram_cache_bytes
        gone: set[int] = set()
        new_bytes = s.n_tokens * kvb
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
        self.ram_bytes += new_bytes
        while self.ram_bytes > limit and self.ram:
            old = next(iter(self.ram))
            self._drop_entry(old)
            gone.add(old)
        return gone

    def _ram_relations(self, h: Holder) -> list[tuple[int, bool]]:
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
        n = self.ram.pop(e)
        self.ram_bytes -= n * self.cap.kv_bytes_per_token
        self.tree.drop(self.ram_holder(e))

    def clear(self) -> None:
        """Forget everything (backend gone or restarted)."""
        for i in range(len(self.slots)):
            self.tree.drop(self.slot_holder(i))
        for e in list(self.ram):
            self._drop_entry(e)
        self.slots = [_Slot() for _ in range(self.cap.n_slots)]
        self.idle = list(range(self.cap.n_slots))

    def snapshot(self) -> dict[str, object]:
        return {
            "slots": [
                {"id": i, "busy": s.busy, "tokens": s.n_tokens} for i, s in enumerate(self.slots)
            ],
            "ram_entries": [{"id": e, "tokens": n} for e, n in self.ram.items()],
            "ram_bytes": self.ram_bytes,
            "ram_cache_bytes": self.cap.ram_cache_bytes,
        }
