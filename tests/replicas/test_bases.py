"""Starts sent as what their prompt adds to one their slot was told before: read back
whole by a replica holding that base, unreadable (None) by one that does not, and sent
whole when the peers may not all hold it (a hello since)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.replicas.bases import MIN_BASE, OVERHEAD, PER_SLOT, Bases
from proxy.replicas.bus import ReplicaBus
from proxy.replicas.events import Event, Kind, decode, encode
from proxy.replicas.peers import PeerView, PoolPort
from proxy.routing.cache.values import BackendCapacity
from proxy.routing.router import Router
from proxy.routing.tree.token_bytes import to_token_bytes


def start(prompt: list[int], slot: int = 0, request: int = 0) -> Event:
    return Event("a", Kind.START, "p", "x", slot, request, to_token_bytes(prompt))


def end(answer: list[int], keep: int, slot: int = 0, request: int = 0) -> Event:
    return Event("a", Kind.END, "p", "x", slot, request, to_token_bytes(answer), keep)


# a conversation's turns: each prompt its history (some turns back) plus new tokens,
# in one of a few slots; an answer, and how many of its prompt's tokens its slot kept
# (at least two new tokens: a history of none, an end that kept nothing, is no start)
_TURNS = st.lists(st.tuples(
    st.integers(0, 6), st.lists(st.integers(0, 9), min_size=2, max_size=40),
    st.integers(0, 3), st.lists(st.integers(0, 9), max_size=40), st.integers(0, 60)),
    min_size=1, max_size=16)


@settings(max_examples=300, deadline=None)
@given(_TURNS)
def test_a_start_reads_back_whole_where_the_slots_were_told_the_same(
        turns: list[tuple[int, list[int], int, list[int], int]]) -> None:
    sender, receiver = Bases(), Bases()
    prompts: list[list[int]] = [list(range(100, 100 + MIN_BASE))]
    for request, (back, new, slot, answer, kept) in enumerate(turns):
        prompt = prompts[max(0, len(prompts) - 1 - back)] + new
        e = start(prompt, slot, request)
        wire = decode(encode(sender.shorten(e)))
        assert wire is not None and receiver.whole(wire) == e
        keep = min(kept, len(prompt))
        prompts += [prompt, prompt[:keep] + answer]
        for b in (sender, receiver):
            b.told(e)
            b.ended(end(answer, keep, slot, request))


def test_a_turn_after_an_answer_goes_as_what_it_adds_to_both() -> None:
    """The slot holds the prompt, then the answer: the next turn, beginning with both,
    sends neither; a replica that missed the end cannot read it."""
    sender, receiver, missed = Bases(), Bases(), Bases()
    prompt, answer = list(range(500)), list(range(1000, 1300))
    for b in (sender, receiver, missed):
        b.told(start(prompt))
    for b in (sender, receiver):
        b.ended(end(answer, len(prompt)))
    turn = start([*prompt, *answer, 7], request=1)
    wire = sender.shorten(turn)
    assert (wire.keep, wire.tokens) == (len(prompt) + len(answer), to_token_bytes([7]))
    assert receiver.whole(wire) == turn and missed.whole(wire) is None
    assert len(sender._slots["p", "x", 0]) == 1  # (in the start's stead)


@pytest.mark.parametrize("ended, keep, base", [
    (end(list(range(900, 950)), 300), 300, 350),  # (kept part of its prompt: both stay)
    (end(list(range(900, 950)), 500, request=9), 500, 500),  # (another request's end)
    (end([], 500), 500, 500),  # (nothing kept beyond the prompt)
    (end(list(range(900, 950)), 501), 500, 500),  # (more than its prompt)
])
def test_an_end_is_a_base_only_as_what_its_start_told(ended: Event, keep: int,
                                                       base: int) -> None:
    b = Bases()
    b.told(start(list(range(500))))
    b.ended(ended)
    assert b.shorten(start([*range(keep), *range(900, 950), 1])).keep == base


def test_an_end_after_a_hello_is_no_base() -> None:
    """A joiner since the start may not hold it: what its end makes is no base either."""
    b = Bases()
    b.told(start(list(range(500))))
    b.unsure()
    b.ended(end(list(range(900, 950)), 500))
    e = start([*range(500), *range(900, 950), 1])
    assert b.shorten(e) == e


def test_an_end_goes_with_its_newest_start_of_that_id() -> None:
    """A peer back from a restart numbers its requests from 0 again: the end of its new
    request 0 makes the same base here as there, whatever its previous run's request 0
    left unended in the slot."""
    sender, receiver = Bases(), Bases()
    receiver.told(start(list(range(500))))  # (the previous run's: its end never came)
    prompt, answer = list(range(2000, 2500)), list(range(900, 950))
    for b in (sender, receiver):
        b.told(start(prompt))
        b.ended(end(answer, len(prompt)))
    turn = start([*prompt, *answer, 7], request=1)
    wire = sender.shorten(turn)
    assert wire.keep == len(prompt) + len(answer) and receiver.whole(wire) == turn


def test_a_turn_gone_to_another_slot_goes_against_its_history_there() -> None:
    sender, receiver = Bases(), Bases()
    history, other = list(range(500)), list(range(1000, 1400))
    for b in (sender, receiver):
        b.told(start(history, slot=0))
        b.told(start(other, slot=1))
    turn = start([*history, 7], slot=1)
    wire = sender.shorten(turn)
    assert (wire.keep, wire.base_from) == (len(history), ("x", 0))
    assert receiver.whole(decode(encode(wire))) == turn  # type: ignore[arg-type]


def test_a_turn_goes_as_its_new_tokens_unless_a_hello_came_since() -> None:
    sender, receiver, joiner = Bases(), Bases(), Bases()
    history = list(range(500))
    first = start(history)
    assert sender.shorten(first) == first  # (nothing told yet)
    for b in (sender, receiver):
        b.told(first)
    turn = start([*history, 7, 8, 9])
    wire = sender.shorten(turn)
    assert (wire.keep, wire.tokens) == (len(history), to_token_bytes([7, 8, 9]))
    assert receiver.whole(wire) == turn
    assert joiner.whole(wire) is None  # (it missed the first)
    assert Bases().whole(start([1, 2])) == start([1, 2])  # (whole: nothing to look up)
    sender.unsure()
    assert sender.shorten(turn) == turn
    sender.told(turn)
    assert sender.shorten(start([*history, 7, 8, 9, 10])).keep == len(history) + 3


def test_a_base_read_only_by_a_joiner_is_not_one_its_own_starts_go_against() -> None:
    joiner = Bases()
    joiner.told(start(list(range(500))), everyone=False)
    e = start([*range(500), 1])
    assert joiner.shorten(e) == e
    assert joiner.whole(Bases().shorten(e)) == e


def test_a_start_told_again_to_a_joiner_only_stays_a_base_every_peer_holds() -> None:
    """A request in flight, sent again whole to a replica that joined, repeats the
    prompt every peer already holds: it stays a base for this one's own starts."""
    b = Bases()
    b.told(start(list(range(500))))
    b.told(start(list(range(500))), everyone=False)
    assert b.shorten(start([*range(500), 1])).keep == 500


