"""An event larger than the broker's limit goes in parts and is read whole; lost,
repeated or made-up parts are counted, never held beyond the bounds."""

from __future__ import annotations

import collections
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.replicas.events import MAX_EVENT_BYTES
from proxy.replicas.parts import (
    HEADER,
    MIN_SHARE,
    PENDING,
    PENDING_BYTES,
    TIMEOUT_S,
    Assembler,
    is_part,
    split,
)

DATA = random.Random(1).randbytes(10_000)
LIMIT = 1024


def _assembled(parts: list[bytes], at: list[float] | None = None
               ) -> tuple[list[bytes], collections.Counter[str], Assembler]:
    counts = collections.Counter[str]()
    a = Assembler(lambda e: counts.update((e,)))
    got = [whole for i, p in enumerate(parts)
           if (whole := a.add("s", p, at[i] if at else 0.0)) is not None]
    return got, counts, a


def test_an_event_within_the_limit_goes_as_it_is() -> None:
    assert split(DATA, len(DATA)) == [DATA] and not is_part(DATA)


def test_a_larger_one_goes_in_parts_within_the_limit_and_is_read_whole() -> None:
    parts = split(DATA, LIMIT)
    assert len(parts) == -(-len(DATA) // (LIMIT - HEADER)) == 10
    assert all(len(p) <= LIMIT and is_part(p) for p in parts)
    got, counts, a = _assembled(parts)
    assert got == [DATA] and not counts and a.held == 0


@pytest.mark.parametrize("size, limit", [
    (MAX_EVENT_BYTES + 1, 1 << 20),  # (larger than a peer reads)
    (MAX_EVENT_BYTES + 1, MAX_EVENT_BYTES + 2),  # (so even where the broker takes it)
    (10_000, HEADER + MIN_SHARE - 1),  # (the broker's limit leaves too little to split)
])
def test_what_cannot_go_in_parts_goes_not_at_all(size: int, limit: int) -> None:
    assert split(bytes(size), limit) == []


# (which parts arrive, of DATA's 10 in LIMIT) -> (read whole, counted)
@pytest.mark.parametrize("order, whole, counted", [
    ([0, 1, 3, 4, 5, 6, 7, 8, 9], 0, {"incomplete": 1}),  # (one lost)
    ([0, 1, 2, 2, 3], 0, {"incomplete": 1}),  # (one twice)
    ([1, 2, 3, 4, 5, 6, 7, 8, 9], 0, {"incomplete": 1}),  # (the first lost)
    ([0, 1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9], 0, {"incomplete": 1}),  # (begun again)
    ([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 9], 1, {"incomplete": 1}),  # (the last twice)
])
def test_a_message_that_lost_a_part_is_dropped_and_counted(
        order: list[int], whole: int, counted: dict[str, int]) -> None:
    parts = split(DATA, LIMIT)
    got, counts, a = _assembled([parts[i] for i in order])
    assert got == [DATA] * whole and counts == counted and a.held == 0


def test_a_message_not_added_to_for_long_is_dropped() -> None:
    parts = split(DATA, LIMIT)
    got, counts, a = _assembled(parts[:3] + parts[4:], [0.0] * 3 + [TIMEOUT_S + 1] * 6)
    assert got == [] and counts["incomplete"] >= 1 and a.held == 0
    got, counts, a = _assembled(parts[:3])
    a.expire(TIMEOUT_S + 1)
    assert counts["incomplete"] == 1 and a.held == 0


def test_messages_begun_and_not_finished_are_held_within_bounds() -> None:
    counts = collections.Counter[str]()
    a = Assembler(lambda e: counts.update((e,)))
    for _ in range(3):  # (three messages of MAX_EVENT_BYTES, all but their last part)
        big = split(bytes(MAX_EVENT_BYTES), 1 << 20)
        for p in big[:-1]:
            a.add("s", p, 0.0)
    assert a.held <= PENDING_BYTES and counts["incomplete"] == 1
    for _ in range(PENDING + 5):
        a.add("s", split(DATA, LIMIT)[0], 0.0)
    assert counts["incomplete"] == 1 + 2 + 5  # (the large ones first: least recent)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(
    st.binary(max_size=100).map(lambda b: b"\x00kvp" + b),
    st.sampled_from(split(DATA, LIMIT)),
    st.builds(lambda p, i, n, tail: p[:12] + i.to_bytes(4, "big") + n.to_bytes(4, "big")
              + tail, st.sampled_from(split(DATA, LIMIT)), st.integers(0, (1 << 32) - 1),
              st.integers(0, (1 << 32) - 1), st.binary(max_size=2000))), max_size=40))
def test_whatever_a_peer_sends_in_parts_is_held_within_bounds(parts: list[bytes]) -> None:
    got, _, a = _assembled(parts)
    assert a.held <= PENDING_BYTES and all(len(g) <= MAX_EVENT_BYTES for g in got)
