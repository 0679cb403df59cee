"""Router facade: lifecycle, feedback, failures and the snapshot."""

from __future__ import annotations

import json
from array import array
from typing import Any

import pytest

from proxy.routing.cache.values import BackendCapacity
from proxy.routing.decision import Handoff, NeedWholePrompt, NoBackend, Report
from proxy.routing.routed import Routed
from proxy.routing.router import Router
from proxy.routing.settings import RouterSettings
from proxy.routing.tree.token_bytes import to_token_bytes


def cap(name: str, slots: int = 2, ctx: int = 4096, ram: int = 1 << 30) -> BackendCapacity:
    return BackendCapacity(name, slots, ctx, ram, 8192)


def decide(r: Router, tokens: list[int], now: float = 0.0) -> Routed:
    d = r.decide(tokens, now=now)
    assert isinstance(d, Routed), d
    return d


@pytest.mark.parametrize(
    ("backends", "tokens", "reason", "kind"),
    [
        ([], [1, 2], "no healthy backend", "unavailable"),
        ([cap("a")], [], "empty prompt", "empty"),
        ([cap("a", ctx=10)], list(range(10)), "exceeds every backend's slot context", "too_long"),
    ],
)
def test_no_backend_is_a_result(
    backends: list[BackendCapacity], tokens: list[int], reason: str, kind: str
) -> None:
    r = Router()
    for c in backends:
        r.add_backend(c)
    got = r.decide(tokens)
    assert isinstance(got, NoBackend) and reason in got.reason and got.kind == kind
    assert NoBackend("x").kind == "unavailable"


def test_unknown_policy_rejected() -> None:
    with pytest.raises(ValueError, match="policy"):
        Router("fastest")


def test_complete_extends_slot_and_learns_rate() -> None:
    r = Router()
    r.add_backend(cap("a"))
    d = decide(r, list(range(100)))
    r.complete(d, Report(output_tokens=[7, 8], reported_cached=0, prompt_ms=50.0,
                         prompt_n=100), now=1)
    snap = r.snapshot()
    b = snap["backends"]["a"]  # type: ignore[index]
    assert b["prefill_tps"] == 2000.0 and b["rate_learned"]
    assert b["slots"][d.slot]["tokens"] == 102 and not b["slots"][d.slot]["busy"]
    d2 = decide(r, [*range(100), 7, 8, 9], now=2)
    assert (d2.slot, d2.predicted_cached, d2.tier) == (d.slot, 102, "slot")
    json.dumps(snap)


def test_a_backend_without_timings_is_priced_at_its_peers_learned_rate() -> None:
    """Until a backend reports a prefill, it is priced at the mean learned rate of the
    others (the same model on the same kind of device, mostly), not the default: with
    the default, an untried backend looked 2.5x faster than a measured one (e2e)."""
    r = Router(settings=RouterSettings(default_prefill_tps=1500.0))
    r.add_backend(cap("a", slots=1))
    r.add_backend(cap("b", slots=1))
    rate = lambda name: r.snapshot()["backends"][name]["prefill_tps"]  # noqa: E731
    x = decide(r, list(range(600)))
    y = decide(r, list(range(1000, 1600)))  # x's backend is full: the other one
    assert x.backend != y.backend and rate(x.backend) == rate(y.backend) == 1500.0
    r.complete(x, Report(prompt_ms=1000.0, prompt_n=600), now=1.0)  # 600 tokens/s
    assert rate(x.backend) == rate(y.backend) == 600.0
    r.complete(y, Report(prompt_ms=2000.0, prompt_n=600), now=2.0)  # its own: 300 tokens/s
    assert (rate(x.backend), rate(y.backend)) == (600.0, 300.0)
    r.add_backend(cap("c"))  # new, or back after a restart: the others' mean
    assert rate("c") == 450.0


def test_array_input_equals_list_input() -> None:
    r1, r2 = Router(), Router()
    for r in (r1, r2):
        r.add_backend(cap("a"))
    d1 = decide(r1, list(range(50)))
    d2 = r2.decide(array("i", range(50)))
    assert isinstance(d2, Routed)
    assert (d1.backend, d1.slot, d1.prompt_tokens) == (d2.backend, d2.slot, d2.prompt_tokens)


@pytest.mark.parametrize(("how", "held"), [
    # failed before output: what the slot holds is unknown; cancelled after output (an
    # interrupted turn): the server keeps the slot's state, the whole prompt
    ({}, 0), ({"prefilled": True}, 100),
    # the client left during the prefill; the server went on, and /slots told how far:
    ({"held": None}, 0), ({"held": 0}, 0), ({"held": -5}, 0),  # unknown / nonsense
    ({"held": 40}, 40),                       # it stopped partway: that much of the prompt
    ({"held": 100}, 100), ({"held": 103}, 100),  # all (+ generated tokens: not claimed)
])
def test_abort_frees_slot_and_keeps_what_it_is_known_to_hold(how: dict[str, Any],
                                                              held: int) -> None:
    r = Router()
    r.add_backend(cap("a", slots=1))
    d = decide(r, list(range(100)))
    r.abort(d, **how)
    b = r.snapshot()["backends"]["a"]  # type: ignore[index]
    assert b["slots"][0] == {"id": 0, "busy": False, "tokens": held}
    assert b["inflight"] == 0 and b["work_tokens"] == 0
    assert decide(r, [*range(100), 7]).predicted_cached == held


def test_a_request_only_decoding_counts_its_overhead_as_work() -> None:
    """Once its first token came, a request's prompt is processed: the load bound sees a
    backend streaming answers as lightly loaded, not as if it still had to prefill."""
    r = Router(settings=RouterSettings(request_overhead_tokens=100))
    r.add_backend(cap("a"))
    d = decide(r, list(range(1000)))
    work = lambda: r.snapshot()["backends"]["a"]["work_tokens"]  # noqa: E731
    assert work() == 1100
    r.prefilled(d)
    assert work() == 100
    r.prefilled(d)  # once only
    assert work() == 100
    r.complete(d)
    assert work() == 0


def test_reported_slot_disagreeing_moves_the_content() -> None:
    r = Router("round_robin")
    r.add_backend(cap("a", slots=2))
    d = decide(r, list(range(100)))  # unpinned: model predicts slot 0
    r.complete(d, Report(reported_cached=0, reported_slot=1), now=1)
    d2 = r.decide(list(range(101)), now=2)
    assert isinstance(d2, Routed)
    slots = r.snapshot()["backends"]["a"]["slots"]  # type: ignore[index]
    assert slots[1]["tokens"] == 101 and slots[0]["tokens"] == 0  # server picked slot 1
    assert d2.predicted_cached == 100


