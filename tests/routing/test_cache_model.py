"""Cache model: llama-server's slots and RAM prompt cache, as observed on the pinned build."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from proxy.routing.cache.model import BackendCache
from proxy.routing.cache.values import RAM, SLOT, BackendCapacity, Placement, ServerRules
from proxy.routing.tree.radix import RadixTree
from proxy.routing.tree.token_bytes import to_token_bytes

KVB = 8192  # demo model: 8 KiB of KV per token
TEMPLATE = [1, 2, 3]  # chat-template tokens every prompt starts with
A = TEMPLATE + list(range(1000, 1812))  # 815 tokens
B = TEMPLATE + list(range(2000, 2812))  # 815 tokens
U = TEMPLATE + list(range(3000, 3055))  # unrelated 58-token prompt
GEN = [7, 7, 7, 7]  # generated tokens


def lcps(cache: BackendCache, prompt: list[int]) -> tuple[dict[int, int], dict[int, int]]:
    slot_lcp: dict[int, int] = {}
    ram_lcp: dict[int, int] = {}
    for (_, kind, idx), n in cache.tree.match(prompt).held.items():  # type: ignore[misc]
        (slot_lcp if kind == SLOT else ram_lcp)[idx] = n
    return slot_lcp, ram_lcp


def run(
    cache: BackendCache, prompt: list[int], slot: int | None, gen: list[int] = GEN
) -> Placement:
    p = cache.start(slot, to_token_bytes(prompt), *lcps(cache, prompt), len(prompt))
    assert p is not None
    cache.finish(p.slot, to_token_bytes(prompt + gen), len(prompt) + len(gen))
    return p


def make(
    slots: int = 2, ram_bytes: int = 8192 << 20, idle: bool = True, unified: bool = False
) -> BackendCache:
    rules = ServerRules(cache_idle_slots=idle, kv_unified=unified)
    return BackendCache(BackendCapacity("b0", slots, 4096, ram_bytes, KVB), RadixTree(), rules)


def test_observed_on_pinned_build() -> None:
    """The six steps of the notes' table, in order, with the reuse the server reported."""
    c = make()
    run(c, U, 1)  # slot 1 holds an unrelated 58-token prompt before the experiment
    steps = [
        (A, 0, 0, 0, "none"),  # 1: cold
        (B, 0, 3, 0, "slot"),  # 2: A displaced to the RAM cache
        (A, 1, 814, 1, "ram"),  # 3: loaded from RAM (U saved in its place)
        (A, 0, 3, 0, "slot"),  # 4: A's RAM entry was consumed; slot 1's copy not shared
        (B, None, 814, 1, "ram"),  # 5: LRU slot 1, B saved by step 4, loaded
        (A, None, 814, 0, "slot"),  # 6: LCP pick of the slot holding A
    ]
    for i, (prompt, pin, reuse, slot, tier) in enumerate(steps, 1):
        p = run(c, prompt, pin)
        assert (p.reuse, p.slot, p.tier) == (reuse, slot, tier), f"step {i}: {p}"


def test_ram_entry_moves_not_copies() -> None:
    c = make(idle=False)  # --no-cache-idle-slots: only displaced slots are saved
    run(c, U, 1)
    run(c, A, 0)
    run(c, B, 0)  # A -> RAM
    assert list(c.ram.values()) == [len(A) + len(GEN)]
    p = run(c, A, 1)  # loaded into slot 1 (U saved): gone from RAM
    assert p.tier == "ram"
    held = c.tree.match(A).held
    assert held[("b0", SLOT, 1)] == len(A)
    assert all(n <= 3 for h, n in held.items() if h[1] == RAM)
    assert sorted(c.ram.values()) == [len(U) + len(GEN)]


def test_pinned_empty_slot_skips_ram_but_unpinned_uses_it() -> None:
    c = make(slots=3)
    run(c, A, 0)
    run(c, B, 0)  # A in RAM, slots 1 and 2 empty
    assert c.predict(1, *lcps(c, A), len(A)) == Placement(1, 0, "none", None, 0)
    p = c.predict(None, *lcps(c, A), len(A))
    # LRU among never-used slots: the server keeps the last of equals (`<=`)
    assert p is not None and (p.slot, p.reuse, p.tier) == (2, 814, "ram")


