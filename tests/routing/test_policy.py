"""Policy: herding on a shared prefix, bounded load, cold start, busy slots, affinity."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from proxy.routing.backend_state import BackendState, Queued
from proxy.routing.cache.model import BackendCache
from proxy.routing.cache.values import BackendCapacity
from proxy.routing.decision import Report
from proxy.routing.options import Candidate
from proxy.routing.policy import choose_prefix
from proxy.routing.prefill import PrefillCost
from proxy.routing.routed import Routed
from proxy.routing.router import Router
from proxy.routing.settings import RouterSettings
from proxy.routing.tree.radix import RadixTree
from proxy.routing.tree.token_bytes import to_token_bytes

SYSTEM = list(range(100_000, 120_000))  # a 20k-token shared system prompt


def cluster(n: int = 4, slots: int = 4, policy: str = "prefix", **kw: object) -> Router:
    r = Router(policy, settings=RouterSettings(**kw))  # type: ignore[arg-type]
    for i in range(n):
        r.add_backend(BackendCapacity(f"b{i}", slots, 65_536, 1 << 34, 8192))
    return r


def session(i: int, turn: int = 0) -> list[int]:
    return SYSTEM + [i] * 50 + list(range(turn * 100))


def decide(r: Router, tokens: list[int], **kw: object) -> Routed:
    d = r.decide(tokens, **kw)  # type: ignore[arg-type]
    assert isinstance(d, Routed), d
    return d


def test_cold_start_goes_to_an_empty_slot_with_reasons() -> None:
    r = cluster()
    d = decide(r, [1, 2, 3])
    assert (d.predicted_cached, d.tier, d.prompt_tokens) == (0, "none", 3)
    assert d.slot is not None
    json.dumps(d.reasons)  # one JSON log line
    for key in ("matched", "chosen", "why", "work", "ttft_s"):
        assert key in d.reasons


def test_concurrent_sessions_on_shared_system_prompt_spread() -> None:
    r = cluster()
    first = decide(r, session(0))
    r.complete(first, now=1.0)  # one backend now holds the 20k system prompt
    ds = [decide(r, session(i), now=1.0) for i in range(1, 9)]  # all in flight at once
    per = Counter(d.backend for d in ds)
    assert len(per) == 4, per  # no herding on the backend holding the prefix
    # four wait for the holder's slot: two while a backend is idle (the cap then), the
    # others once every backend recomputes the 20k prompt (a turn ahead prefills its 50
    # tokens); behind them each reuses it
    assert per["b0"] == 5, per
    waits = [i for i, d in enumerate(ds, 1)
             if d.backend == "b0" and d.reasons.get("waits_for_slot") is not None]
    assert waits == [2, 3, 7, 8], [d.reasons for d in ds]
    assert all(ds[i - 1].predicted_cached >= len(SYSTEM) for i in waits)


def test_shared_prefix_everywhere_gives_no_preference() -> None:
    r = cluster()
    warm = [decide(r, session(100 + i)) for i in range(4)]  # one per backend, in parallel
    assert {d.backend for d in warm} == {"b0", "b1", "b2", "b3"}
    for d in warm:
        r.complete(d, now=1.0)
    ds = [decide(r, session(i), now=2.0) for i in range(4)]
    # every backend holds the prefix in one idle slot: the four spread, all reuse it
    assert all(d.predicted_cached >= len(SYSTEM) for d in ds)
    assert {d.backend for d in ds} == {"b0", "b1", "b2", "b3"}
    assert ds[0].reasons["beyond_alt"] == 0


def test_conversation_returns_to_its_backend() -> None:
    r = cluster()
    d = decide(r, session(7, 0))
    r.complete(d, Report(output_tokens=[9] * 20), now=1.0)
    d2 = decide(r, session(7, 0) + [9] * 20 + [5] * 30, now=2.0)
    assert (d2.backend, d2.slot, d2.tier) == (d.backend, d.slot, "slot")
    assert d2.predicted_cached == len(session(7, 0)) + 20


def test_bounded_load_overrides_match() -> None:
    r = cluster(load_factor=1.25, load_slack_tokens=0, load_slack_s=0.0)
    d = decide(r, session(0))
    r.complete(d, now=1.0)
    ds = [decide(r, session(i), now=1.0) for i in range(1, 13)]
    work = [st["work_tokens"] for st in r.snapshot()["backends"].values()]  # type: ignore[union-attr]
    mean = sum(work) / len(work)
    biggest = max(x.prompt_tokens for x in ds) + r.settings.request_overhead_tokens
    assert max(work) <= 1.25 * mean + biggest


def test_never_pins_a_busy_slot() -> None:
    r = cluster(n=2, slots=1)
    a = decide(r, session(0))
    b = decide(r, session(1))
    assert {a.backend, b.backend} == {"b0", "b1"}
    c = decide(r, [*session(0), 1])  # both slots busy: queue on the server, unpinned
    # it will land in the slot that frees, which holds session 0 (or its shared prefix)
    assert c.slot is None and c.tier == "slot" and c.predicted_cached >= len(SYSTEM)
    r.complete(a, now=5.0)  # the server hands the freed slot to the queued request
    snap = r.snapshot()["backends"]
    assert snap[a.backend]["slots"][0]["busy"] == (c.backend == a.backend)  # type: ignore[index]


def test_prefers_idle_slot_least_valuable_to_lose() -> None:
    r = cluster(n=1, slots=3)
    for i in range(2):
        d = decide(r, [i + 1] * 1000)  # two unrelated conversations fill slots 0 and 1
        r.complete(d, now=1.0 + i)
    d = decide(r, [5] * 100, now=3.0)  # new conversation: the empty slot, not a full one
    snap = r.snapshot()["backends"]["b0"]  # type: ignore[index]
    assert d.slot == 2, snap


def test_session_hint_breaks_ties_deterministically() -> None:
    picks = []
    for _ in range(2):
        r = cluster()
        picks.append(decide(r, [1, 2, 3], session="alice").backend)
    assert picks[0] == picks[1]
    r = cluster()
    spread = {decide(r, [1, 2, 3], session=f"s{i}").backend for i in range(16)}
    assert len(spread) > 1


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "random"])
def test_baselines_let_the_server_pick(policy: str) -> None:
    r = cluster(policy=policy)
    ds = [decide(r, [i] * 10) for i in range(8)]
    assert all(d.slot is None for d in ds)
    assert all(d.reasons["policy"] == policy for d in ds)
    if policy == "round_robin":
        assert [d.backend for d in ds[:4]] == ["b0", "b1", "b2", "b3"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("load_factor", 0.9),
        ("default_prefill_tps", 0.0),
        ("rate_ewma_alpha", 0.0),
        ("load_slack_tokens", -1),
        ("load_slack_s", -0.5),
        ("queue_cost_weight", -1.0),
        ("queue_cost_per_waiter", -0.5),
        ("slot_prompt_similarity", 1.5),
        ("max_resident_tokens", 0),
    ],
)
def test_settings_validation_names_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        RouterSettings(**{field: value})  # type: ignore[arg-type]


DOC = list(range(200_000, 203_000))  # 3,000 tokens held by b0 only


def two_backends(
    rate: float, backlog0: float = 0.0, work0: int = 0, holder: bool = True
) -> list[Candidate]:
    """b0 (holding DOC in an idle slot if ``holder``) and an empty b1, as the policy sees
    them for a request DOC + 100 new tokens."""
    tree = RadixTree()
    query = to_token_bytes(DOC + [1] * 100)
    out = []
    for name in ("b0", "b1"):
        cache = BackendCache(BackendCapacity(name, 2, 65_536, 1 << 34, 8192), tree)
        st = BackendState(cache, rate=rate)
        if name == "b0":
            if holder:
                doc = to_token_bytes(DOC)
                cache.start(0, doc, {}, {}, len(DOC))
                cache.finish(0, doc, len(DOC))
            st.busy_until, st.work = backlog0, work0
        held = tree.match(query).held
        slot_lcp = {h[2]: k for h, k in held.items() if h[0] == name}  # type: ignore[index]
        out.append(Candidate(name, st, slot_lcp, {}))
    return out


@pytest.mark.parametrize(
    ("backlog0", "weight", "want"),
    [
        (2.5, 0.0, "b0"),  # own ttft: 2.6 s vs 3.1 s
        (3.5, 0.0, "b1"),  # own ttft alone: recompute the 3k prefix on b1 (3.1 < 3.6)
        (3.5, 1.0, "b0"),  # ... which adds 3 s of prefill to b1's queue: stay on b0
        (7.0, 1.0, "b1"),  # a real backlog still moves the request
    ],
)
def test_queue_cost_weight_charges_recomputed_prefixes(
    backlog0: float, weight: float, want: str
) -> None:
    s = RouterSettings(queue_cost_weight=weight, queue_cost_per_waiter=0.0,
                       default_prefill_tps=1000.0)
    cands = two_backends(1000.0, backlog0=backlog0)
    got = choose_prefix(cands, len(DOC) + 100, s, 0.0, None)
    assert got.backend == want, got.reasons


@pytest.mark.parametrize(
    ("per_token", "per_position", "backlog0", "want"),
    [
        # one rate: recomputing DOC + 100 on b1 takes 3.1 s, less than 3.5 s + 0.1 s
        (0.001, 0.0, 3.5, "b1"),
        # by position, faster at first: 1.55 s + 2.4 s for the positions = 3.95 s on
        # b1, against 3.5 s + 0.2 s for the last 100 positions on b0
        (0.0005, 5e-7, 3.5, "b0"),
        (0.0005, 5e-7, 4.0, "b1"),  # 4.2 s
    ],
)
def test_prefill_is_priced_by_the_positions_it_covers(
    per_token: float, per_position: float, backlog0: float, want: str
) -> None:
    # b0 holds the 3,000-token DOC behind a backlog; b1 is idle and empty
    s = RouterSettings(queue_cost_weight=0.0)
    cands = two_backends(1000.0, backlog0=backlog0)
    for c in cands:
        c.state.prefill = PrefillCost(per_token, per_position)
    got = choose_prefix(cands, len(DOC) + 100, s, 0.0, None)
    assert got.backend == want, got.reasons


@pytest.mark.parametrize(
    ("waiting0", "waiting1", "per_waiter", "want"),
    [
        # b0 holds DOC behind 10 s of backlog; b1's two slots are busy: queued there,
        # 2.5 s (a service time over its slots) + 3.1 s of prefill, plus 3.1 s charged;
        # the waiters there are longer: served after it, they add no wait
        (0, 0, 0.5, "b1"),  # 8.7 s against b0's 10.2 s: b1
        (0, 4, 0.0, "b1"),
        (0, 4, 0.5, "b0"),  # 2 waiting per backend (past the knee): 2 x 3.1 s charged
        (0, 2, 1.0, "b0"),
        (4, 0, 0.5, "b0"),  # waiting at the holder counts as much: the fleet's queue
    ],
)
def test_queue_cost_grows_with_the_requests_waiting_in_the_fleet(
    waiting0: int, waiting1: int, per_waiter: float, want: str
) -> None:
    """Past the servers' knee (requests wait for a slot) the prefill a recompute adds
    delays the requests that come after it: moving a turn off its history's busy
    backend costs more than its own ttft shows, wherever the others wait (the choice
    spreads them)."""
    s = RouterSettings(queue_cost_weight=1.0, queue_cost_per_waiter=per_waiter,
                       default_prefill_tps=1000.0)
    cands = two_backends(1000.0, backlog0=10.0)
    b1 = cands[1].state
    for slot in (0, 1):
        busy = to_token_bytes(list(range(300_000 + 1_000 * slot, 300_500 + 1_000 * slot)))
        b1.cache.start(slot, busy, {}, {}, 500)
    if waiting0:  # (requests wait at b0 only while no slot is idle but DOC's)
        cands[0].state.cache.start(1, to_token_bytes(list(range(350_000, 350_500))), {}, {}, 500)
    for i, (st, k) in enumerate(((cands[0].state, waiting0), (b1, waiting1))):
        for rid in range(k):
            first = 400_000 + 100_000 * i + 5_000 * rid
            prompt = to_token_bytes(list(range(first, first + 4_000)))
            st.enqueue(100 * i + rid, Queued(4_000, prompt), None)
    got = choose_prefix(cands, len(DOC) + 100, s, 0.0, None)
    assert got.backend == want, got.reasons


@pytest.mark.parametrize(
    ("rate", "slack_s", "eligible"),
    [
        (1000.0, 2.0, ["b1"]),  # slack 2k tokens: b0's 30k of work is over the bound
        (20_000.0, 2.0, ["b0", "b1"]),  # same 2 s at 20k tok/s is 40k tokens: within
        (20_000.0, 0.0, ["b1"]),  # no slack: only the multiple of the mean counts
    ],
)
def test_load_slack_is_in_seconds_of_prefill(
    rate: float, slack_s: float, eligible: list[str]
) -> None:
    s = RouterSettings(load_slack_s=slack_s, load_factor=1.25)
    cands = two_backends(rate, work0=30_000, holder=False)
    got = choose_prefix(cands, len(DOC) + 100, s, 0.0, None)
    assert got.reasons["eligible"] == eligible


@pytest.mark.parametrize(
    ("n", "slots", "shared", "own", "packs"),
    [
        # conversations with a history of their own: B must not truncate A's slot
        (2, 2, 800, 300, False),
        (1, 4, 800, 300, False),
        (4, 1, 800, 300, False),
        (1, 3, 2000, 1000, False),
        # a big shared system prompt and short own parts: reuse it, packing is cheap
        (1, 2, 20_000, 50, True),
        (2, 2, 2000, 40, True),
    ],
)
def test_second_conversation_spares_the_firsts_history(
    n: int, slots: int, shared: int, own: int, packs: bool
) -> None:
    r = cluster(n=n, slots=slots)
    prefix = list(range(500_000, 500_000 + shared))
    a_prompt = prefix + list(range(1_000_000, 1_000_000 + own))
    a = decide(r, a_prompt)
    r.complete(a, Report(output_tokens=[9] * 12), now=1.0)
    b = decide(r, prefix + list(range(2_000_000, 2_000_000 + own)), now=2.0)
    assert ((b.backend, b.slot) == (a.backend, a.slot)) == packs, b.reasons
    assert (b.predicted_cached >= shared) == packs


@pytest.mark.parametrize(("shared", "own"), [(800, 300), (2000, 1000), (1000, 900)])
@pytest.mark.parametrize(("slots", "packs"), [(2, True), (3, False)])
def test_a_sibling_is_charged_its_tail_once_when_no_slot_is_empty(
    shared: int, own: int, slots: int, packs: bool
) -> None:
    """A (a shared prompt and its own tail) and an unrelated U fill two slots; B, over
    A's shared prompt, truncates A's tail rather than recompute the shared part in U's
    slot: the surcharge that keeps B off A's history while an empty slot exists (3 slots)
    would only move the damage to U. Idle slots are not saved to RAM here, so A's tail is
    held nowhere else."""
    r = cluster(n=1, slots=slots, cache_idle_slots=False)
    prefix = list(range(500_000, 500_000 + shared))
    a = decide(r, prefix + list(range(1_000_000, 1_000_000 + own)))
    r.complete(a, Report(output_tokens=[9] * 12), now=1.0)
    u = decide(r, list(range(3_000_000, 3_000_000 + own)), now=2.0)
    r.complete(u, Report(output_tokens=[9] * 12), now=3.0)
    assert u.slot != a.slot
    b = decide(r, prefix + list(range(2_000_000, 2_000_000 + own)), now=4.0)
    assert (b.slot == a.slot) == packs, b.reasons
    assert b.slot != u.slot, b.reasons


@pytest.mark.parametrize(("n", "slots"), [(2, 2), (1, 4), (1, 3), (3, 1)])
def test_conversations_return_to_their_own_prefix(n: int, slots: int) -> None:
    """A, B, C share an 800-token prefix and own 300 tokens each, visited A B C A B C
    with a slot each available: every return reuses its whole first prompt."""
    r = cluster(n=n, slots=slots)
    prefix = list(range(500_000, 500_800))
    convs = {c: prefix + list(range(k * 10_000, k * 10_000 + 300)) for k, c in enumerate("ABC")}
    first: dict[str, int] = {}
    t = 1.0
    for rnd in range(2):
        for c in "ABC":
            d = decide(r, convs[c], now=t)
            out = [7] * 12
            r.complete(d, Report(output_tokens=out,
                                 reported_cached=d.predicted_cached), now=t + 0.5)
            t += 1.0
            if rnd == 0:
                first[c] = len(convs[c])
                turn = 900_000 + 100 * ord(c)
                convs[c] = convs[c] + out + list(range(turn, turn + 30))
            else:
                assert d.predicted_cached >= first[c], (c, d.reasons)


def test_queued_option_is_priced_with_the_reuse_it_will_get() -> None:
    """All slots busy everywhere: the backend whose running requests share the prompt's
    prefix wins (its freed slot will serve the prefix), and the prediction says so."""
    r = cluster(n=2, slots=1)
    a = decide(r, session(0))  # b? holds the system prompt (busy)
    b = decide(r, list(range(7000, 27_000)))  # the other backend: unrelated, busy
    assert a.backend != b.backend
    c = decide(r, session(1), now=0.1)
    assert c.slot is None and c.backend == a.backend
    assert c.predicted_cached >= len(SYSTEM) and c.reasons["queued"] == 1


@pytest.mark.parametrize(
    ("other_busy", "own", "session", "min_tokens", "stays"),
    [
        (True, 40, None, 1024, True),  # adds 40 tokens where it reuses 20k: waits there
        (False, 40, None, 1024, False),  # a backend idle: spread, as new conversations
        (True, 4000, None, 1024, False),  # its own part is past the slack (3,000 tokens)
        (True, 40, "s", 1024, False),  # named: a new conversation over another's prompt
        (True, 40, None, 30_000, False),  # reusing less than continuation_min_tokens
    ],
)
def test_a_sibling_adding_little_stays_with_its_prefix_over_the_load_bound(
        other_busy: bool, own: int, session: str | None, min_tokens: int,
        stays: bool) -> None:
    """The Mooncake replay's case: a request over a 20k document (another question) while
    the first one over it is still in prefill on b0, no session named. b0 is over the
    load bound; recomputing the document on b1 takes as long as waiting for b0's slot
    and adds 20k tokens to a backend that is busy too, then over the bound in turn. With
    no backend idle, a request adding no more than the bound's slack where it reuses a
    slot stays; with one idle, the bound spreads it (see test_never_pins_a_busy_slot)."""
    r = cluster(n=2, slots=1, default_prefill_tps=1500.0, continuation_min_tokens=min_tokens)
    doc = list(range(300_000, 320_000))
    first = decide(r, [*doc, *range(1, 38)])
    assert first.backend == "b0"
    if other_busy:
        assert decide(r, list(range(400_000, 402_000))).backend == "b1"
    sibling = decide(r, [*doc, *range(500_000, 500_000 + own)], session=session)
    assert (sibling.backend == "b0") is stays, sibling.reasons
    if stays:
        assert sibling.reasons["waits_for_slot"] == first.slot
        assert sibling.predicted_cached == len(doc)
    else:
        assert "over bound" in str(sibling.reasons["why"]), sibling.reasons