def test_remove_and_readd_backend_forgets_everything() -> None:
    r = Router()
    r.add_backend(cap("a"))
    r.add_backend(cap("b"))
    d = decide(r, list(range(100)))
    r.complete(d, now=1)
    r.remove_backend(d.backend)
    assert r.tree.resident_tokens == 0
    r.complete(d, now=2)  # late feedback for a removed backend is ignored
    r.add_backend(cap(d.backend))
    assert decide(r, list(range(100))).predicted_cached == 0


def test_queued_request_is_placed_when_a_slot_frees() -> None:
    r = Router()
    r.add_backend(cap("a", slots=1))
    a = decide(r, list(range(100)))
    q = decide(r, list(range(200, 300)))
    assert q.slot is None
    assert r.tree.match(list(range(200, 300))).matched == 0  # a queued prompt is no KV
    assert list(r._backends["a"].waiting.sharing(to_token_bytes(range(200, 300)))) == [
        (100, q.request_id)]  # the backend's queue has it
    r.complete(a, now=1)
    slots = r.snapshot()["backends"]["a"]["slots"]  # type: ignore[index]
    assert slots[0]["busy"] and slots[0]["tokens"] == 100  # the queued one got it
    r.complete(q, Report(reported_slot=0), now=2)
    assert decide(r, list(range(200, 301)), now=3).predicted_cached == 100
    assert r.snapshot()["inflight"] == 1


def test_mispredictions_counted() -> None:
    r = Router()
    r.add_backend(cap("a"))
    d = decide(r, list(range(10)))
    r.complete(d, Report(reported_cached=5), now=1)
    assert r.snapshot()["mispredictions"] == 1


def test_tree_cap_bounds_memory() -> None:
    r = Router(settings=RouterSettings(max_resident_tokens=1000))
    r.add_backend(cap("a", slots=8))
    for i in range(8):
        d = decide(r, [i + 1] * 400, now=i)
        r.complete(d, now=i + 0.5)
    assert r.tree.resident_tokens <= 1000


def test_unpinned_choice_is_modelled_unpinned() -> None:
    """With unified KV the server clears idle slots into RAM: an empty slot can then only
    reuse the RAM entry if the request is *not* pinned, and the model must say so."""
    r = Router(settings=RouterSettings(kv_unified=True))
    r.add_backend(cap("a", slots=2, ctx=8192))
    doc = list(range(5000, 7000))
    d = decide(r, doc)
    r.complete(d, now=1.0)
    other = decide(r, list(range(100, 200)), now=1.0)  # starts: idle slot saved, cleared
    snap = r.snapshot()["backends"]["a"]  # type: ignore[index]
    assert [s["tokens"] for s in snap["slots"]].count(0) == 1  # type: ignore[index]
    d2 = decide(r, [*doc, 1, 2, 3], now=2.0)
    assert d2.slot is None and d2.tier == "ram" and d2.predicted_cached == len(doc)
    r.complete(d2, Report(reported_cached=len(doc)), now=3.0)
    r.complete(other, now=3.0)
    assert r.mispredictions == 0


def test_int32_bytes_input_equals_list_input() -> None:
    r1, r2 = Router(), Router()
    for r in (r1, r2):
        r.add_backend(cap("a"))
    d1 = decide(r1, list(range(50)))
    d2 = r2.decide(array("i", range(50)).tobytes())
    assert isinstance(d2, Routed)
    assert (d1.backend, d1.slot, d1.prompt_tokens) == (d2.backend, d2.slot, d2.prompt_tokens)


SYSTEM = list(range(100_000, 102_000))  # a 2k-token system prompt


@pytest.mark.parametrize(
    ("order", "want"),
    [
        # both slots free in start order: each waiting request gets the shared prefix
        ([0, 1, 2, 3], [2000, 2000]),
        ([1, 0, 3, 2], [2000, 2000]),
        # the first to wait gets the first freed slot, whichever it is
        ([1, 2, 0, 3], [2000, 2000]),
    ],
)
def test_queued_request_predicted_from_the_slot_it_will_get(
    order: list[int], want: list[int]
) -> None:
    """1 backend x 2 slots, 4 requests sharing a system prompt at once: the last two
    wait on the server, unpinned; when a slot frees the server hands it to the oldest
    one, which keeps the shared prefix. The prediction made when queueing must match the
    placement the model records at hand-off. (Waiting for the first request's busy slot
    is switched off here: it is what the second one would do, see below.)"""
    r = Router(settings=RouterSettings(wait_min_tokens=10**9))
    r.add_backend(cap("a", slots=2, ctx=8192))
    ds = [decide(r, [*SYSTEM, *range(i * 100, i * 100 + 40)]) for i in range(4)]
    assert [d.slot is None for d in ds] == [False, False, True, True]
    assert [d.predicted_cached for d in ds[2:]] == want
    assert all(d.tier == "slot" for d in ds[2:])
    for k, i in enumerate(order):
        if i >= 2 and k < 2:
            continue  # a queued request cannot finish before it has a slot
        r.complete(ds[i], Report(output_tokens=[7] * 5,
                                 reported_cached=ds[i].predicted_cached), now=1.0 + k)
    r.complete(ds[2], Report(reported_cached=ds[2].predicted_cached), now=9.0)
    r.complete(ds[3], Report(reported_cached=ds[3].predicted_cached), now=9.0)
    assert r.mispredictions == 0 and r.snapshot()["inflight"] == 0


def test_handoff_placement_matches_prediction_in_simulation() -> None:
    """The simulator's servers (the cache model as truth, FIFO deferred queue) against
    the router: 8 sessions on a 2k-token system prompt at once over 2 backends x 2
    slots. Every prediction, queued ones included, must equal the reuse it gets."""
    from loadtest.simulate import SimBackend, simulate
    from loadtest.trace import TraceRequest

    system = (1, 2, 3, 4)  # 4 blocks of 512 tokens
    trace = [TraceRequest(0.0, 2048 + 40, 8, (*system, 100 + i)) for i in range(8)]
    be = SimBackend(n_slots=2, slot_ctx=8192, ram_cache_tokens=100_000,
                    prefill_tps=1500.0, decode_tps=20.0)
    res = simulate(trace, "prefix", 2, be)
    assert res.requests == 8 and res.mispredicted == 0.0
    assert res.req_imbalance <= 5 / 4