def test_ram_candidate_needs_quarter_of_its_tokens() -> None:
    c = make()
    long_a = A + list(range(5000, 8000))  # 3815 tokens; A is < 25% of it
    run(c, long_a, 0)
    run(c, B, 0)  # long_a -> RAM
    p = c.predict(0, *lcps(c, U), len(U))  # nothing shared but the template
    assert p is not None and p.tier == "slot" and p.reuse == 3
    p = c.predict(0, *lcps(c, [*A, 9]), len(A) + 1)  # shares 815/3819 < 25%
    assert p is not None and p.ram_entry is None and p.reuse == 3


@pytest.mark.parametrize("keep_first_older", [True, False])
def test_ram_load_scans_entries_oldest_first(keep_first_older: bool) -> None:
    """One entry keeps more of itself, the other shares more of the prompt: the server
    takes whichever it meets first, as a later one must beat it on both counts."""
    prompt = TEMPLATE + list(range(4000, 4400))
    keeps = prompt[:80] + list(range(6000, 6020))  # f_keep 0.8, shares 80
    shares = prompt[:90] + list(range(7000, 7210))  # f_keep 0.3, shares 90
    c = make()
    first, second = (keeps, shares) if keep_first_older else (shares, keeps)
    run(c, first, 0, gen=[])
    run(c, second, 1, gen=[])  # idle slot 0 saved: `first` is the older entry
    run(c, U, 0, gen=[])  # idle slot 1 saved: `second`; slot 0 holds U
    assert sorted(c.ram.values()) == sorted([len(first), len(second)])
    slot_lcp, ram_lcp = lcps(c, prompt)
    for listed in (ram_lcp, dict(reversed(ram_lcp.items()))):  # as the tree lists them
        p = c.predict(0, slot_lcp, listed, len(prompt))  # U saved (already), then a load
        assert p is not None and p.tier == "ram"
        assert p.reuse == (80 if keep_first_older else 90)


@pytest.mark.parametrize(
    ("ram_tokens", "want_entries"),
    [
        (0, 0),  # no RAM tier: displaced content is gone
        (500, 0),  # entry larger than the whole cache is skipped
        (1000, 1),  # room for exactly one: LRU keeps the newest
        (10_000, 2),
    ],
)
def test_ram_lru_by_bytes(ram_tokens: int, want_entries: int) -> None:
    c = make(slots=1, ram_bytes=ram_tokens * KVB)
    run(c, A, 0)
    run(c, B, 0)  # A saved
    run(c, U, 0)  # B saved
    assert len(c.ram) == want_entries
    assert c.ram_bytes <= ram_tokens * KVB
    if want_entries == 1:  # the newest (B) survived
        assert c.tree.match(B).held.get(("b0", RAM, 1)) == len(B)


def test_save_skips_contained_and_drops_prefixes() -> None:
    c = make(idle=False)  # --no-cache-idle-slots: only displaced slots are saved
    long_a = A + [5] * 10
    run(c, long_a, 0, gen=[])
    run(c, B, 0, gen=[])  # RAM: long_a
    run(c, A[:400], 1, gen=[])  # pinned empty slot: no RAM load
    run(c, U, 1, gen=[])  # A[:400] is contained in long_a's entry: not saved
    assert sorted(c.ram.values()) == [len(long_a)]
    run(c, U[:30], 0, gen=[])  # B saved
    run(c, B, 0, gen=[])  # U[:30] saved, B loaded back
    assert sorted(c.ram.values()) == [30, len(long_a)]
    p = run(c, A, 1, gen=[])  # U saved; U[:30] is a prefix of it: obsolete; long_a loaded
    assert (p.tier, p.reuse) == ("ram", len(A) - 1)
    assert sorted(c.ram.values()) == [len(U)]


def test_keep_threshold_keeps_slot_without_saving() -> None:
    c = make(slots=1)
    run(c, A, 0)
    p = run(c, A[:500], 0)  # keeps 500/819 >= 0.5: no save, reuse from the slot
    assert (p.reuse, p.tier, p.displaced, len(c.ram)) == (499, "slot", 0, 0)