def test_a_start_sent_before_a_hello_is_no_base_after_it() -> None:
    """A start made before a hello was read, told once it has gone out: the joiner may
    not have it."""
    b = Bases()
    made_in = b.epoch
    b.unsure()
    b.told(start(list(range(500))), epoch=made_in)
    e = start([*range(500), 1])
    assert b.shorten(e) == e


def test_the_bases_kept_are_bounded_per_slot_and_in_bytes() -> None:
    b = Bases(max_bytes=4 * 2000)
    for i in range(PER_SLOT + 2):
        b.told(start(list(range(1000 * i, 1000 * i + 600)), slot=0))
    assert b._bytes <= 4 * 2000
    assert all(len(q) <= PER_SLOT for q in b._slots.values())
    oldest = start([*range(600), 1], slot=0)
    assert b.shorten(oldest) == oldest  # (evicted)


def test_a_flood_of_tiny_starts_keeps_no_more_slots_than_their_overhead_allows() -> None:
    """Each slot's record costs far more than a tiny prompt's bytes: the bound counts it."""
    max_bytes = 64 * OVERHEAD
    b = Bases(max_bytes=max_bytes)
    for slot in range(1000):
        b.told(start([1, 2], slot=slot))
    assert 0 < len(b._slots) <= max_bytes // (2 * OVERHEAD)


def test_a_peers_starts_to_slots_not_routed_here_are_not_kept() -> None:
    """A peer naming backends (or slots) this replica's router for the pool does not
    have leaves nothing behind; the slots it routes keep their bases."""
    router = Router("prefix")
    slots = 2
    router.add_backend(BackendCapacity("x", slots, 8192, 0, 8192))
    bus = ReplicaBus("nats://127.0.0.1:1", "a", PeerView("a", {"p": PoolPort(
        router, lambda h: None)}), lambda e: None)
    for i in range(1000):
        for backend, slot in ((f"made-up{i}", 0), ("x", slots + i)):
            bus._apply(encode(Event("b", Kind.START, "p", backend, slot, i, bytes(8))))
        bus._apply(encode(Event("b", Kind.START, "other", "x", 0, i, bytes(8))))
    bus._apply(encode(Event("b", Kind.START, "p", "x", 1, 0, bytes(8))))
    assert list(bus.bases._slots) == [("p", "x", 1)]