def test_complete_returns_the_handoff_of_the_oldest_queued_request() -> None:
    r = Router()
    r.add_backend(cap("a", slots=1, ctx=8192))
    r.disk.spills("a")
    first = decide(r, [*SYSTEM, 1])
    q1 = decide(r, [*SYSTEM, 2])
    q2 = decide(r, [*SYSTEM, 3])
    assert not first.queued and q1.queued and q2.queued
    assert (q1.reasons["queued"], q2.reasons["queued"]) == (1, 2)
    got = r.complete(first, Report(output_tokens=[7]), now=1.0)
    assert got == [Handoff(q1.request_id, "a", 0, q1.predicted_cached)]
    # (what the slot held goes with it, for the disk tier to spill: the request
    # displaces the first one's turn)
    assert got[0].displaced == array("i", [*SYSTEM, 1, 7]).tobytes()
    assert r.abort(q2) == []  # still waiting: nothing freed
    assert r.complete(q1, now=2.0) == []
    assert r.snapshot()["inflight"] == 0


@pytest.mark.parametrize(("min_tokens", "stays"), [(1024, True), (10**9, False)])
@pytest.mark.parametrize("on_head", [False, True])
def test_a_continuing_conversation_is_not_moved_off_a_busy_holder(
        min_tokens: int, stays: bool, on_head: bool) -> None:
    # Claude Code's case: backend A holds conversation X (19k tokens) in an idle slot
    # while a cold 19k-token prompt Z runs in its other slot; B is idle. X's next turn
    # adds ~100 tokens on A but would recompute all 19k on B. The load bound alone would
    # send it to B (A's in-flight work is far above the mean); continuations are exempt
    # (min_tokens=10**9 switches the exemption off: the bound then moves it).
    # on_head: the turn is decided on its seen history only (the proxy tokenizes the new
    # text beside the send), which matches the slot up to X but not the answer after it
    r = Router(settings=RouterSettings(continuation_min_tokens=min_tokens))
    r.add_backend(cap("a", ctx=32768))
    r.add_backend(cap("b", ctx=32768))
    x, y, z = ([base + i for i in range(19_000)] for base in (1, 100_000, 200_000))
    answer = [7] * 47
    dx, dy = decide(r, x), decide(r, y)
    assert dx.backend != dy.backend
    r.complete(dx, Report(output_tokens=answer, reported_cached=0))
    dz = decide(r, z)
    assert dz.backend == dx.backend  # the other backend is busy with y
    r.complete(dy, Report(output_tokens=[8], reported_cached=0))
    whole = [*x, *answer, *range(300_000, 300_100)]
    turn = r.decide(x, n_prompt=len(whole)) if on_head else r.decide(whole)
    if on_head and not stays:  # it would move off its holder: decided on the whole
        assert isinstance(turn, NeedWholePrompt), turn
        turn = r.decide(whole)
    assert isinstance(turn, Routed)
    assert (turn.backend == dx.backend) is stays, turn.reasons
    if stays:
        assert turn.predicted_cached >= len(x), turn.reasons


@pytest.mark.parametrize("other_session_idle", [True, False])
def test_side_call_waits_for_its_sessions_busy_slot(other_session_idle: bool) -> None:
    """An agent's summary call is sent together with its session's next turn: it shares
    the whole history and diverges only at the end. The session's slot is busy; idle
    slots hold another session or nothing. It waits for the session's slot (held, then
    handed that slot pinned, with the reuse predicted when it was queued) instead of
    recomputing the history elsewhere or truncating the other session."""
    r = Router()
    for name in ("a", "b"):
        r.add_backend(cap(name, slots=2, ctx=16384))
    x = [*SYSTEM, *range(10_000, 11_500)]  # session X: 2k shared + 1.5k of its own
    y = [*SYSTEM, *range(20_000, 21_500)]
    dx = decide(r, x)
    # feedback as the backend reports it: 0.9 s of prefill in a 1 s request
    r.complete(dx, Report(output_tokens=[7] * 4, prompt_ms=900.0, prompt_n=len(x)), now=1.0)
    dy = decide(r, y, now=1.0)
    if other_session_idle:
        r.complete(dy, Report(output_tokens=[7] * 4), now=2.0)
    x2 = [*x, 7, 7, 7, 7, *range(12_000, 12_100)]  # X's next turn: its slot, busy
    d2 = decide(r, x2, now=2.0)
    assert (d2.backend, d2.slot) == (dx.backend, dx.slot)
    summary = [*x2[:-5], *range(13_000, 13_010)]
    ds = decide(r, summary, now=2.0)
    assert ds.queued and ds.slot is None
    assert (ds.backend, ds.reasons["waits_for_slot"]) == (dx.backend, dx.slot)
    assert ds.predicted_cached == len(x2) - 5
    got = r.complete(d2, Report(output_tokens=[7] * 4,
                                reported_cached=d2.predicted_cached), now=3.0)
    assert got == [Handoff(ds.request_id, dx.backend, dx.slot, ds.predicted_cached)]
    r.complete(ds, Report(reported_cached=ds.predicted_cached), now=4.0)
    if not other_session_idle:
        r.complete(dy, now=4.0)
    assert r.mispredictions == 0 and r.snapshot()["inflight"] == 0
    # Y's history is still whole wherever it went
    y2 = decide(r, [*y, 7, 7, 7, 7, 1], now=5.0)
    assert y2.predicted_cached >= len(y)


@pytest.mark.parametrize(("session", "stays"), [("X", True), (None, False), ("Y", False)])
def test_a_side_call_stays_with_its_sessions_history_over_the_load_bound(
        session: str | None, stays: bool) -> None:
    """The load test's case (BENCHMARKS.md, "agentic, session 5"): backends prefilling
    ~170 tokens/s (the bound's slack is then ~340 tokens), session X's 8k-token history
    on one backend whose slot runs X's next turn (800 new tokens), the other backend
    idle. X's summary shares the history but not the turn's end, so it is no
    continuation, and the bound would send it to recompute 8k tokens on the idle backend
    (~47 s instead of ~5). Named as X's, it stays; unnamed or another session's (a new
    conversation over a prompt one backend alone holds), the bound still spreads it."""
    r = Router()
    for name in ("a", "b"):
        r.add_backend(cap(name, slots=2, ctx=16384))
    for i, name in enumerate(("a", "b")):  # both learn the slow rate
        warm = r.decide([500_000 + 1000 * i + j for j in range(340)])
        assert isinstance(warm, Routed) and warm.backend == name
        r.complete(warm, Report(prompt_ms=2000.0, prompt_n=340), now=1.0)
    x = list(range(10_000, 18_000))
    dx = r.decide(x, session="X", now=1.0)
    assert isinstance(dx, Routed)
    r.complete(dx, Report(output_tokens=[7] * 4, prompt_ms=47_000.0, prompt_n=len(x)), now=48.0)
    turn = r.decide([*x, 7, 7, 7, 7, *range(20_000, 20_800)], session="X", now=48.0)
    assert isinstance(turn, Routed) and turn.backend == dx.backend
    summary = [*x, 7, 7, 7, 7, *range(30_000, 30_010)]
    ds = r.decide(summary, session=session, now=48.0)
    assert isinstance(ds, Routed)
    assert (ds.backend == dx.backend) is stays, ds.reasons
    if stays:
        assert ds.predicted_cached >= len(x), ds.reasons
    elif session is None:  # (another named session does not even wait for X's slot)
        assert "over bound" in str(ds.reasons["why"]), ds.reasons


