"""Cache model: llama-server's slots and RAM prompt cache, as observed on the pinned build."""

from __future__ import annotations

import pytest

from proxy.cache_model import RAM, SLOT, BackendCache, BackendCapacity, Placement
from proxy.tree import RadixTree, to_token_bytes

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


def make(slots: int = 2, ram_bytes: int = 8192 << 20) -> BackendCache:
    return BackendCache(BackendCapacity("b0", slots, 4096, ram_bytes, KVB), RadixTree())


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
    c = make()
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
    assert p is not None and (p.slot, p.reuse, p.tier) == (1, 814, "ram")


def test_ram_candidate_needs_quarter_of_its_tokens() -> None:
    c = make()
    long_a = A + list(range(5000, 8000))  # 3815 tokens; A is < 25% of it
    run(c, long_a, 0)
    run(c, B, 0)  # long_a -> RAM
    p = c.predict(0, *lcps(c, U), len(U))  # nothing shared but the template
    assert p is not None and p.tier == "slot" and p.reuse == 3
    p = c.predict(0, *lcps(c, [*A, 9]), len(A) + 1)  # shares 815/3819 < 25%
    assert p is not None and p.ram_entry is None and p.reuse == 3


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
    c = make()
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
