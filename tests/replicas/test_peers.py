"""Two replicas' routers joined by their events (no broker: each event goes through the
codec to the other's view at once): a peer's request is busy here while it runs and
leaves in its slot what it left there; a peer gone, or the broker lost, ends its
requests; a replica that joins takes the others' snapshot. Whatever order the events
come in, nothing raises and nothing stays busy once every peer's request is over."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.replicas.claims import Claims
from proxy.replicas.events import Event, Kind, decode, encode
from proxy.replicas.peers import PEER_TIMEOUT_S, PeerView, PoolPort, Teller
from proxy.routing.cache.values import BackendCapacity
from proxy.routing.decision import Handoff, Report
from proxy.routing.routed import Routed
from proxy.routing.router import Router
from proxy.routing.tree.token_bytes import to_token_bytes

POOL = "kvroute-demo"


CLOCK = [1e9]  # the replicas' wall clock (it moves when a test says)


@dataclass
class Replica:
    name: str
    router: Router = field(default_factory=lambda: Router("prefix"))
    handed: list[int] = field(default_factory=list)  # hand-offs made by peers' ends
    sent: list[Event] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.router.add_backend(BackendCapacity("x", 2, 8192, 0, 8192))
        self.claims = Claims(self.name, 0.2, clock=lambda: CLOCK[0])
        self.view = PeerView(self.name, {POOL: PoolPort(self.router, self.hand_off,
                                                        self.claims.heard)},
                             clock=lambda: CLOCK[0])
        self.teller = Teller(self.name, POOL, self.sent.append, self.view.touched)
        self.router.peers.listener = self.teller
        self.claims.tell = self.teller.claimed

    def hand_off(self, handoffs: list[Handoff]) -> None:
        self.handed.extend(h.request_id for h in handoffs)

    def send(self, d: Routed, prompt: list[int]) -> None:
        """The forwarder's word once ``d`` is written to its slot."""
        assert d.slot is not None
        self.teller.started(d.backend, d.slot, d.request_id, to_token_bytes(prompt))

    def deliver(self, to: Replica, now: float = 0.0) -> list[bool]:
        out = []
        for e in self.sent:
            got = decode(encode(e))
            assert got == e
            to.view.heard(e.replica, now)
            out.append(to.view.apply(got, now))
        self.sent.clear()
        return out


def conversation(seed: int, n: int = 600) -> list[int]:
    return [1000 * seed + i for i in range(n)]


def test_a_peers_request_is_busy_here_until_its_end_says_what_it_left() -> None:
    a, b = Replica("a"), Replica("b")
    prompt = conversation(1)
    d = a.router.decide(prompt, now=0.0)
    assert isinstance(d, Routed) and d.slot is not None
    a.send(d, prompt)
    assert a.deliver(b) == [True]
    assert b.router.held("x", d.slot) is None  # busy here too
    assert b.router.snapshot()["backends"]["x"]["inflight"] == 1  # type: ignore[index]
    other = b.router.decide(conversation(2), now=0.1)
    assert isinstance(other, Routed) and other.slot not in (None, d.slot)
    a.router.prefilled(d)
    a.router.complete(d, Report(output_tokens=[7, 8, 9], reported_cached=0), now=1.0)
    first, end = a.sent
    assert (first.kind, first.slot, end.kind, end.keep, len(end.tokens)) == (
        Kind.FIRST, d.slot, Kind.END, len(prompt), 12)  # the end sends only the answer
    assert a.deliver(b, 1.0) == [True, True]
    assert b.router.held("x", d.slot) == to_token_bytes([*prompt, 7, 8, 9])
    turn = b.router.decide([*prompt, 7, 8, 9, *range(9000, 9020)], now=2.0)
    assert isinstance(turn, Routed)
    assert (turn.slot, turn.predicted_cached) == (d.slot, len(prompt) + 3)


def test_a_request_waiting_for_a_peers_slot_is_handed_it_when_that_ends() -> None:
    a, b = Replica("a"), Replica("b")
    prompt = conversation(1)
    d = a.router.decide(prompt, now=0.0)
    assert isinstance(d, Routed) and d.slot is not None
    a.send(d, prompt)
    a.deliver(b)
    mine = b.router.decide(conversation(3), now=0.1)  # the other slot
    assert isinstance(mine, Routed) and mine.slot is not None
    waiting = b.router.decide([*prompt, *range(9000, 9020)], now=0.2)
    assert isinstance(waiting, Routed) and waiting.queued  # for its history's slot
    a.router.complete(d, Report(output_tokens=[7], reported_cached=0), now=1.0)
    a.deliver(b, 1.0)
    assert b.handed == [waiting.request_id]