@pytest.mark.parametrize(("sessions", "waits"), [(("s0", "s2"), False), (("s0", None), True),
                                                 ((None, "s2"), True)])
def test_a_new_session_does_not_wait_for_another_named_sessions_busy_slot(
        sessions: tuple[str | None, str | None], waits: bool) -> None:
    """The load test's case: session s0 (a 6k shared prefix + its own 1.4k) runs its turn
    in a0, s1 in b0; a new session s2 over the same prefix arrives, the other slots
    empty. Waiting for a0 is sooner than a cold start, but hands s2 the slot s0's next
    turn needs in seconds (truncated to the shared prefix). Named sessions: s2 starts
    cold in an empty slot. Unnamed (either one), the wait stays an option."""
    r = Router()
    for name in ("a", "b"):
        r.add_backend(cap(name, slots=2, ctx=16384))
    shared = list(range(100_000, 106_084))
    s0 = [*shared, *range(1000, 2010)]
    s1 = [*shared, *range(2000, 3010)]
    d0 = r.decide(s0, session=sessions[0])
    d1 = r.decide(s1, session="s1")
    assert isinstance(d0, Routed) and isinstance(d1, Routed)
    r.complete(d0, Report(output_tokens=[7] * 4, prompt_ms=20_000.0, prompt_n=len(s0)), now=20.0)
    r.complete(d1, Report(output_tokens=[8] * 4, prompt_ms=20_000.0, prompt_n=len(s1)), now=21.0)
    t0 = r.decide([*s0, 7, 7, 7, 7, *range(3000, 3355)], session=sessions[0], now=22.0)
    t1 = r.decide([*s1, 8, 8, 8, 8, *range(4000, 4355)], session="s1", now=22.0)
    assert isinstance(t0, Routed) and isinstance(t1, Routed)
    assert {(t0.backend, t0.slot), (t1.backend, t1.slot)} == {(d0.backend, d0.slot),
                                                              (d1.backend, d1.slot)}
    d2 = r.decide([*shared, *range(5000, 6010)], session=sessions[1], now=22.5)
    assert isinstance(d2, Routed)
    assert ("waits_for_slot" in d2.reasons) is waits, d2.reasons
    if not waits:
        assert not d2.queued and d2.predicted_cached == 0


def test_no_wait_when_running_now_elsewhere_is_faster() -> None:
    """A busy slot holding the prompt's prefix is not worth waiting for when an idle
    backend would answer sooner: a burst of new sessions over one system prompt spreads
    instead of queueing for the first one's slot."""
    r = Router()
    for name in ("a", "b"):
        r.add_backend(cap(name, slots=2, ctx=16384))
    first = decide(r, [*SYSTEM, *range(10_000, 10_040)])
    # learns that requests decode long after their prefill: a busy slot frees late
    r.complete(first, Report(prompt_ms=1000.0, prompt_n=2040), now=30.0)
    busy = decide(r, [*SYSTEM, *range(20_000, 20_040)], now=30.0)
    d = decide(r, [*SYSTEM, *range(30_000, 30_040)], now=30.0)
    assert not d.queued and "waits_for_slot" not in d.reasons
    assert d.slot is not None and (d.backend, d.slot) != (busy.backend, busy.slot)


def test_a_waiter_gives_up_on_a_slot_that_runs_long() -> None:
    """The slot waited for runs far past its expected end (a long generation): the waiter
    is told to give up, and decided again it does not wait for that slot anew."""
    r = Router(settings=RouterSettings(wait_grace_s=5.0))
    for name in ("a", "b"):
        r.add_backend(cap(name, slots=2, ctx=16384))
    x = [*SYSTEM, *range(10_000, 11_500)]
    first = decide(r, x)
    r.complete(first, Report(output_tokens=[7] * 4, prompt_ms=5000.0, prompt_n=len(x)), now=6.0)
    turn = decide(r, [*x, 7, 7, 7, 7, *range(12_000, 12_100)], now=6.0)
    side = decide(r, [*x, 7, 7, 7, 7, *range(13_000, 13_010)], now=6.0)
    assert side.reasons["waits_for_slot"] == turn.slot
    assert not r.wait_overdue(side, now=8.0)
    assert r.wait_overdue(side, now=60.0)
    r.abort(side, now=60.0)
    again = decide(r, [*x, 7, 7, 7, 7, *range(13_000, 13_010)], now=60.0)
    assert "waits_for_slot" not in again.reasons and not again.queued
    r.complete(turn, now=61.0)


def test_a_waiter_whose_backend_left_and_came_back_gives_up() -> None:
    """A breaker trip removes the backend (its queue too) and a probe may bring it back
    within the waiter's 1 s check: nothing would ever hand the waiter a slot, and it was
    never overdue (held until its client gave up)."""
    r = Router()
    r.add_backend(cap("a", slots=1, ctx=16384))
    busy = decide(r, list(range(2000)))
    waiter = decide(r, [*range(2000), 7])
    assert waiter.queued and not r.wait_overdue(waiter, now=0.5)
    r.remove_backend("a")
    assert r.wait_overdue(waiter, now=0.6)  # gone
    r.add_backend(cap("a", slots=1, ctx=16384))
    assert r.wait_overdue(waiter, now=0.7)  # back, fresh: it is not waited for there
    assert r.complete(busy) == [] and r.abort(waiter) == []


HISTORY = list(range(1000, 1400))  # a conversation's first turn (prompt)
ANSWER = [7, 8, 9]  # what the backend generated for it