# ------------------------------------------------------- --cache-idle-slots (default)
@pytest.mark.parametrize(
    ("idle", "unified", "ram_tokens", "want_ram", "want_slot0"),
    [
        (True, False, 10_000, [len(A) + 4], len(A) + 4),  # copied, slot keeps its KV
        (True, True, 10_000, [len(A) + 4], 0),  # unified KV: saved, then cleared
        (False, False, 10_000, [], len(A) + 4),  # --no-cache-idle-slots
        (True, False, 0, [], len(A) + 4),  # no RAM tier: nothing to save to
        (True, False, 500, [], len(A) + 4),  # larger than the whole cache: skipped
    ],
)
def test_idle_slots_saved_when_a_task_starts(
    idle: bool, unified: bool, ram_tokens: int, want_ram: list[int], want_slot0: int
) -> None:
    c = make(slots=3, ram_bytes=ram_tokens * KVB, idle=idle, unified=unified)
    run(c, A, 0)  # slot 0 idle with A + GEN; nothing else was idle with content
    assert len(c.ram) == 0
    p = c.start(1, to_token_bytes(B), *lcps(c, B), len(B))  # B starts: slot 0 is idle
    assert p is not None
    assert sorted(c.ram.values()) == want_ram
    assert c.slots[0].n_tokens == want_slot0
    assert c.tree.held_len(("b0", SLOT, 0)) == want_slot0
    assert c.tree.held_len(("b0", SLOT, 1)) == len(B)  # the busy slot is never saved
    if want_ram:
        assert c.tree.match(A).held[("b0", RAM, next(iter(c.ram)))] == len(A)


def test_idle_save_is_not_repeated_and_comes_back_after_a_load() -> None:
    c = make(slots=3)
    run(c, A, 0)
    run(c, B, 1)  # A saved (slot 0 idle)
    run(c, U, 2)  # A already saved, B saved now
    assert sorted(c.ram.values()) == [len(A) + 4, len(B) + 4]
    p = run(c, B, 2)  # slot 2 (U) -> B loaded from RAM: the entry moves out
    assert (p.tier, p.reuse) == ("ram", len(B) - 1)
    # U was saved on displacement, then A (still saved) skipped and slot 1 (B) re-saved
    assert sorted(c.ram.values()) == [len(U) + 4, len(A) + 4, len(B) + 4]


def test_busy_holder_prefix_is_loadable_from_its_idle_copy() -> None:
    """The case the router relies on: the prefix sits in a busy slot, yet another slot can
    load it, because the server saved the slot to RAM while it was idle."""
    shared = list(range(10_000, 10_800))  # an 800-token document
    first, second, third = [*shared, 1, 1], [*shared, 2, 2], [*shared, 3, 3]
    for idle, want in [(True, len(shared)), (False, 0)]:
        c = make(slots=3, idle=idle)
        run(c, first, 0)
        run(c, U, 1)  # a task starts while slot 0 is idle: its state is copied to RAM
        p = c.start(0, to_token_bytes(second), *lcps(c, second), len(second))
        assert p is not None and p.tier == "slot"  # keeps the shared part: slot 0 busy
        p = c.predict(None, *lcps(c, third), len(third))
        assert p is not None and p.slot != 0
        assert p.reuse == want, f"cache_idle_slots={idle}"


def state_bytes(n_tokens: int) -> int:
    """llama_state_seq_get_size of a slot holding ``n_tokens``, as the pinned build sizes
    it: 601 demo tokens are a 4.702 MiB entry (its log), 12 bytes a cell over the KV."""
    return n_tokens * (KVB + 12) + 256