def test_an_aborted_request_leaves_its_slot_unknown_and_a_missed_start_an_end_unread(
        ) -> None:
    a, b = Replica("a"), Replica("b")
    prompt = conversation(1)
    d = a.router.decide(prompt, now=0.0)
    assert isinstance(d, Routed) and d.slot is not None
    a.send(d, prompt)
    a.deliver(b)
    a.router.abort(d, now=0.5)
    assert a.sent[-1] == Event("a", Kind.END, POOL, "x", d.slot, d.request_id)
    a.deliver(b, 0.5)
    assert b.router.held("x", d.slot) is None
    assert b.router.snapshot()["backends"]["x"]["inflight"] == 0  # type: ignore[index]
    # an end whose start b never had: what it kept of the prompt is unknown here
    assert not b.view.apply(Event("a", Kind.END, POOL, "x", 1, 99, b"\1\0\0\0" * 4, 10), 1.0)


def test_a_silent_peers_requests_end_with_their_prompt_kept() -> None:
    a, b = Replica("a"), Replica("b")
    prompt = conversation(1)
    d = a.router.decide(prompt, now=0.0)
    assert isinstance(d, Routed) and d.slot is not None
    a.send(d, prompt)
    a.deliver(b, 0.0)
    b.view.expire(PEER_TIMEOUT_S / 2)
    assert b.view.in_flight == 1 and b.view.peers == ["a"]
    b.view.expire(PEER_TIMEOUT_S + 1)
    assert b.view.in_flight == 0 and b.view.peers == []
    assert b.router.held("x", d.slot) == to_token_bytes(prompt)


def test_the_broker_lost_ends_every_peers_request() -> None:
    a, b = Replica("a"), Replica("b")
    for seed in (1, 2):
        d = a.router.decide(conversation(seed), now=0.0)
        assert isinstance(d, Routed)
        a.send(d, conversation(seed))
    a.deliver(b)
    assert b.view.in_flight == 2
    b.view.lost(1.0)
    assert b.view.in_flight == 0
    assert b.router.snapshot()["backends"]["x"]["inflight"] == 0  # type: ignore[index]


def test_a_replica_that_joins_takes_the_others_view() -> None:
    a, b = Replica("a"), Replica("b")
    for seed in (1, 2):
        d = a.router.decide(conversation(seed), now=0.0)
        assert isinstance(d, Routed)
        a.router.complete(d, Report(output_tokens=[5], reported_cached=0), now=1.0)
    snap = a.view.snapshot()
    assert {e.kind for e in snap} == {Kind.HELD} and len(snap) == 2
    for e in snap:
        assert b.view.apply(decode(encode(e)), 2.0)  # type: ignore[arg-type]
    assert [b.router.held("x", s) for s in (0, 1)] == [a.router.held("x", s) for s in (0, 1)]


def test_after_the_broker_returns_the_later_of_two_views_of_a_slot_stands() -> None:
    """Cut off from each other, a and then b ran a turn of one conversation in slot 0;
    back, each is sent the other's snapshot: both end with b's (the later) turn."""
    a, b = Replica("a"), Replica("b")
    history = conversation(1)
    for r, extra in ((a, [5]), (b, [5, 6, 7])):
        CLOCK[0] += 1.0
        d = r.router.decide([*history, *extra], now=0.0)
        assert isinstance(d, Routed) and d.slot == 0
        r.send(d, [*history, *extra])
        r.router.complete(d, Report(output_tokens=[9], reported_cached=0), now=1.0)
        r.sent.clear()  # (the broker is away)
    CLOCK[0] += 1.0
    snapshots = {r.name: [decode(encode(e)) for e in r.view.snapshot()] for r in (a, b)}
    for to, frm in ((a, "b"), (b, "a")):
        for e in snapshots[frm]:
            to.view.apply(e, 3.0)  # type: ignore[arg-type]
    assert a.router.held("x", 0) == b.router.held("x", 0) == to_token_bytes(
        [*history, 5, 6, 7, 9])