@pytest.mark.parametrize(
    ("rest", "reuse"),
    [
        # the next turn: the head stops before the answer's re-rendered tokens, which go
        # on matching what the slot holds: the whole prediction comes with the rest
        ([*ANSWER, 50, 51, 52], 403),
        ([7, 50, 51], 401),  # the rest matches the answer's first token only
        ([60, 61], 400),  # nothing of the rest was held
    ],
)
def test_decided_on_the_head_then_extended_as_if_decided_whole(rest: list[int],
                                                               reuse: int) -> None:
    """`decide(head, n_prompt=...)` + `extend(whole)` ends where `decide(whole)` does: same
    slot, same predicted reuse, same model state after `complete`."""
    def first_turn(r: Router) -> int:
        r.add_backend(cap("a"))
        d = decide(r, HISTORY)
        r.complete(d, Report(output_tokens=ANSWER), now=1)
        assert d.slot is not None
        return d.slot

    whole = HISTORY + rest
    ref, r = Router(), Router()
    first_turn(ref)
    slot = first_turn(r)
    want = decide(ref, whole, now=2)
    head = r.decide(HISTORY, now=2, n_prompt=len(whole) + 5)  # an estimate, not exact
    assert isinstance(head, Routed) and head.slot == slot == want.slot
    assert head.reasons["head"] == len(HISTORY) and head.predicted_cached == 400
    got = r.extend(head, whole)
    assert (got.prompt_tokens, got.predicted_cached) == (len(whole), reuse)
    assert (want.prompt_tokens, want.predicted_cached) == (len(whole), reuse)
    assert r.extend(got, whole) == got  # once only
    for router, d in ((ref, want), (r, got)):
        router.complete(d, Report(output_tokens=[5], reported_cached=reuse), now=3)
    assert r.snapshot()["backends"] == ref.snapshot()["backends"]
    nxt = [*whole, 5, 99]
    assert decide(r, nxt, now=4).predicted_cached == decide(ref, nxt, now=4).predicted_cached


def test_not_moved_off_its_history_on_the_head_alone() -> None:
    """A summary sent with its turn: its head (the history) is held by the slot running
    the turn, which also holds the turn's tool result, unknown to a decision on the
    head. On the head alone, waiting there looks like truncating 600 unknown tokens
    (charged as destroyed history) and an idle backend wins: the router asks for the
    whole prompt instead of moving it, records nothing, and decided whole it waits for
    the turn's slot and reuses the tool result too."""
    r = Router()
    r.add_backend(cap("a", slots=1, ctx=16384))
    r.add_backend(cap("b", slots=2, ctx=16384))
    x = list(range(10_000, 14_712))
    d = decide(r, x)
    warm = decide(r, list(range(40_000, 41_500)))  # the other backend, learning its rate
    assert warm.backend != d.backend
    r.complete(d, Report(output_tokens=[7] * 4, reported_cached=0, prompt_ms=7_800.0,
                         prompt_n=len(x)), now=8.0)
    r.complete(warm, Report(reported_cached=0, prompt_ms=1_000.0, prompt_n=1500),
               now=8.0)  # 2.5x faster
    tool = list(range(20_000, 20_600))
    turn = decide(r, [*x, 7, 7, 7, 7, *tool], now=8.0)
    assert (turn.backend, turn.slot) == (d.backend, d.slot)
    head = [*x, 7, 7, 7, 7]
    whole = [*head, *tool[:-2], *range(30_000, 30_010)]
    got = r.decide(head, n_prompt=len(whole), now=8.1)
    assert isinstance(got, NeedWholePrompt), got
    assert got.most_held >= len(head) > got.reuse
    assert r.snapshot()["inflight"] == 1  # nothing recorded
    ds = decide(r, whole, now=8.1)
    assert ds.queued and ds.reasons["waits_for_slot"] == d.slot and ds.backend == d.backend
    assert ds.predicted_cached == len(head) + len(tool) - 2


def test_a_head_that_two_conversations_hold_waits_for_the_whole_prompt() -> None:
    """Two conversations over one system prompt, each in its own slot: a next turn's head
    (the system prompt) is held whole by both, so the head cannot tell where it goes on:
    the router asks for the whole prompt, which goes back to its own conversation."""
    r = Router()
    r.add_backend(cap("a", slots=2))
    system = list(range(1_000, 1_700))
    convs = [[*system, *range(5_000 + 1_000 * k, 5_250 + 1_000 * k)] for k in (0, 1)]
    firsts = [decide(r, c) for c in convs]
    assert {d.slot for d in firsts} == {0, 1}
    for d in firsts:
        r.complete(d, Report(output_tokens=[7]), now=1)
    whole = [*convs[1], 7, *range(9_000, 9_020)]
    got = r.decide(system, n_prompt=len(whole), now=2)
    assert isinstance(got, NeedWholePrompt), got
    assert r.snapshot()["inflight"] == 0  # nothing recorded
    d = decide(r, whole, now=2)
    assert d.slot == firsts[1].slot and d.predicted_cached == len(convs[1]) + 1
    one = Router()  # one holder of the whole head: decided on it
    one.add_backend(cap("a", slots=1))
    one.complete(decide(one, convs[0]), Report(output_tokens=[7]), now=1)
    assert isinstance(one.decide(system, n_prompt=len(whole), now=2), Routed)


def test_extend_after_the_request_ended_or_with_another_prompt_changes_nothing() -> None:
    r = Router()
    r.add_backend(cap("a"))
    d = r.decide(HISTORY, n_prompt=500)
    assert isinstance(d, Routed)
    assert r.extend(d, [1, 2, *HISTORY]) == d  # not an extension of the head
    r.abort(d)
    assert r.extend(d, [*HISTORY, 1, 2]) == d
    assert r.snapshot()["backends"]["a"]["work_tokens"] == 0  # type: ignore[index]


def test_a_slot_ended_before_a_hand_off_was_saved_by_it() -> None:
    """Two slots end in one server step; the proxy reads B's end first and hands a queued
    request Q B's slot. On the server, Q's start saves the other idle slot (A's finished
    conversation) to RAM (--cache-idle-slots); the model heard of A's end only after
    that start, so it saved nothing, and A's next turn was predicted 3 where the server
    loaded A from RAM and reused all of it (found live: tools/h4 in session 9)."""
    def toks(seed: int, n: int) -> list[int]:
        return [1000 + seed * 10000 + i for i in range(n)]

    a, b, q = [1, 2, 3, *toks(1, 3300)], [1, 2, 3, *toks(2, 2000)], [1, 2, 3, *toks(3, 2100)]
    a_out = toks(9, 29)
    r = Router()
    r.add_backend(BackendCapacity("x", 2, 8192, 1 << 30, 8192))
    da = r.place(r.decide(a, defer=True))
    db = r.place(r.decide(b, defer=True))
    dq = r.decide(q, defer=True)
    assert dq.queued
    a_end = r.starts("x")  # A's end reached the proxy (its answer not yet read)
    h = r.complete(db, Report(output_tokens=toks(8, 29)))  # B's read first: Q gets slot 1
    assert [x.slot for x in h] == [db.slot]
    r.complete(da, Report(output_tokens=a_out, starts_before_end=a_end))
    # a side call keeps slot 0 (shares 2600 of its 3332 tokens: truncated, not saved)
    dt = r.place(r.decide([*a[:2600], *toks(4, 30)], session="side", defer=True))
    assert dt.slot == da.slot
    a2 = [*a, *a_out, *toks(5, 400)]
    d2 = r.decide(a2, session="conv-a", defer=True)
    assert d2.queued  # both slots busy (T, Q)
    # Q ends: A's turn gets its slot, which shares nothing with it: the server saves
    # the slot and loads the best RAM entry, A's whole conversation
    assert (dq.slot, dq.predicted_cached) == (h[0].slot, h[0].predicted_cached)
    handed = r.complete(dq, Report(output_tokens=toks(7, 29)))
    assert [(x.request_id, x.slot) for x in handed] == [(d2.request_id, h[0].slot)]
    assert handed[0].predicted_cached == len(a) + len(a_out)


