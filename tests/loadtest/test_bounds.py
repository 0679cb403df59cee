"""The trace references: the capacity estimate by hand, against the oracle and against
an exhaustive search over what to keep, and a trace where a router beats it."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadtest.bounds import (
    Bounds,
    _common,
    capacity_estimate,
    lru_estimate,
    oracle_hit_ratio,
    run_estimate,
)
from loadtest.trace import TraceRequest

A1, A2, B1, B2 = (1,), (1, 2), (5,), (5, 6)


@pytest.mark.parametrize(("seqs", "slots", "ram", "reused"), [
    ([A1, A2, (1, 2, 3)], 1, 0, 1 + 2),  # one conversation grows in its slot
    ([A1, B1, A2, B2], 1, 0, 1),  # one slot: keep A (needed first), lose B
    ([A1, B1, A2, B2], 1, 1, 1 + 1),  # one block of RAM holds B's first turn
    ([A1, B1, A2, B2], 2, 0, 1 + 1),  # two slots hold both
    ([(1, 2, 3), (1, 2, 4), (1, 2, 3, 5)], 1, 0, 2 + 3),  # keeps the branch needed again
    ([(1, 2, 3), (1, 2, 3)], 1, 0, 2),  # a repeat reuses all but its last token
])
def test_capacity_estimate_by_hand(seqs: list[tuple[int, ...]], slots: int, ram: int,
                                reused: int) -> None:
    total = sum(len(s) for s in seqs)
    assert capacity_estimate(seqs, unit_tokens=1, slots=slots, ram_tokens=ram) == reused / total


@st.composite
def conversations(draw: st.DrawFn) -> list[tuple[int, ...]]:
    """Chained block ids, as in the trace: a request is an earlier one's prefix (or
    nothing) followed by fresh ids, so equal ids mean equal prefixes."""
    seqs: list[tuple[int, ...]] = []
    fresh = itertools.count(1)
    for _ in range(draw(st.integers(1, 7))):
        base: tuple[int, ...] = ()
        if seqs and draw(st.booleans()):
            prev = draw(st.sampled_from(seqs))
            base = prev[: draw(st.integers(0, len(prev)))]
        seqs.append(base + tuple(next(fresh) for _ in range(draw(st.integers(1, 3)))))
    return seqs


def _oracle(seqs: Sequence[tuple[int, ...]]) -> float:
    return oracle_hit_ratio([TraceRequest(0, len(s), 1, list(s)) for s in seqs], block=1)


def _best_keeping(seqs: Sequence[tuple[int, ...]], slots: int, ram: int) -> float:
    """Exhaustive: after each request keep any set of the held sequences that fits."""
    total = sum(len(s) for s in seqs)

    def fits(held: tuple[tuple[int, ...], ...]) -> bool:
        return sum(sorted(map(len, held), reverse=True)[slots:]) <= ram

    def go(t: int, held: tuple[tuple[int, ...], ...]) -> int:
        if t == len(seqs):
            return 0
        s = seqs[t]
        got = min(max((_common(c, s) for c in held), default=0), len(s) - 1)
        grown = (*(c for c in held if not (len(c) <= len(s) and s[:len(c)] == c)), s)
        return got + max(go(t + 1, keep) for n in range(len(grown) + 1)
                         for keep in itertools.combinations(grown, n) if fits(keep))

    return go(0, ()) / total


@settings(max_examples=150, deadline=None)
@given(conversations(), st.integers(1, 2), st.integers(0, 4))
def test_capacity_estimate_between_search_and_oracle(seqs: list[tuple[int, ...]],
                                                     slots: int, ram: int) -> None:
    bound = capacity_estimate(seqs, unit_tokens=1, slots=slots, ram_tokens=ram)
    assert bound <= _best_keeping(seqs, slots, ram) + 1e-9
    assert bound <= _oracle(seqs) + 1e-9
    assert capacity_estimate(seqs, unit_tokens=1, slots=slots, ram_tokens=1e9) == \
        pytest.approx(_oracle(seqs))


def test_run_estimate_measures_tokens_per_block() -> None:
    blocks = {"r0": A1, "r1": A2, "r2": (7,)}
    # 30 tokens over 3 blocks: 10 a block; a request the backend did not count is skipped
    got = run_estimate(blocks, [("r0", 10), ("r1", 20), ("r2", None)], slots=2, ram_tokens=0)
    assert got == Bounds(pytest.approx(10 / 40), pytest.approx(10 / 40))
    assert run_estimate(blocks, [("r0", None)], slots=2, ram_tokens=0) is None


def test_the_estimate_bounds_nothing() -> None:
    """Two single-slot servers, no RAM: conversation (1, ...) on one, (3, 4, 5, ...) on the
    other reuses 1 + 2 + 3 = 6 of 18 tokens; the estimate keeps (1, 2), which (1, 6)
    already covers, in place of (3, 4, 5), and finds 3."""
    seqs = [(1, 2), (3, 4, 5), (1, 6), (1, 6, 7), (3, 4, 5, 8, 9), (10, 11, 12)]
    assert capacity_estimate(seqs, unit_tokens=1, slots=2, ram_tokens=0) == 3 / 18
    assert _best_keeping(seqs, 2, 0) == 6 / 18


@pytest.mark.parametrize(("seqs", "slots", "ram", "reused"), [
    ([A1, A2, (1, 2, 3)], 1, 0, 1 + 2),  # one conversation grows in its slot
    ([A1, B1, A2, B2], 1, 0, 0),  # one slot: each turn finds the other conversation
    ([A1, B1, A2, B2], 1, 1, 1 + 1),  # the slot's last goes to RAM: both come back
    ([A1, B1, (7,), A2, B2], 1, 1, 0),  # RAM holds only the last one out: (7,) came last
    ([A1, B1, (7,), A2, B2], 1, 2, 1 + 1),
    ([(1, 2, 3), (1, 2, 4), (1, 2, 3, 5)], 1, 0, 2 + 2),  # no foresight: the branch is lost
])
def test_lru_estimate_by_hand(seqs: list[tuple[int, ...]], slots: int, ram: int,
                              reused: int) -> None:
    total = sum(len(s) for s in seqs)
    assert lru_estimate(seqs, unit_tokens=1, slots=slots, ram_tokens=ram) == reused / total


def _lru_replay(seqs: Sequence[tuple[int, ...]], slots: int, ram: int) -> float:
    """The servers' rule, spelled out: a list of what is held, most recently used last;
    the last ``slots`` are in slots, the rest must fit in ``ram`` (oldest out first)."""
    held: list[tuple[int, ...]] = []
    reused = 0
    for s in seqs:
        best = max(held, key=lambda c: _common(c, s), default=())
        got = _common(best, s)
        reused += min(got, len(s) - 1)
        if got:
            held.remove(best)
            if got < len(best):  # still held, and used now
                held.append(best)
        held.append(s)
        while sum(len(c) for c in held[:max(0, len(held) - slots)]) > ram:
            held.pop(0)
    return reused / sum(len(s) for s in seqs)


@settings(max_examples=200, deadline=None)
@given(conversations(), st.integers(0, 2), st.integers(0, 6))
def test_lru_estimate_replays_the_servers_rule(seqs: list[tuple[int, ...]], slots: int,
                                               ram: int) -> None:
    got = lru_estimate(seqs, unit_tokens=1, slots=slots, ram_tokens=ram)
    assert got == pytest.approx(_lru_replay(seqs, slots, ram))
    assert got <= capacity_estimate(seqs, unit_tokens=1, slots=max(slots, 1),
                                    ram_tokens=1e9) + 1e-9


def test_a_report_says_both_estimates() -> None:
    from loadtest.report import console_table

    text = console_table([], 0.3, Bounds(0.25, 0.2))
    assert "capacity estimate (these servers' slots and RAM, clairvoyant, one pool): 25.0%" \
        in text
    assert "LRU estimate (the same memory, least recently used dropped first" in text
    assert text.rstrip().endswith("20.0%")