_STEPS = st.lists(st.tuples(st.sampled_from(["start", "first", "end", "abort", "expire",
                                             "lost", "mine"]),
                            st.integers(0, 3), st.integers(1, 4)), max_size=40)


@settings(max_examples=150, deadline=None)
@given(_STEPS, st.permutations(range(40)))
def test_whatever_order_peers_events_come_in_nothing_stays_busy(
        steps: list[tuple[str, int, int]], order: list[int]) -> None:
    """Peers a and c run requests on b's backend; their events reach b shuffled (a
    broker delivers each peer's in order, but b may miss some), among b's own requests.
    Once every request is over and every peer gone, b's model has nothing in flight."""
    b = Replica("b")
    peers = {"a": Replica("a"), "c": Replica("c")}
    open_: dict[tuple[str, int], Routed] = {}
    mine: list[Routed] = []
    events: list[Event] = []
    now = 0.0
    for kind, which, seed in steps:
        now += 0.1
        name = "a" if which % 2 else "c"
        p = peers[name]
        if kind == "start":
            d = p.router.decide(conversation(seed), now=now)
            if isinstance(d, Routed) and d.slot is not None and not d.queued:
                p.send(d, conversation(seed))
                open_[name, d.request_id] = d
        elif kind in ("first", "end", "abort") and open_:
            key = sorted(open_)[which % len(open_)]
            d = open_[key] if kind == "first" else open_.pop(key)
            r = peers[key[0]].router
            if kind == "first":
                r.prefilled(d)
            elif kind == "end":
                r.complete(d, Report(output_tokens=[seed]), now=now)
            else:
                r.abort(d, now=now)
        elif kind == "mine":
            d = b.router.decide(conversation(seed + 10), now=now)
            if isinstance(d, Routed):
                mine.append(d)
        for q in peers.values():
            events.extend(q.sent)
            q.sent.clear()
        if kind == "expire":
            b.view.expire(now)
        elif kind == "lost":
            b.view.lost(now)
    for i in order:
        if i < len(events):
            b.view.heard(events[i].replica, now)
            b.view.apply(events[i], now)
    for d in mine:
        b.router.complete(d, now=now)
    b.view.expire(now + PEER_TIMEOUT_S + 1)
    assert b.view.in_flight == 0
    assert b.router.snapshot()["inflight"] == 0