@pytest.mark.parametrize("posted_first", [False, True])
def test_a_waiter_keeping_a_slot_a_start_saved_is_sent_after_that_start(
        posted_first: bool) -> None:
    """As above, A and B end in one server step, B's read first hands Q B's slot; A's
    next turn waits for A's slot. Q's start saves A's slot as an idle one, unless A's
    turn is posted before Q (a short prompt tokenized first) and keeps the slot: it is
    sent only once Q is known posted (seen live: the model saved A's slot, the server
    did not, and a later turn was predicted to load it: 123 predicted, 3 reported). Q
    posted by then: nothing to wait for (C, started before the read and not posted
    either, is no saver)."""
    def toks(seed: int, n: int) -> list[int]:
        return [1000 + seed * 10000 + i for i in range(n)]

    a, b, q = [1, 2, 3, *toks(1, 3300)], [1, 2, 3, *toks(2, 2000)], [1, 2, 3, *toks(3, 2100)]
    r = Router()
    r.add_backend(BackendCapacity("x", 3, 8192, 1 << 30, 8192))
    r.place(r.decide([1, 2, 3, *toks(6, 1500)], defer=True))  # C, running throughout
    da = r.place(r.decide(a, defer=True))
    db = r.place(r.decide(b, defer=True))
    dq = r.decide(q, defer=True)
    a_out = toks(9, 29)
    d2 = r.decide([*a, *a_out, *toks(5, 400)], defer=True)
    assert dq.queued and d2.queued
    a_end = r.starts("x")  # A's end reached the proxy (its answer not yet read)
    h = r.complete(db, Report(output_tokens=toks(8, 29)))  # B's read first: Q gets slot 1
    assert [x.request_id for x in h] == [dq.request_id]
    if posted_first:
        dq.posted()
    got = r.complete(da, Report(output_tokens=a_out, starts_before_end=a_end))
    assert [(x.request_id, x.slot, x.tier) for x in got] == [(d2.request_id, da.slot, "slot")]
    ram = r.snapshot()["backends"]["x"]["ram_entries"]  # type: ignore[index]
    assert [e for e in ram if e["tokens"] == len(a) + len(a_out)], ram
    after = None if posted_first else dq.request_id
    assert got[0].after == after and r.held_for(d2) == after
    dq.posted()
    assert r.held_for(d2) is None


@pytest.mark.parametrize("heard_first", [False, True])
def test_a_start_unlaunched_when_a_slot_ended_saved_that_slot(heard_first: bool) -> None:
    """Y is sent while X's slot is busy; X ends. If Y's launch was not heard by then
    (its stream's head had not come: the server was still tokenizing it), the server
    launched it after X's slot was freed and saved that slot to RAM as an idle one; if
    it was, the server launched Y while X ran and saved nothing."""
    r = Router()
    r.add_backend(cap("a", slots=2))
    x = decide(r, list(range(1000, 1500)))
    y = decide(r, list(range(3000, 3400)))
    assert r.unlaunched("a") == 0  # (decided, not sent)
    x.sending()
    x.launched()
    y.sending()
    assert r.unlaunched("a") == 1
    x.first_token()
    if heard_first:
        y.launched()
    r.complete(x, Report(output_tokens=[5, 6], starts_before_end=r.starts("a"),
                         unlaunched_at_end=r.unlaunched("a")))
    saved = r.snapshot()["backends"]["a"]["ram_entries"]  # type: ignore[index]
    assert len(saved) == (0 if heard_first else 1), saved
    r.complete(y, Report(output_tokens=[7]))
    assert r.unlaunched("a") == 0


@pytest.mark.parametrize("why", ["another slot prefilling", "adapters"])
def test_nothing_is_saved_for_an_unlaunched_start_when_the_order_is_unknown(why: str
                                                                             ) -> None:
    """As above, Y unlaunched when X ends, but the server's order cannot be told: a slot
    still prefilling, or a slot under other adapters, keeps Y's slot out of the batch
    (its head then comes late, though it was launched). Nothing is saved."""
    r = Router()
    lora = (1.0, 1.0) if why == "adapters" else ()
    r.add_backend(BackendCapacity("a", 3, 4096, 1 << 30, 8192, lora=lora))
    x = decide(r, list(range(1000, 1500)))
    other = decide(r, list(range(6000, 6600)))
    y = decide(r, list(range(3000, 3400)))
    for d in (x, other, y):
        d.sending()
    for d in (x, other):
        d.launched()
    x.first_token()
    if why != "another slot prefilling":
        other.first_token()
    r.complete(x, Report(output_tokens=[5, 6], starts_before_end=r.starts("a"),
                         unlaunched_at_end=r.unlaunched("a")))
    ram = r.snapshot()["backends"]["a"]["ram_entries"]  # type: ignore[index]
    assert not [e for e in ram if e["tokens"] == 502], ram


@pytest.mark.parametrize("waiter", ["next turn", "unrelated", "peer"])
def test_a_waiter_keeping_a_slot_an_unlaunched_start_saves_is_sent_after_it(
        waiter: str) -> None:
    """X and Z run, Y is sent to the third slot; Q waits; X ends before Y's head comes.
    The server launches Y after X's slot freed and saves that slot as an idle one,
    unless Q is posted before Y and keeps it: X's next turn, handed X's slot, is sent
    only once Y is known posted, so the save is certain (seen live: the model saved
    nothing, and a later turn loaded that entry: predicted 3, reported 123). An
    unrelated Q replaces X's content, saving it at its own start: not held. Another
    replica's request waiting for X's slot is sent by that replica, whose order is not
    known: nothing is saved at Y's launch then (its own start saves X's slot)."""
    r = Router()
    r.add_backend(cap("a", slots=3))
    x = decide(r, list(range(1000, 1500)))
    z = decide(r, list(range(2000, 2600)))
    for d in (x, z):
        d.sending()
        d.launched()
        d.first_token()
    y = decide(r, list(range(3000, 3400)))
    y.sending()
    if waiter == "peer":  # (it waits for X's slot, ahead of this replica's waiters)
        q = r.observe_start("a", x.slot, to_token_bytes(list(range(4000, 4300))))
        assert q is not None
    else:
        q = decide(r, [*range(1000, 1500), 5, 6, *range(7000, 7050)] if waiter == "next turn"
                   else list(range(8000, 8300)))
    assert q.queued and not r.unposted(y.request_id)  # (Y's own start saved nothing)
    got = r.complete(x, Report(output_tokens=[5, 6], starts_before_end=r.starts("a"),
                               unlaunched_at_end=r.unlaunched("a")))
    assert [h.request_id for h in got] == [q.request_id]
    if waiter == "peer":
        assert not r.unposted(y.request_id)
        return
    ram = r.snapshot()["backends"]["a"]["ram_entries"]  # type: ignore[index]
    assert [e for e in ram if e["tokens"] == 502] and r.unposted(y.request_id), ram
    after = y.request_id if waiter == "next turn" else None
    assert got[0].after == after and r.held_for(q) == after
    y.posted()
    assert r.held_for(q) is None


