"""Starts sent as what their prompt adds to one their slot was told before: read back
whole by a replica holding that base, unreadable (None) by one that does not, and sent
whole when the peers may not all hold it (a hello since)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.replicas.bases import MIN_BASE, OVERHEAD, PER_SLOT, Bases
from proxy.replicas.bus import ReplicaBus
from proxy.replicas.events import Event, Kind, decode, encode
from proxy.replicas.peers import PeerView, PoolPort
from proxy.routing.cache.predict import BackendCapacity
from proxy.routing.router import Router
from proxy.routing.tree.token_bytes import to_token_bytes


def start(prompt: list[int], slot: int = 0, request: int = 0) -> Event:
    return Event("a", Kind.START, "p", "x", slot, request, to_token_bytes(prompt))


# a conversation's turns: each prompt its history (some turns back) plus new tokens,
# in one of a few slots
_TURNS = st.lists(st.tuples(st.integers(0, 6), st.lists(st.integers(0, 9), min_size=1,
                                                        max_size=40), st.integers(0, 3)),
                  min_size=1, max_size=16)


@settings(max_examples=300, deadline=None)
@given(_TURNS)
def test_a_start_reads_back_whole_where_the_slots_were_told_the_same(
        turns: list[tuple[int, list[int], int]]) -> None:
    sender, receiver = Bases(), Bases()
    prompts: list[list[int]] = [list(range(100, 100 + MIN_BASE))]
    for back, new, slot in turns:
        prompt = prompts[max(0, len(prompts) - 1 - back)] + new
        prompts.append(prompt)
        e = start(prompt, slot)
        wire = decode(encode(sender.shorten(e)))
        assert wire is not None and receiver.whole(wire) == e
        sender.told(e)
        receiver.told(e)


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
