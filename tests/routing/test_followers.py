"""Followers: a request sharing most of its prompt with a request still queued (its
conversation's previous turn, a side call over its history) waits behind that one and
is handed its slot when it ends, instead of prefilling the history a second time."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.routing.cache.values import BackendCapacity
from proxy.routing.decision import Handoff, Report
from proxy.routing.routed import Routed
from proxy.routing.router import Router

TURN = list(range(100_000, 103_000))  # a conversation's turn, waiting for a slot
NEXT = [*TURN, *range(600_000, 600_100)]  # its next turn, sent while it waits


def cap(name: str, slots: int = 1, ram: int = 1 << 30) -> BackendCapacity:
    return BackendCapacity(name, slots, 16384, ram, 8192)


def decide(r: Router, tokens: list[int], now: float, session: str | None = None) -> Routed:
    d = r.decide(tokens, now=now, session=session)
    assert isinstance(d, Routed), d
    return d


def learned(r: Router) -> None:
    """The backends' rate (1,500 tokens/s) and service time (0.3 s) are learned."""
    for i, name in enumerate(r.backends):
        w = r.decide(list(range(500_000 + 1000 * i, 500_300 + 1000 * i)), now=0.0,
                     among=(name,))
        assert isinstance(w, Routed)
        r.complete(w, Report(prompt_ms=200.0, prompt_n=300), now=0.3)


def two_backends() -> Router:
    """Two backends of two slots, their rate and service time learned."""
    r = Router()
    r.add_backend(cap("a", 2))
    r.add_backend(cap("b", 2))
    learned(r)
    return r


def leader_waiting(r: Router | None = None, prompt: list[int] | None = None,
                   session: str | None = None) -> tuple[Router, Routed, Routed, Routed]:
    """``r`` (else `two_backends`) with its four slots busy; ``prompt`` (TURN), of
    ``session``, waits on one backend, then the other's slots free: (the router, the
    waiter, the requests running where it waits)."""
    r = r or two_backends()
    busy = [decide(r, list(range(200_000 + 10_000 * i, 200_500 + 10_000 * i)), now=0.5)
            for i in range(4)]
    lead = decide(r, prompt or TURN, now=1.0, session=session)
    assert lead.queued and "follows" not in lead.reasons
    for d in busy:
        if d.backend != lead.backend:
            assert r.complete(d, Report(output_tokens=[7] * 4), now=1.5) == []
    first, second = (d for d in busy if d.backend == lead.backend)
    return r, lead, first, second


def test_a_follower_waits_behind_its_queued_leader_and_is_handed_its_slot() -> None:
    """The next turn comes while TURN waits, the other backend idle: it follows TURN
    rather than recompute its 3,000 tokens there. TURN is handed the first slot to
    free; the second, freeing while TURN runs, stays idle (the follower waits for
    TURN's); TURN's end hands the follower TURN's slot, pinned, reusing TURN's prompt."""
    r, lead, first, second = leader_waiting()
    nxt = decide(r, NEXT, now=1.6)
    assert nxt.queued and nxt.backend == lead.backend
    assert nxt.reasons["follows"] == lead.request_id
    assert nxt.predicted_cached == len(TURN)
    got = r.complete(first, Report(output_tokens=[7] * 4), now=3.0)
    assert [h.request_id for h in got] == [lead.request_id]
    assert r._backends[lead.backend].targets == {nxt.request_id: lead.slot}
    assert r.complete(second, Report(output_tokens=[7] * 4), now=3.5) == []
    got = r.complete(lead, Report(output_tokens=[7] * 4, reported_cached=got[0].predicted_cached),
                     now=5.0)
    assert got == [Handoff(nxt.request_id, lead.backend, lead.slot, len(TURN))]
    assert nxt.slot == lead.slot and nxt.predicted_cached == len(TURN)
    assert nxt.prediction.slot == lead.slot  # (sent pinned there)
    r.complete(nxt, Report(reported_cached=len(TURN)), now=6.0)
    assert r.mispredictions == 0 and r.snapshot()["inflight"] == 0