def test_another_replicas_start_is_never_waited_for_launching() -> None:
    """Another replica's request is started in the model, but its launch is heard by
    that replica only: never counted unlaunched here (every end would save its slot)."""
    r = Router()
    r.add_backend(cap("a", slots=2))
    peer = r.observe_start("a", 1, to_token_bytes(list(range(3000, 3400))))
    assert peer is not None
    peer.sending()  # (not this replica's to send: nothing changes)
    assert r.unlaunched("a") == 0


def test_an_unlaunched_request_is_forgotten_when_it_ends() -> None:
    r = Router()
    r.add_backend(cap("a", slots=1))
    x = decide(r, list(range(1000, 1500)))
    x.sending()
    assert r.unlaunched("a") == 1
    r.abort(x)
    assert r.unlaunched("a") == 0


def test_a_correction_of_the_model_is_no_task_start() -> None:
    """A request the server ran in another slot than modelled is moved there in the
    model, a start() that is no new task on the server: it saved the request's own slot
    to RAM as if one had started after its end (the model then held a RAM entry the
    server never made)."""
    r = Router("round_robin")
    r.add_backend(cap("a", slots=2))
    d = r.decide(list(range(1000, 1300)))
    assert isinstance(d, Routed) and d.slot is None  # round robin: the server's pick
    busy = [x["id"] for x in r.snapshot()["backends"]["a"]["slots"] if x["busy"]]  # type: ignore[index]
    starts = r.starts("a")
    r.complete(d, Report(output_tokens=[5, 6, 7], reported_slot=1 - busy[0],
                         starts_before_end=starts))
    assert r.starts("a") == starts
    assert r.snapshot()["backends"]["a"]["ram_entries"] == []  # type: ignore[index]


def test_a_turn_queued_behind_its_busy_history_waits_for_that_slot() -> None:
    """Both slots busy, the next turn of the conversation in slot 0 comes: it waits for
    slot 0, not for the first slot to free (there it would recompute its history)."""
    r = Router()
    r.add_backend(cap("a", slots=2, ctx=8192))
    conv = list(range(5000, 7000))
    x = decide(r, conv)
    y = decide(r, list(range(9000, 9400)))
    new = [decide(r, list(range(k, k + 300))) for k in (20000, 30000)]
    turn = decide(r, [*conv, *range(7000, 7100)])
    assert (x.slot, y.slot, turn.queued) == (0, 1, True)
    assert turn.predicted_cached == len(conv)
    got = r.complete(y, now=1.0)  # slot 1 frees first: not the turn's
    assert [h.request_id for h in got] == [new[0].request_id]
    got = r.complete(x, now=2.0)
    assert got == [Handoff(turn.request_id, "a", 0, len(conv))]


def test_a_freed_slot_goes_to_the_waiter_whose_history_it_holds() -> None:
    """Both slots busy; a new conversation queues, then the next turn of the one in slot
    0. Slot 0 frees first: the proxy holds both, so the turn gets its own history (the
    server's queue would give it to the older request, which would truncate it)."""
    r = Router()
    r.add_backend(cap("a", slots=2, ctx=8192))
    conv = list(range(5000, 7000))
    x = decide(r, conv)
    y = decide(r, list(range(9000, 9400)))
    new = decide(r, list(range(20000, 20300)))
    turn = decide(r, [*conv, *range(7000, 7100)])
    assert (x.slot, y.slot, new.queued, turn.queued) == (0, 1, True, True)
    assert turn.predicted_cached == len(conv)
    got = r.complete(x, now=1.0)
    assert got == [Handoff(turn.request_id, "a", 0, len(conv))]
    got = r.complete(y, now=2.0)
    assert [(h.request_id, h.slot) for h in got] == [(new.request_id, 1)]


def test_a_request_goes_only_among_the_backends_that_serve_it() -> None:
    """The backend holding the prompt does not serve this request (another kind of
    server): it goes to one that does, predicted from what that one holds; none: no
    backend."""
    r = Router("prefix")
    for name in ("a", "b"):
        r.add_backend(BackendCapacity(name, 2, 4096, 0, 1024))
    prompt = list(range(100, 400))
    first = r.decide(prompt, among={"a"})
    assert isinstance(first, Routed) and first.backend == "a"
    r.complete(first, Report(output_tokens=[], reported_cached=0), now=1.0)
    again = r.decide(prompt, among={"b"}, now=2.0)
    assert isinstance(again, Routed) and again.backend == "b"
    assert again.predicted_cached == 0
    assert isinstance(r.decide(prompt, among=frozenset(), now=3.0), NoBackend)


def test_a_decision_claims_a_slot_it_does_not_go_on_from() -> None:
    """An empty slot, or another conversation's past a shared prefix: claimed (replicas
    settle who keeps it). The next turn of the conversation a slot holds, or a side call
    of the session that used it last: not."""
    r = Router("prefix")
    r.add_backend(BackendCapacity("x", 1, 8192, 0, 8192))
    system = list(range(10_000, 10_400))
    first = r.decide([*system, *range(1, 200)], session="s", now=0.0)
    assert isinstance(first, Routed) and first.prediction.claims
    r.complete(first, Report(output_tokens=[7, 8]), now=1.0)
    turn = r.decide([*system, *range(1, 200), 7, 8, 9, 10], session="t", now=2.0)
    assert isinstance(turn, Routed) and not turn.prediction.claims
    r.complete(turn, Report(output_tokens=[5]), now=3.0)
    side = r.decide([*system, *range(1, 150), 42], session="t", now=4.0)
    assert isinstance(side, Routed) and not side.prediction.claims
    r.complete(side, Report(output_tokens=[5]), now=5.0)
    other = r.decide([*system, *range(500, 700)], session="u", now=6.0)
    assert isinstance(other, Routed) and other.slot == 0 and other.prediction.claims