class ServerPromptCache:
    """Reference for the RAM tier: server_prompt_cache (server-task.cpp) as whole token
    sequences in a list, oldest first, without the tree or the model's bookkeeping."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit = limit_bytes
        self.states: list[bytes] = []
        self.evicted: list[bytes] = []  # popped from the front to make room

    def save(self, seq: bytes) -> None:
        """slot.prompt_save -> alloc: skip an empty, contained or over-limit state, drop
        the entries it contains, pop the oldest until it fits, append it."""
        size = state_bytes(len(seq) // 4)
        if not seq or size > self.limit or any(s.startswith(seq) for s in self.states):
            return
        self.states = [s for s in self.states if not seq.startswith(s)]
        while self.states and sum(state_bytes(len(s) // 4) for s in self.states) + size > \
                self.limit:
            self.evicted.append(self.states.pop(0))
        self.states.append(seq)

    def load(self, seq: bytes) -> None:
        self.states.remove(seq)  # moved into the slot, not copied


prompts = st.sampled_from([A, B, U, A[:400], A + [5] * 300, B[:200] + U])


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(prompts, st.integers(-1, 2), st.booleans()), max_size=25),
    st.sampled_from([900, 2000, 10_000]),
    st.booleans(),
)
@example(  # saving slot 2 (B) evicts slot 1's copy (U), saved by an earlier start: FIFO
    ops=[
        (A, -1, False),
        (B, 0, False),
        (U, 1, True),
        (A, 1, True),
        (A[:400], 0, True),
        (B, -1, True),
        (A, 0, True),
    ],
    ram_tokens=2000,
    unified=False,
)
def test_ram_invariants(
    ops: list[tuple[list[int], int, bool]], ram_tokens: int, unified: bool
) -> None:
    """Whatever runs: RAM within its bytes, entries' lengths match the tree, no entry is a
    prefix of another (the server skips or drops those), the entries and their FIFO order
    are the server's (ServerPromptCache fed the same saves and loads), and right after a
    task starts every idle slot's state is in RAM unless it is larger than the whole
    cache, or a later save of that same start evicted the (older) entry holding it."""
    c = make(slots=3, ram_bytes=ram_tokens * KVB, unified=unified)
    ref = ServerPromptCache(ram_tokens * KVB)
    running: list[tuple[int, list[int]]] = []
    for prompt, pin, finish_one in ops:
        if finish_one and running:
            slot, done = running.pop(0)
            c.finish(slot, to_token_bytes(done + GEN), len(done) + len(GEN))
        slot = None if pin < 0 else pin
        if slot is not None and c.slots[slot].busy:
            continue
        held = [c.tree.tokens_of(("b0", SLOT, i)) for i in range(len(c.slots))]
        before = {e: c.tree.tokens_of(("b0", RAM, e)) for e in c.ram}
        p = c.start(slot, to_token_bytes(prompt), *lcps(c, prompt), len(prompt))
        if p is None:
            continue
        running.append((p.slot, prompt))
        idle = [i for i, s in enumerate(c.slots) if not s.busy]
        # the same start on the reference (server-context.cpp): the taken slot's save and
        # load (get_available_slot), then each idle slot's save, in slot order
        ref.evicted.clear()
        if p.saved:
            ref.save(held[p.slot])
        if p.ram_entry is not None:
            assert before[p.ram_entry] in ref.states, "loaded an entry the save evicted"
            ref.load(before[p.ram_entry])
        for i in idle:
            ref.save(held[i])
        assert c.ram_bytes == sum(map(state_bytes, c.ram.values())) <= ram_tokens * KVB
        seqs = {e: c.tree.tokens_of(("b0", RAM, e)) for e in c.ram}
        for e, n in c.ram.items():
            assert len(seqs[e]) == 4 * n
        for e, a in seqs.items():
            assert not any(e != f and b.startswith(a) for f, b in seqs.items())
        assert [seqs[e] for e in c.ram] == ref.states
        for i in idle:
            mine = held[i]  # with a unified KV the slot is cleared once saved
            if not mine or len(mine) // 4 > ram_tokens:
                continue  # nothing to save, or skipped: larger than the whole cache
            in_ram = any(b.startswith(mine) for b in seqs.values())
            evicted = any(b.startswith(mine) for b in ref.evicted)
            assert in_ram or evicted, f"slot {i} not saved"


@pytest.mark.parametrize("max_resident", [None, 500])  # 500: the tree evicts the tail
def test_finish_generated_equals_finish_with_the_full_sequence(max_resident: int | None) -> None:
    seen = []
    for generated in (True, False):
        tree = RadixTree(max_resident=max_resident)
        c = BackendCache(BackendCapacity("b0", 2, 4096, 0, KVB), tree)
        run(c, B, 1)
        c.start(0, to_token_bytes(A), *lcps(c, A), len(A))
        if generated:
            c.finish_generated(0, to_token_bytes(GEN))
        else:
            c.finish(0, to_token_bytes(A + GEN), len(A) + len(GEN))
        tree.check()
        seen.append((c.slots[0].n_tokens, tree.tokens_of(("b0", SLOT, 0)), c.slots[0].busy))
    assert seen[0] == seen[1]
    assert seen[0][0] == len(A) + len(GEN)


# ------------------------------------------------- destroyed content, queued placement
SYS = TEMPLATE + list(range(5000, 5800))  # 803 tokens shared by a family of prompts


def conv(i: int) -> list[int]:
    return SYS + list(range(10_000 * i, 10_000 * i + 300))  # 1103 tokens, 300 its own


def _setup(c: BackendCache, steps: list[tuple[list[int], int]]) -> None:
    for prompt, slot in steps:
        run(c, prompt, slot)


@pytest.mark.parametrize(
    ("slots", "ram", "steps", "prompt", "pin", "saved", "destroyed"),
    [
        # kept (shares >= half of the slot): conv 1's own 300 + GEN are truncated
        (2, True, [(conv(1), 0)], conv(2), 0, False, 304),
        # another slot holds conv 1 too (and its idle copy went to RAM): nothing lost
        (2, True, [(conv(1), 0), (conv(1), 1)], conv(2), 0, False, 0),
        # conv 1's idle copy is in RAM and slot 1 (unrelated) can still load it later
        (3, True, [(conv(1), 0), (U, 1)], conv(2), 0, False, 0),
        # in RAM, but every other slot holds the same family: no slot would load it
        (2, True, [(conv(1), 0), (conv(3), 1)], conv(2), 0, False, 304),
        # shares < half of the slot: saved to RAM first, not destroyed
        (2, True, [(conv(1), 0)], SYS[:300] + list(range(20_000, 20_300)), 0, True, 0),
        # ... unless there is no RAM tier: then all but the common prefix is gone
        (2, False, [(conv(1), 0)], SYS[:300] + list(range(20_000, 20_300)), 0, True, 807),
        # an empty slot destroys nothing
        (2, True, [(conv(1), 0)], conv(2), 1, False, 0),
    ],
)
def test_destroyed_counts_unique_content_lost(
    slots: int,
    ram: bool,
    steps: list[tuple[list[int], int]],
    prompt: list[int],
    pin: int,
    saved: bool,
    destroyed: int,
) -> None:
    c = make(slots=slots, ram_bytes=(8192 << 20) if ram else 0)
    _setup(c, steps)
    p = c.predict(pin, *lcps(c, prompt), len(prompt))
    assert p is not None and (p.saved, p.destroyed) == (saved, destroyed), p


def test_pinned_low_similarity_is_saved_even_when_mostly_kept() -> None:
    """Pinned and sharing <= 10% of the prompt: the server takes the kept fraction as 0
    and saves the slot (it keeps its content too: nothing better to load)."""
    c = make()
    short = TEMPLATE + list(range(4000, 4097))  # 100 tokens, +GEN = 104 held
    run(c, short, 0)
    long = short + list(range(6000, 7500))  # shares 100 of 1600 tokens: 6%
    p = c.start(0, to_token_bytes(long), *lcps(c, long), len(long))
    assert p is not None and p.saved and (p.reuse, p.tier) == (100, "slot")
    assert list(c.ram.values()) == [len(short) + len(GEN)]


@pytest.mark.parametrize(
    ("ahead", "prompt", "slot", "reuse", "tier"),
    [
        ([], conv(3), 0, len(SYS), "slot"),  # first to wait: the oldest slot, its prefix
        ([(len(SYS), 1103)], conv(3), 1, len(SYS), "slot"),  # second: the next slot
        # third with 2 slots: the slot the first waiting request will have had
        ([(len(SYS), 1103), (0, 50)], conv(3), 0, len(SYS), "slot"),
        ([(1000, 1103), (0, 50)], conv(3), 0, 1000, "slot"),
        # nothing shared with the slot it gets: LRU path, saves it, loads the RAM entry
        ([], [*U, 1, 2], 0, len(U), "ram"),
    ],
)
def test_predict_queued_lands_in_the_slot_that_frees(
    ahead: list[tuple[int, int]], prompt: list[int], slot: int, reuse: int, tier: str
) -> None:
    c = make()
    run(c, U, 0)  # U (+GEN) is saved to RAM when conv 1 displaces it
    for i, s in ((1, 0), (2, 1)):  # both slots busy, slot 0 started first
        p = conv(i)
        assert c.start(s, to_token_bytes(p), *lcps(c, p), len(p)) is not None
    q = c.predict_queued(*lcps(c, prompt), ahead, len(prompt))
    assert (q.slot, q.reuse, q.tier) == (slot, reuse, tier), q


@pytest.mark.parametrize(("ram_tokens", "reuse"), [(1000, 3), (100_000, len(A) + len(GEN))])
def test_predict_queued_sees_the_saves_before_its_turn(ram_tokens: int, reuse: int) -> None:
    """A's conversation is in RAM and both slots are busy: when a slot frees, the server
    saves what it held before loading, and a RAM tier with room for one entry then has
    only that one left."""
    c = make(ram_bytes=ram_tokens * KVB)
    run(c, A, 0)
    run(c, B, 0)  # A saved: the only entry
    assert list(c.ram.values()) == [len(A) + len(GEN)]
    for slot, p in ((0, [*B, *GEN, 9]), (1, U)):  # slot 0 goes on with B: no save
        assert c.start(slot, to_token_bytes(p), *lcps(c, p), len(p)) is not None
    assert len(c.ram) == 1
    prompt = [*A, *GEN, 5]
    q = c.predict_queued(*lcps(c, prompt), [], len(prompt))
    assert (q.slot, q.reuse) == (0, reuse), q


def test_only_the_largest_ram_entries_are_matched_and_evictions_stay_exact() -> None:
    """A RAM tier full of small prompts: the tree keeps the `max_tracked` largest entries
    (what one match walks stays bounded), the byte LRU still counts every entry (the same
    entries, in the same order, as with every entry tracked), and a long conversation saved
    before the flood is still loaded whole when it comes back."""
    def flood(c: BackendCache) -> None:
        run(c, A, 0)
        for i in range(30):  # 16+ tokens: the 3 template tokens are < 25% of an entry
            run(c, TEMPLATE + list(range(10_000 + 20 * i, 10_013 + 20 * i + i % 5)), 0)
        run(c, B, 1)

    small, full = make(ram_bytes=4000 * KVB), make(ram_bytes=4000 * KVB)
    small.max_tracked, full.max_tracked = 4, 1000
    flood(small)
    flood(full)
    assert list(small.ram.items()) == list(full.ram.items())
    assert small.ram_bytes == full.ram_bytes
    in_tree = {e for (_, kind, e) in small.tree.holders() if kind == RAM}  # type: ignore[misc]
    largest = sorted(small.ram, key=lambda e: (small.ram[e], e))[-4:]
    assert in_tree == set(largest)
    assert len(small.tree.match([*TEMPLATE, 1]).held) <= len(small.slots) + 4
    assert len(full.tree.match([*TEMPLATE, 1]).held) > 30
    p = run(small, A, 0)
    assert (p.tier, p.reuse) == ("ram", len(A) - 1)


def test_ram_entries_of_track_min_tokens_are_matched_beyond_the_count() -> None:
    """The count bound drops only small entries: every entry of at least
    `track_min_tokens` stays matched (what a RAM load saves most on; their number is
    bounded by the RAM's size). Tracking only the 64 largest cost the Mooncake replay 6.5
    points of hit ratio."""
    c = make(ram_bytes=100_000 * KVB)
    c.max_tracked, c.track_min_tokens = 2, 100
    for i in range(5):  # each run saves the previous prompt of slot 0 to RAM
        run(c, TEMPLATE + list(range(50_000 + 1000 * i, 50_120 + 1000 * i)), 0)
    for i in range(5):
        run(c, TEMPLATE + list(range(90_000 + 100 * i, 90_030 + 100 * i)), 0)
    in_tree = {e for (_, kind, e) in c.tree.holders() if kind == RAM}  # type: ignore[misc]
    large = {e for e, n in c.ram.items() if n >= 100}
    assert len(large) == 5 and len(c.ram) == 9
    assert in_tree == large  # all large ones; no room left under the count for small ones
    p = run(c, TEMPLATE + list(range(50_000, 50_130)), None)  # the first one, extended
    assert (p.tier, p.reuse) == ("ram", 123)