@pytest.mark.parametrize("end", ["abort", "withdraw"])
def test_a_leader_ending_unserved_leaves_its_followers_ordinary_waiters(end: str) -> None:
    """TURN gives up while it waits: its follower waits for any slot then, and is handed
    the first that frees."""
    r, lead, first, _ = leader_waiting()
    nxt = decide(r, NEXT, now=1.6)
    assert nxt.reasons["follows"] == lead.request_id
    assert (lead.abort(now=2.0) if end == "abort" else lead.withdraw(now=2.0)) == []
    got = r.complete(first, Report(output_tokens=[7] * 4), now=3.0)
    assert [h.request_id for h in got] == [nxt.request_id]


def test_a_leader_aborted_with_an_idle_slot_hands_it_to_its_follower() -> None:
    """A follower released while a slot of its backend is idle is handed it at once."""
    r, lead, first, second = leader_waiting()
    nxt = decide(r, NEXT, now=1.6)
    assert nxt.reasons["follows"] == lead.request_id
    got = r.complete(first, Report(output_tokens=[7] * 4), now=3.0)
    assert [h.request_id for h in got] == [lead.request_id]
    got = lead.abort(now=3.2)
    assert [h.request_id for h in got] == [nxt.request_id]
    r.complete(second, Report(), now=4.0)
    r.complete(nxt, Report(), now=5.0)
    assert r.snapshot()["inflight"] == 0


OTHER = list(range(700_000, 700_100))
FIRST = [*TURN[:2800], *range(800_000, 800_200)]  # a side call over most of TURN


@pytest.mark.parametrize(("why", "prompt", "session", "follows"), [
    ("its next turn", NEXT, None, True),
    ("the same session's side call", [*TURN[:2800], *OTHER], "s1", True),
    ("too little shared", [*TURN[:200], *OTHER], None, False),
    ("another named session's request", NEXT, "s2", False),
])
def test_who_follows(why: str, prompt: list[int], session: str | None,
                     follows: bool) -> None:
    r, _, _, _ = leader_waiting(session="s1")
    d = decide(r, prompt, now=1.6, session=session)
    assert ("follows" in d.reasons) == follows, why
    if not follows:
        assert not d.queued, why  # (the idle backend)


def test_no_follower_when_a_holder_has_as_much() -> None:
    """A RAM entry holds as much of the prompt as the waiter shares: nothing to gain by
    following it (running where that entry is, or waiting there, reuses as much)."""
    r = two_backends()
    old = decide(r, [*TURN, 1], now=0.4)
    r.complete(old, Report(output_tokens=[7] * 4), now=0.45)
    leader_waiting(r, [*TURN, 2])
    d = decide(r, NEXT, now=1.6)
    assert "follows" not in d.reasons


def _served_first(freed_at: float) -> str:
    """One slot, busy; an older short waiter (1,000 tokens), then TURN with three
    followers: which is handed the slot when it frees at ``freed_at``."""
    r = Router()
    r.add_backend(cap("a", ram=0))
    learned(r)
    busy = decide(r, list(range(900_000, 900_050)), now=0.4)
    short = decide(r, list(range(400_000, 401_000)), now=0.5)
    lead = decide(r, TURN, now=0.6)
    for k in range(3):
        f = decide(r, [*TURN, *range(800_000 + 1000 * k, 800_050 + 1000 * k)], now=0.7)
        assert f.reasons.get("follows") == lead.request_id
    got = r.complete(busy, Report(output_tokens=[7] * 4), now=freed_at)
    return {short.request_id: "short", lead.request_id: "leader"}[got[0].request_id]


@pytest.mark.parametrize(("freed_at", "first"), [
    (1.0, "leader"),  # 3,000 tokens serving four requests: 750 each, before 1,000
    (31.0, "short"),  # the short one has waited wait_starve_s: it goes first
])
def test_a_leader_is_served_earlier_but_does_not_starve_others(freed_at: float,
                                                                first: str) -> None:
    assert _served_first(freed_at) == first


# ------------------------------------------------------------------ property
def _prompt(family: int, turn: int) -> list[int]:
    """Turn ``turn`` of conversation ``family``: each turn extends the previous one by
    300 tokens (its first, by 100)."""
    start = 100_000 * (family + 1)
    return list(range(start, start + 100 + 300 * turn))