SYSTEM_PROMPT = list(range(10_000, 10_400))


@pytest.mark.parametrize(("prompt", "head", "claims"), [
    # a new conversation over the system prompt, decided on its head (that prompt)
    ([*SYSTEM_PROMPT, *range(500, 700)], len(SYSTEM_PROMPT), True),
    # the same, whole: it shares the system prompt only
    ([*SYSTEM_PROMPT, *range(500, 700)], None, True),
    # A's next turn, whole or decided on a head that reaches into A's own part
    ([*SYSTEM_PROMPT, *range(1, 200), 7, 8, 9], None, False),
    ([*SYSTEM_PROMPT, *range(1, 200), 7, 8, 9], len(SYSTEM_PROMPT) + 100, False),
])
def test_a_claim_is_told_by_what_the_slot_holds_of_its_own(
        prompt: list[int], head: int | None, claims: bool) -> None:
    """One slot holds conversation A over a system prompt. Only a request that goes on
    from all of A does not claim the slot; decided on a head, that is known once its
    whole prompt is."""
    r = Router("prefix")
    r.add_backend(BackendCapacity("x", 1, 8192, 0, 8192))
    a = decide(r, [*SYSTEM_PROMPT, *range(1, 200)])
    r.complete(a, Report(output_tokens=[7, 8]), now=1.0)
    d = r.decide(prompt if head is None else prompt[:head], now=2.0,
                 n_prompt=None if head is None else len(prompt))
    assert isinstance(d, Routed) and d.slot == a.slot
    if head is not None:  # its head ends inside A's sequence: a claim until known whole
        assert d.prediction.claims
        d.extend(prompt)
    assert d.prediction.claims == claims


@pytest.mark.parametrize("head", [None, 300])
def test_a_slot_holding_only_a_shared_prompt_is_claimed(head: int | None) -> None:
    """A slot that holds just the system prompt other slots hold too (a conversation cut
    back to it) is one any new conversation over that prompt would take: a claim, its
    whole prompt known or not."""
    r = Router("prefix")
    r.add_backend(BackendCapacity("x", 2, 8192, 0, 8192))
    a = decide(r, [*SYSTEM_PROMPT, *range(1, 200)])
    r.complete(a, Report(output_tokens=[7, 8]), now=1.0)
    assert r.observe("x", 1 - a.slot, to_token_bytes(SYSTEM_PROMPT), now=1.5)
    prompt = [*SYSTEM_PROMPT, *range(500, 700)]
    d = r.decide(prompt if head is None else prompt[:head], now=2.0,
                 n_prompt=None if head is None else len(prompt))
    assert isinstance(d, Routed) and d.slot == 1 - a.slot and d.prediction.claims
    d.extend(prompt)
    assert d.prediction.claims


def test_a_withdrawn_request_leaves_its_slot_what_it_shared_with_it() -> None:
    """Never sent: the slot keeps what it held of the prompt (here the system prompt the
    last conversation left), and a request waiting for the slot is handed it."""
    r = Router("prefix")
    r.add_backend(BackendCapacity("x", 1, 8192, 0, 8192))
    system = list(range(10_000, 10_400))
    first = r.decide([*system, *range(1, 200)], now=0.0)
    assert isinstance(first, Routed)
    r.complete(first, Report(output_tokens=[7]), now=1.0)
    claim = r.decide([*system, *range(500, 700)], now=2.0)
    assert isinstance(claim, Routed) and claim.predicted_cached == len(system)
    waiter = r.decide([*system, *range(900, 950)], now=2.1)
    assert isinstance(waiter, Routed) and waiter.queued
    assert [h.request_id for h in claim.withdraw(now=3.0)] == [waiter.request_id]
    assert waiter.predicted_cached == len(system)
    r.complete(waiter, Report(output_tokens=[5]), now=4.0)
    assert r.snapshot()["inflight"] == 0


@pytest.mark.parametrize(("slots", "ram"), [(1, 0), (1, 1 << 30), (2, 1 << 30)])
def test_a_withdrawn_claim_leaves_the_model_as_the_server_has_it(slots: int, ram: int) -> None:
    """Never sent, a claim changed nothing on the server: the conversation in the slot
    it took keeps its whole history (its next turn reuses all of it), and no RAM entry
    its start saved (its slot's, idle slots') is left in the model."""
    r = Router("prefix")
    r.add_backend(BackendCapacity("x", slots, 8192, ram, 8192))
    system = list(range(10_000, 10_400))
    first = r.decide([*system, *range(1, 200)], now=0.0)
    assert isinstance(first, Routed)
    r.complete(first, Report(output_tokens=[7, 8]), now=1.0)
    before = r.snapshot()["backends"]["x"]
    claim = r.decide([*system, *range(500, 700)], now=2.0)
    assert isinstance(claim, Routed) and claim.prediction.claims
    r.place(claim)  # (its start applied in the model)
    assert claim.withdraw(now=3.0) == []
    assert r.snapshot()["backends"]["x"] == before
    turn = r.decide([*system, *range(1, 200), 7, 8, 9], now=4.0)
    assert isinstance(turn, Routed) and turn.predicted_cached == len(system) + 199 + 2


@pytest.mark.parametrize(("shared", "empty_slot"), [(1, True), (3, True), (15, True),
                                                    (200, False)])
def test_a_slot_sharing_only_a_templates_opening_is_not_taken_over_an_empty_one(
        shared: int, empty_slot: bool) -> None:
    """A new prompt sharing a few tokens (a chat template's opening) with what an idle
    slot holds goes to an empty slot: taking the other would save those few tokens and
    displace its content, a near tie that timing would otherwise decide."""
    r = Router()
    r.add_backend(cap("a", slots=2))
    first = decide(r, [*range(1, 1 + shared), *range(5_000, 5_009)])
    r.complete(first, Report(), now=1)
    d = decide(r, [*range(1, 1 + shared), *range(9_000, 10_500)], now=2)
    assert (d.slot not in (first.slot, None)) is empty_slot, d.reasons
    assert d.predicted_cached == (0 if empty_slot else shared)


def test_a_new_prompt_sharing_only_a_templates_opening_is_decided_on_its_head() -> None:
    """Nothing here holds more than its first 3 tokens: the rest cannot match further,
    so it is routed on its head (to an empty slot), not held for its whole prompt."""
    r = Router()
    r.add_backend(cap("a", slots=2))
    first = decide(r, [1, 2, 3, *range(5_000, 5_009)])
    r.complete(first, Report(), now=1)
    head = [1, 2, 3, *range(9_000, 9_500)]
    got = r.decide(head, n_prompt=2_000, now=2)
    assert isinstance(got, Routed), got
    assert got.slot not in (first.slot, None) and got.predicted_cached == 0
