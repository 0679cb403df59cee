"""What one llama-server backend's slots and host-RAM prompt cache hold.

Mirrors the pinned build (../shared/notes/llama-server.md, "Slots", "The prompt cache",
"Observed on the pinned build"):

- A slot holds one sequence (prompt + generated tokens). A new request reuses the longest
  common prefix, but never the whole prompt (``reuse <= prompt - 1``).
- If the new prompt keeps less than ``keep_threshold`` (0.5) of the slot's tokens, the
  slot's state is *saved* to the RAM cache first (unless an entry already contains it;
  entries that are prefixes of it are removed; an entry larger than the cache is
  skipped) and the cache is LRU-evicted by bytes (``BackendCapacity.entry_bytes``).
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
- A request under other LoRA adapters than the slot's last request ran under finds the
  slot cleared once chosen (after any save and load): it reuses nothing
  (proxy/routing/cache/lora.py).
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

The sequences themselves live in a shared :class:`~proxy.routing.tree.radix.RadixTree` under holders
``(backend, SLOT, i)`` and ``(backend, RAM, entry_id)``; this class keeps the lengths the
server has (the tree may have evicted tails); proxy/routing/cache/ram.py keeps the RAM
LRU order. No I/O.

Predictions (pure) are in proxy/routing/cache/predict.py, the value types in
proxy/routing/cache/values.py; this module holds the slots' state and applies what
happens when requests start and end.
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Sequence

from proxy.routing.cache.checkpoints import (
    Resumed,
    created,
    loaded_floor,
    media_spans,
    reusable,
    surviving,
)
from proxy.routing.cache.lora import Lora, Scales, launched
from proxy.routing.cache.ram import RamTier
from proxy.routing.cache.values import (
    PLAIN,
    BackendCapacity,
    Launch,
    Placement,
    ServerRules,
    Slot,
)
from proxy.routing.tree.radix import RadixTree


class BackendCache(RamTier):
    """Model of one backend's slots and RAM prompt cache."""

    def __init__(self, cap: BackendCapacity, tree: RadixTree, rules: ServerRules | None = None,
                 *, max_tracked: int = 64, track_min_tokens: int = 1024):
        self.cap = cap
        self.tree = tree
        self.rules = rules or ServerRules()
        self._init_ram(max_tracked, track_min_tokens)
        self.slots = [Slot() for _ in range(cap.n_slots)]
        # indices of the idle slots, ascending; read-only outside start/_free/clear (the
        # policy scans them for every request and backend, and most slots are busy)
        self.idle: list[int] = list(range(cap.n_slots))
        self.checkpointed = cap.memory.checkpointed
        self.lora_global = cap.lora
        # while a checkpointed slot is busy: where its prompt resumed, to place its
        # checkpoints again once the whole prompt is known (see extend_prompt)
        self._ck_start: dict[int, Resumed] = {}
        # the set each slot's last request named, on a backend with aLoRAs (the set it
        # keeps depends on the whole prompt, which a head does not hold)
        self._named: dict[int, Scales] = {}
        self._clock = 0
        self.starts = 0  # tasks started so far (see `saved_idle`)
        # the RAM entries the last `start` created (still in RAM): the server creates
        # them only when it launches that task (see proxy/routing/posting.py)
        self.created: tuple[int, ...] = ()

    # ---------------------------------------------------------------- effects
    def start(
        self,
        slot: int | None,
        prompt: bytes,
        slot_lcp: dict[int, int],
        ram_lcp: dict[int, int],
        n_prompt: int,
        predicted: Placement | None = None,
        launch: Launch = PLAIN,
    ) -> Placement | None:
        """Apply a request starting now: the slot becomes busy and holds the prompt.

        ``predicted``: what ``predict`` just returned for these same arguments (saves
        computing it again). ``launch``: where the prompt's user messages start (the
        server checkpoints there; see proxy/routing/cache/checkpoints.py) and the
        adapters it names."""
        user_starts, lora = launch
        p = predicted or self.predict(slot, slot_lcp, ram_lcp, n_prompt, lora=lora,
                                      prompt=prompt)
        if p is None:
            return None
        first = self._next_entry
        s = self.slots[p.slot]
        cleared = self.clears(p.slot, lora)
        kept_set, most = self._launched(p.slot, lora, prompt, n_prompt)
        if p.saved:
            gone = self._save(p.slot)
            lcp = min(slot_lcp.get(p.slot, 0), s.n_tokens)
            entry, got = self._best_ram(ram_lcp, n_prompt, lcp, s.n_tokens, gone)
            reuse, tier, recompute = self.landed(p.slot, entry, got, n_prompt, lora, prompt)
            p = Placement(p.slot, reuse, tier, entry, p.displaced, True, p.destroyed,
                          recompute, p.held)
        if self.checkpointed:
            # (a cleared slot keeps none of its checkpoints, nor of the entry loaded; an
            # aLoRA's resumes no later than its invocation)
            kept = {} if cleared else _at_most(slot_lcp, most)
            self._start_checkpoints(p, kept, {} if cleared else _at_most(ram_lcp, most),
                                    prompt, n_prompt, user_starts)
        if p.ram_entry is not None:
            self._load_entry(p.ram_entry, p.slot)
        self.tree.assign(self.slot_holder(p.slot), prompt)
        s.n_tokens = n_prompt
        s.ram_copy = None
        s.prompt = prompt
        s.busy = True
        s.lora = kept_set
        self.idle.remove(p.slot)
        self._clock += 1
        s.last_used = self._clock
        self.starts += 1
        if self.rules.cache_idle_slots and self.cap.ram_cache_bytes:
            for i in self.idle:
                self._save_idle_slot(i)
        self.created = tuple(e for e in range(first, self._next_entry) if e in self.ram)
        return p

    def _launched(self, slot: int, lora: Lora | None, prompt: bytes, n_prompt: int
                  ) -> tuple[Scales, int | None]:
        """The set ``slot`` keeps once a request under ``lora`` launches there, and the
        most it reuses (see proxy/routing/cache/lora.py `launched`). Of a prompt's head,
        the set as named (the invocation lies in the rest, `extend_prompt`)."""
        named = self.lora_set(lora)
        if not self.cap.alora:
            return named, None
        self._named[slot] = named
        return launched(named, self.cap.alora, prompt) if n_prompt == len(prompt) // 4 \
            else (named, None)

    def correct(self, slot: int, prompt: bytes, slot_lcp: dict[int, int],
                ram_lcp: dict[int, int], n_prompt: int, launch: Launch = PLAIN
                ) -> Placement | None:
        """A request placed where the server says it ran: a correction of the model, as
        `start` applies it, but no task the server starts now (see `starts`)."""
        p = self.start(slot, prompt, slot_lcp, ram_lcp, n_prompt, launch=launch)
        if p is not None:
            self.starts -= 1
        return p

    def _start_checkpoints(self, p: Placement, slot_lcp: dict[int, int],
                           ram_lcp: dict[int, int], prompt: bytes, n_prompt: int,
                           user_starts: Sequence[int]) -> None:
        """The checkpoints a starting request leaves in its slot: those of what it reuses
        (the slot's, or the loaded RAM entry's) up to where it resumes, then the ones its
        prompt creates."""
        mem, s = self.cap.memory, self.slots[p.slot]
        if p.ram_entry is not None:
            held = self.ram[p.ram_entry]
            base, floor = self.ram_checkpoints.get(p.ram_entry, ()), loaded_floor(mem, held)
            lcp = ram_lcp.get(p.ram_entry, 0)
        else:
            held, base, floor = s.n_tokens, s.checkpoints, s.floor
            lcp = min(slot_lcp.get(p.slot, 0), held)
        r = reusable(mem, lcp, n_prompt, held, base, floor)
        kept = surviving(base, r.pos_next)
        resumed = self._ck_start[p.slot] = Resumed(p.reuse, kept, r.floor)
        s.checkpoints = created(mem, n_prompt, resumed, user_starts, self._clock + 1,
                                media_spans(prompt))
        s.floor = r.floor

    def held(self, slot: int) -> bytes | None:
        """What an idle slot is known to hold (int32 token bytes), None when busy or
        empty."""
        s, h = self.slots[slot], self.slot_holder(slot)
        # (what the model knows: the server may hold more, e.g. an answer it could not
        # tokenize; a prefix of the truth, so a claim from it is never too high)
        if s.busy or s.n_tokens == 0 or self.tree.held_len(h) == 0:
            return None
        return self.tree.tokens_of(h)

    def common_part(self, slot: int) -> int:
        """Leading tokens of ``slot``'s sequence that another holder has too (its own copy
        in RAM and disk files aside): a system prompt other conversations share. Past
        them, the sequence is the conversation's own."""
        copy = None if self.slots[slot].ram_copy is None \
            else self.ram_holder(self.slots[slot].ram_copy)

        def ignore(h: object) -> bool:
            return h == copy or h[0] == ""  # type: ignore[index]

        return self.tree.shared_len(self.slot_holder(slot), ignore)

    def seed(self, slot: int, sequence: bytes) -> bool:
        """An empty idle slot was given ``sequence`` by a restore from disk (no task ran:
        nothing is saved to RAM). False, and nothing changes, if the slot is in use."""
        s = self.slots[slot]
        if s.busy or s.n_tokens or not sequence:
            return False
        self.tree.assign(self.slot_holder(slot), sequence)
        s.n_tokens = len(sequence) // 4
        s.checkpoints, s.floor = (), loaded_floor(self.cap.memory, s.n_tokens)
        self._clock += 1
        s.last_used = self._clock
        return True

    def restore(self, slot: int, sequence: bytes) -> None:
        """An idle slot's content is replaced by ``sequence`` read from disk (the server
        saves nothing of the old content: a restore is not a task)."""
        s = self.slots[slot]
        assert not s.busy, "restored into a busy slot"
        self.tree.assign(self.slot_holder(slot), sequence)
        s.n_tokens = len(sequence) // 4
        s.ram_copy = None
        s.checkpoints, s.floor = (), loaded_floor(self.cap.memory, s.n_tokens)

    def extend_prompt(self, slot: int, prompt: bytes, user_starts: Sequence[int] = ()
                      ) -> int | None:
        """A busy slot's prompt turns out longer: ``prompt`` extends what it started
        with (the request was decided on the prompt's head, see Router.extend). Returns
        the most the request reuses, as an aLoRA it names runs from its invocation (None:
        no such limit)."""
        s = self.slots[slot]
        if not s.busy or s.prompt is None or not prompt.startswith(s.prompt):
            return None
        h = self.slot_holder(slot)
        if self.tree.held_len(h) * 4 == len(s.prompt):
            self.tree.extend(h, prompt[len(s.prompt):])
        else:  # the tree evicted part of the head: assign it in full
            self.tree.assign(h, prompt)
        s.prompt = prompt
        s.n_tokens = len(prompt) // 4
        resumed = self._ck_start.get(slot)
        if resumed is not None:
            s.checkpoints = created(self.cap.memory, s.n_tokens, resumed, user_starts,
                                    s.last_used, media_spans(prompt))
        named = self._named.get(slot)
        if named is None:
            return None
        s.lora, most = launched(named, self.cap.alora, prompt)
        return most

    def finish(self, slot: int, sequence: bytes | None, n_tokens: int) -> None:
        """The request in ``slot`` ended; the slot now holds ``sequence`` (None: unknown)."""
        s = self.slots[slot]
        prompt = self._free(slot)
        h = self.slot_holder(slot)
        if sequence is None:
            # NOTE: content unknown (aborted): claiming nothing is the safe error
            self.tree.drop(h)
            s.n_tokens = 0
            s.checkpoints, s.floor = (), 0
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
        self._ck_start.pop(slot, None)
        return prompt

    def clear(self) -> None:
        """Forget everything (backend gone or restarted)."""
        for i in range(len(self.slots)):
            self.tree.drop(self.slot_holder(i))
        for e in list(self.ram):
            self._drop_entry(e)
        self.slots = [Slot() for _ in range(self.cap.n_slots)]
        self.idle = list(range(self.cap.n_slots))
        self._ck_start.clear()

    def snapshot(self) -> dict[str, object]:
        return {
            "slots": [
                {"id": i, "busy": s.busy, "tokens": s.n_tokens,
                 **({"checkpoints": [c.n_tokens for c in s.checkpoints]}
                    if self.checkpointed else {})}
                for i, s in enumerate(self.slots)
            ],
            "ram_entries": [{"id": e, "tokens": n} for e, n in self.ram.items()],
            "ram_bytes": self.ram_bytes,
            "ram_cache_bytes": self.cap.ram_cache_bytes,
        }


def _at_most(lcp: dict[int, int], most: int | None) -> dict[int, int]:
    """``lcp`` with each holder's shared tokens no more than ``most`` (None: as it is)."""
    return lcp if most is None else {k: min(v, most) for k, v in lcp.items()}