Op = tuple[str, int, int]
ops = st.lists(st.tuples(st.sampled_from(["decide", "decide", "complete", "abort",
                                          "withdraw"]),
                         st.integers(0, 2), st.integers(0, 1)), max_size=40)


@settings(max_examples=200, deadline=None)
@given(ops, st.integers(1, 2), st.integers(1, 2))
def test_every_request_ends_and_no_waiter_is_stranded(script: list[Op], slots: int,
                                                      backends: int) -> None:
    """Random turns of three conversations decided, completed, aborted, withdrawn: a
    queued request is never left waiting with nothing running on its backend, and once
    all ended no load, queue, target or follower is left."""
    r = Router()
    for name in ("a", "b")[:backends]:
        r.add_backend(cap(name, slots, ram=1 << 20))
    learned(r)
    live: list[Routed] = []
    turns = [0, 0, 0]
    now = 1.0
    for i, (op, fam, again) in enumerate(script):
        now += 0.1
        if op == "decide":  # the conversation's next turn, or (again) the same one
            turns[fam] += 1 - again
            live.append(decide(r, _prompt(fam, turns[fam]), now))
        elif live:
            _end(live.pop(i % len(live)), op, now)
        _check_nothing_stranded(r, live)
    while live:
        running = [d for d in live if d.entry.slot is not None]
        assert running, "a waiter is stranded"
        live.remove(running[0])
        running[0].complete(Report(output_tokens=[7] * 3), now=now)
        now += 0.1
    for st_ in r._backends.values():
        assert not (st_.queued or st_.targets or st_.leader_of or st_.followers)
        assert len(st_.waiting) == 0 and st_.work == 0 and st_.inflight == 0
    assert r.snapshot()["inflight"] == 0


def _end(d: Routed, op: str, now: float) -> None:
    if op == "withdraw":
        d.withdraw(now=now)
    elif op == "abort" or d.entry.slot is None:  # (a held request is sent once handed a slot)
        d.abort(now=now)
    else:
        d.complete(Report(output_tokens=[7] * 3), now=now)


def _check_nothing_stranded(r: Router, live: list[Routed]) -> None:
    for name, st_ in r._backends.items():
        if st_.queued:
            assert any(d.entry.slot is not None for d in live if d.backend == name), name
        for rid, leader in st_.leader_of.items():
            assert rid in st_.followers[leader] and leader in st_.queued


@pytest.mark.parametrize(("why", "prompt", "reuses"), [
    # (FIRST, the follower already behind TURN, shares 2,800 tokens of it)
    ("it extends the follower ahead", [*FIRST, *OTHER], len(FIRST)),
    ("it extends the leader, and shares 2,800 tokens with the follower ahead",
     [*TURN, *OTHER], 2800),
])
def test_a_second_follower_reuses_what_it_shares_with_the_one_ahead(
        why: str, prompt: list[int], reuses: int) -> None:
    """Followers are handed the leader's slot in turn: the second finds the first one's
    prompt there, not the leader's, and is priced by what it shares with that one."""
    r, lead, first, _ = leader_waiting()
    one = decide(r, FIRST, now=1.6)
    assert one.reasons["follows"] == lead.request_id
    two = decide(r, prompt, now=1.7)
    assert two.reasons["follows"] == lead.request_id, why
    assert two.predicted_cached == reuses, why
    handed = {}
    for d in (first, lead, one):
        handed |= {h.request_id: h for h in r.complete(d, Report(output_tokens=[7] * 4),
                                                      now=3.0)}
    assert handed[two.request_id].predicted_cached == reuses, why


@pytest.mark.parametrize(("session", "follows"), [("s1", True), (None, True), ("s2", False)])
def test_a_named_request_follows_only_behind_its_own_session(session: str | None,
                                                             follows: bool) -> None:
    """TURN (session s1) waits, an unnamed side call over it follows: a request over
    that side call follows them when it names s1 or nothing, never when it names
    another session (it would truncate what may be s1's next turn)."""
    r, lead, _, _ = leader_waiting(session="s1")
    one = decide(r, FIRST, now=1.6)
    assert one.reasons["follows"] == lead.request_id
    two = decide(r, [*FIRST, *OTHER], now=1.7, session=session)
    assert ("follows" in two.reasons) == follows