def test_a_peers_request_sent_to_a_busy_slot_runs_next_there_before_ours_held() -> None:
    """b's request runs in slot s; a's is sent there too (the server queues it), then
    b holds a turn of its own for s: once b's ends, a's takes s, and b's waiter gets it
    after a's end."""
    b = Replica("b")
    history = conversation(1)
    assert isinstance(b.router.decide(conversation(2), now=0.0), Routed)  # (the other)
    mine = b.router.decide(history, now=0.0)
    assert isinstance(mine, Routed) and mine.slot is not None
    s = mine.slot
    waiter = b.router.decide([*history, 5, *range(9000, 9020)], now=0.1)
    assert isinstance(waiter, Routed) and waiter.queued
    side = to_token_bytes([*history, 42, 43])
    assert b.view.apply(Event("a", Kind.START, POOL, "x", s, 7, side), 0.2)
    handed = b.router.complete(mine, Report(output_tokens=[5]), now=1.0)
    assert [h.request_id for h in handed] == [waiter.request_id + 1]  # a's (rid here)
    assert b.router.held("x", s) is None  # a's request runs there now
    assert b.view.apply(Event("a", Kind.END, POOL, "x", s, 7, to_token_bytes([8]),
                              len(side) // 4), 2.0)
    assert b.handed == [waiter.request_id]
    assert b.router.snapshot()["inflight"] == 2  # (the waiter, in the slot now; the other)


def test_a_peers_request_over_before_the_one_here_leaves_that_ones_content() -> None:
    """a's request, queued in b's model behind b's own, ends first: the server ran it
    first, so b's reuses what it left (b's prediction is revised), and the slot ends
    holding b's."""
    b = Replica("b")
    history = conversation(1)
    mine = b.router.decide(history, now=0.0)
    assert isinstance(mine, Routed) and mine.slot is not None and mine.predicted_cached == 0
    side = to_token_bytes([*history[:400], 42, 43])
    assert b.view.apply(Event("a", Kind.START, POOL, "x", mine.slot, 7, side), 0.1)
    assert b.view.apply(Event("a", Kind.END, POOL, "x", mine.slot, 7, to_token_bytes([8]),
                              len(side) // 4), 0.5)
    assert b.router.place(mine).predicted_cached == 400
    b.router.complete(mine, Report(output_tokens=[5]), now=1.0)
    assert b.router.held("x", mine.slot) == to_token_bytes([*history, 5])
    assert b.router.held("x", 1 - mine.slot) is None  # (a's never ran there)
    assert b.router.snapshot()["inflight"] == 0 and b.view.in_flight == 0


def test_a_peers_request_waiting_here_with_a_token_first_runs_first() -> None:
    """a's request waits in b's model behind b's; a's first token comes while b's has
    none: the server runs a's first, and b's prediction is what a's prompt leaves. Had
    b's had its token first, its prediction would stand."""
    for b_first in (False, True):
        b = Replica("b")
        history = conversation(1)
        mine = b.router.decide(history, now=0.0)
        assert isinstance(mine, Routed) and mine.slot is not None
        side = to_token_bytes([*history[:300], 42])
        assert b.view.apply(Event("a", Kind.START, POOL, "x", mine.slot, 7, side), 0.1)
        if b_first:
            b.router.prefilled(mine)
        assert b.view.apply(Event("a", Kind.FIRST, POOL, "x", mine.slot, 7), 0.2)
        assert b.router.place(mine).predicted_cached == (0 if b_first else 300)


def test_a_peers_ids_are_its_own_per_pool() -> None:
    """A peer's request 0 in one pool and its request 0 in another are two requests:
    the end of one leaves the other, and this replica's own requests, alone."""
    routers = {name: Router("prefix") for name in ("p1", "p2")}
    for r in routers.values():
        r.add_backend(BackendCapacity("x", 2, 8192, 0, 8192))
    view = PeerView("b", {n: PoolPort(r, lambda h: None) for n, r in routers.items()})
    mine = routers["p2"].decide(conversation(3), now=0.0)
    assert isinstance(mine, Routed)
    for pool in ("p1", "p2"):
        assert view.apply(Event("a", Kind.START, pool, "x", 1, 0,
                                to_token_bytes(conversation(1))), 0.1)
    assert view.apply(Event("a", Kind.END, "p1", "x", 1, 0, to_token_bytes([5]), 600), 0.2)
    assert view.in_flight == 1
    assert routers["p2"].snapshot()["inflight"] == 2  # its own and a's other request
    routers["p2"].complete(mine, Report(output_tokens=[1]), now=1.0)
    assert routers["p2"].held("x", mine.slot) == to_token_bytes([*conversation(3), 1])


def test_alive_ends_a_peers_requests_whose_end_was_lost() -> None:
    a, b = Replica("a"), Replica("b")
    for seed in (1, 2):
        d = a.router.decide(conversation(seed), now=0.0)
        assert isinstance(d, Routed)
        a.send(d, conversation(seed))
        if seed == 1:
            kept = d
    a.deliver(b)
    assert b.view.in_flight == 2
    a.router.abort(kept, now=0.5, prefilled=True)
    a.sent.clear()  # (its end is lost)
    alive = decode(encode(a.teller.alive()))
    assert alive is not None and len(alive.live) == 1
    assert b.view.apply(alive, 1.0) and b.view.in_flight == 1
    assert b.router.held("x", kept.slot) == to_token_bytes(conversation(1))


def test_an_end_elsewhere_than_its_start_leaves_the_slot_it_names() -> None:
    b = Replica("b")
    prompt = to_token_bytes(conversation(1))
    assert b.view.apply(Event("a", Kind.START, POOL, "x", 0, 3, prompt), 0.0)
    assert b.view.apply(Event("a", Kind.END, POOL, "x", 1, 3, to_token_bytes([5]),
                              len(prompt) // 4), 1.0)
    assert b.router.held("x", 0) is None
    assert b.router.held("x", 1) == prompt + to_token_bytes([5])


def test_what_a_peer_names_that_is_not_routed_here_is_not_kept() -> None:
    b = Replica("b")
    big = b"\1\0\0\0" * 100_000
    for backend, slot in (("y", 0), ("x", 2)):
        assert not b.view.apply(Event("a", Kind.START, POOL, backend, slot, 1, big), 0.0)
        assert not b.view.apply(Event("a", Kind.END, POOL, backend, slot, 1, big), 0.0)
    assert b.view.in_flight == 0 and not b.view._changed


def test_a_peers_events_from_before_a_backend_came_back_leave_it_alone() -> None:
    b = Replica("b")
    prompt = to_token_bytes(conversation(1))
    mine = b.router.decide(conversation(1), now=0.0)
    assert isinstance(mine, Routed) and mine.slot is not None
    assert b.view.apply(Event("a", Kind.START, POOL, "x", mine.slot, 3, prompt), 0.1)
    b.router.add_backend(BackendCapacity("x", 2, 8192, 0, 8192))  # (back, empty)
    fresh = b.router.decide(conversation(2), now=1.0)
    assert isinstance(fresh, Routed) and fresh.slot is not None
    b.view.apply(Event("a", Kind.FIRST, POOL, "x", fresh.slot, 3), 1.1)
    assert b.router.place(fresh).predicted_cached == 0


def _work(r: Replica) -> int:
    return r.router.snapshot()["backends"]["x"]["work_tokens"]  # type: ignore[index,return-value]


def test_a_replica_that_joins_is_told_the_requests_in_flight_and_reads_their_end() -> None:
    """b joins while a's request runs (prefilled): a's answer to its hello names it, so
    b has the slot busy, without its prefill as load, and reads its end (which sends
    only what the slot kept beyond the prompt). Told twice, it is one request."""
    a, b = Replica("a"), Replica("b")
    prompt = conversation(1)
    d = a.router.decide(prompt, now=0.0)
    assert isinstance(d, Routed) and d.slot is not None
    a.send(d, prompt)
    a.router.prefilled(d)
    a.sent.clear()  # (b was not there)
    told = a.teller.in_flight()
    assert [e.kind for e in told] == [Kind.START, Kind.FIRST]
    for again in (False, True):
        for e in told:
            b.view.heard("a", 0.5)
            assert b.view.apply(decode(encode(e)), 0.5) is not again  # type: ignore[arg-type]
    assert b.view.in_flight == 1 and b.router.held("x", d.slot) is None
    assert _work(b) == b.router.settings.request_overhead_tokens
    a.router.complete(d, Report(output_tokens=[7, 8], reported_cached=0), now=1.0)
    assert a.deliver(b, 1.0) == [True]
    assert b.router.held("x", d.slot) == to_token_bytes([*prompt, 7, 8])
    assert b.view.in_flight == 0 and _work(b) == 0


def test_a_slot_restored_from_disk_is_taken_by_a_joiner_that_knows_nothing_newer() -> None:
    """A slot untouched since its restore from disk is sent stamped 0: a replica that
    knows nothing of that slot takes it; one that ran a request there since keeps its
    own view."""
    a = Replica("a")
    restored = to_token_bytes(conversation(1))
    assert a.router.seed("x", 0, restored)
    (held,) = a.view.snapshot()
    assert held.at == 0.0
    fresh, busy = Replica("b"), Replica("c")
    mine = busy.router.decide(conversation(2), now=0.0)
    assert isinstance(mine, Routed) and mine.slot == 0
    busy.send(mine, conversation(2))
    busy.router.complete(mine, Report(output_tokens=[5]), now=1.0)
    assert fresh.view.apply(decode(encode(held)), 2.0)  # type: ignore[arg-type]
    assert fresh.router.held("x", 0) == restored
    assert not busy.view.apply(decode(encode(held)), 2.0)  # type: ignore[arg-type]
    assert busy.router.held("x", 0) == to_token_bytes([*conversation(2), 5])


def test_a_peers_request_waiting_here_that_got_its_token_is_no_load_once_handed() -> None:
    """a's request waits in b's model behind b's (no token yet) and gets its first
    token: its prefill is done (the server ran it first), so it is not b's backend's
    load, neither while it waits nor once b's ends and it is handed the slot."""
    b = Replica("b")
    mine = b.router.decide(conversation(1), now=0.0)
    assert isinstance(mine, Routed) and mine.slot is not None
    before = _work(b)
    overhead = b.router.settings.request_overhead_tokens
    side = to_token_bytes(conversation(2))
    assert b.view.apply(Event("a", Kind.START, POOL, "x", mine.slot, 7, side), 0.1)
    assert _work(b) > before + overhead  # (waiting, its prefill ahead)
    assert b.view.apply(Event("a", Kind.FIRST, POOL, "x", mine.slot, 7), 0.2)
    assert _work(b) == before + overhead
    handed = b.router.complete(mine, Report(output_tokens=[5]), now=1.0)
    assert len(handed) == 1 and _work(b) == overhead


def test_only_this_replicas_own_requests_count_as_completed_here() -> None:
    a, b = Replica("a"), Replica("b")
    d = a.router.decide(conversation(1), now=0.0)
    assert isinstance(d, Routed) and d.slot is not None
    a.send(d, conversation(1))
    a.router.complete(d, Report(output_tokens=[5]), now=1.0)
    a.deliver(b, 1.0)
    mine = b.router.decide(conversation(2), now=2.0)
    assert isinstance(mine, Routed)
    b.router.complete(mine, Report(output_tokens=[5]), now=3.0)
    snap = b.router.snapshot()
    assert (snap["completed"], snap["completed_for_peers"]) == (1, 1)
    assert (a.router.completed, a.router.completed_for_peers) == (1, 0)


def test_replicas_starting_conversations_at_once_take_different_empty_slots() -> None:
    """A burst of new conversations over one system prompt, through two replicas that
    know each other (each heard the other's ALIVE) but not, yet, each other's starts:
    each takes the empty slots in an order of its own, so no two land in one slot (the
    second would wait there, then cut the first one's history). Two backends x 2 slots,
    two conversations per replica."""
    system = list(range(500_000, 500_700))
    for order in (("a", "b"), ("b", "a")):  # (which one is told of the other first)
        reps = {n: Replica(n) for n in order}
        for r in reps.values():
            r.router.add_backend(BackendCapacity("y", 2, 8192, 0, 8192))
        first, second = reps[order[0]], reps[order[1]]
        first.view.heard(second.name, 0.0)
        second.view.heard(first.name, 0.0)
        placed = []
        for k, r in enumerate(reps.values()):
            for j in range(2):
                task = [600_000 + 1000 * (2 * k + j) + i for i in range(250)]
                d = r.router.decide([*system, *task], session=f"{r.name}{j}", now=0.0)
                assert isinstance(d, Routed) and d.slot is not None
                placed.append((d.backend, d.slot))
        assert len(set(placed)) == 4, placed


def test_a_lone_replica_takes_empty_slots_from_the_first() -> None:
    a = Replica("a")
    d = a.router.decide(conversation(1), now=0.0)
    assert isinstance(d, Routed) and d.slot == 0
    a.view.heard("b", 0.0)  # "a" < "b": still from the first
    e = a.router.decide(conversation(2), now=0.0)
    assert isinstance(e, Routed) and e.slot == 1
    b = Replica("b")
    b.view.heard("a", 0.0)  # second of two: from halfway along
    f = b.router.decide(conversation(3), now=0.0)
    assert isinstance(f, Routed) and f.slot == 1
    b.view.left("a", 1.0, "bye")  # alone again: from the first
    g = b.router.decide(conversation(4), now=1.0)
    assert isinstance(g, Routed) and g.slot == 0


async def _claim(r: Replica, d: Routed, prompt: list[int]) -> asyncio.Task[bool]:
    """``d``'s claim held at ``r``, told (its start sent) once this returns."""
    async def whole() -> bytes:
        return to_token_bytes(prompt)
    task = asyncio.ensure_future(r.claims.hold(d, whole))
    await asyncio.sleep(0)
    assert r.sent[-1].kind == Kind.START and r.sent[-1].at == CLOCK[0]
    return task


async def test_two_replicas_claiming_one_slot_at_once_the_later_moves() -> None:
    """a and b, neither having heard of the other, start a new conversation each in
    slot 0 (both rank 0 of 1): each tells its claim and holds its request. Whichever
    replica claimed first, and whichever claim reaches the other first, both agree: the
    earlier keeps slot 0, the later is withdrawn (its peer hears it moved) and, decided
    again, lands in the empty slot 1; both models end with each request where it runs."""
    for first, second in (("a", "b"), ("b", "a")):
        for delivered_first in (first, second):
            reps = {n: Replica(n) for n in (first, second)}
            prompts = {n: conversation(k + 1) for k, n in enumerate(reps)}
            decided = {n: r.router.decide(prompts[n], now=0.0) for n, r in reps.items()}
            assert all(isinstance(d, Routed) and d.slot == 0 and d.prediction.claims
                       for d in decided.values())
            tasks = {}
            for n in (first, second):
                CLOCK[0] += 0.001
                tasks[n] = await _claim(reps[n], decided[n], prompts[n])  # type: ignore[arg-type]
            other = second if delivered_first == first else first
            reps[delivered_first].deliver(reps[other])
            reps[other].deliver(reps[delivered_first])
            assert await tasks[first] and not await tasks[second]
            winner, loser = reps[first], reps[second]
            loser.hand_off(decided[second].withdraw(now=0.1))  # type: ignore[union-attr]
            again = loser.router.decide(prompts[second], now=0.1)
            assert isinstance(again, Routed) and again.slot == 1
            assert [e.kind for e in loser.sent] == [Kind.MOVED]
            loser.teller.started(again.backend, 1, again.request_id,
                                 to_token_bytes(prompts[second]))
            assert loser.deliver(winner) == [True, True]
            for r in reps.values():  # (each request once, where it runs)
                assert r.router.snapshot()["inflight"] == 2
                assert r.router.held("x", 0) is None and r.router.held("x", 1) is None
            assert winner.router.place(decided[first]).slot == 0  # type: ignore[arg-type]
            assert not winner.handed and loser.handed  # (the winner's, in the loser's model)


async def test_a_start_that_is_no_claim_beats_a_claim_held_for_its_slot() -> None:
    """A peer's request sent to the slot (it goes on from its history there, so it was
    not held) wins over a claim held here, told earlier or not; one for another slot
    does not touch it."""
    a = Replica("a")
    prompt = conversation(1)
    d = a.router.decide(prompt, now=0.0)
    assert isinstance(d, Routed) and d.prediction.claims
    task = await _claim(a, d, prompt)
    other = to_token_bytes(conversation(2))
    a.view.apply(Event("b", Kind.START, POOL, "x", 1, 7, other), 0.0)
    assert not task.done()
    a.view.apply(Event("b", Kind.START, POOL, "x", 0, 8, other), 0.0)
    assert not await task


async def test_a_claim_sent_is_told_again_as_a_plain_start() -> None:
    """Its claim told (with its time) and won, the request is told again once sent,
    without the time: a replica of a version that drops a start carrying a claim's time
    still hears it, and one that took the claim changes nothing."""
    a, b = Replica("a"), Replica("b")
    prompt = conversation(1)
    d = a.router.decide(prompt, now=0.0)
    assert isinstance(d, Routed) and d.prediction.claims
    assert await (await _claim(a, d, prompt))
    a.send(d, prompt)
    a.send(d, prompt)  # (the forwarder's word again as the answer's head comes: once)
    assert [(e.kind, e.at) for e in a.sent] == [(Kind.START, CLOCK[0]), (Kind.START, 0.0)]
    old = Replica("old")
    old.view.apply(a.sent[1], 0.0)  # (what a replica that drops the first one hears)
    assert old.router.snapshot()["inflight"] == 1
    assert a.deliver(b) == [True, False]


async def test_a_claim_given_up_leaves_its_slot_as_it_was() -> None:
    """A claim whose client left before it was sent changed nothing in its slot: the
    slot's content and when it last changed are what a joiner is sent, as before."""
    a = Replica("a")
    for seed in (3, 5):  # (both slots hold a conversation: the claim takes one)
        d = a.router.decide(conversation(seed), now=0.0)
        assert isinstance(d, Routed)
        a.send(d, conversation(seed))
        a.router.complete(d, Report(output_tokens=[5, 6]), now=0.5)
    CLOCK[0] += 1.0
    before = a.view.snapshot()
    assert len(before) == 2
    CLOCK[0] += 1.0
    prompt = conversation(4)
    d = a.router.decide(prompt, now=1.0)
    assert isinstance(d, Routed) and d.prediction.claims
    task = await _claim(a, d, prompt)
    task.cancel()
    d.withdraw(now=1.0)
    assert a.view.snapshot() == before
