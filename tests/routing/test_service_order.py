"""The start a queued request is priced at follows the queue's order (shortest expected
prefill first, aged), not its arrival: a turn with little left to prefill starts when a
slot frees, however many long prompts wait; a long one waits for the shorter ones."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.routing.backend_state import BackendState, Queued
from proxy.routing.cache.model import BackendCache
from proxy.routing.cache.values import BackendCapacity
from proxy.routing.decision import Report
from proxy.routing.routed import Routed
from proxy.routing.router import Router
from proxy.routing.service_order import priority, start_after
from proxy.routing.settings import RouterSettings
from proxy.routing.tree.radix import RadixTree
from proxy.routing.tree.token_bytes import to_token_bytes


@pytest.mark.parametrize(
    ("now", "compute", "slots", "ahead", "want"),
    [
        (0.0, 0.0, [5.0, 3.0], [], 3.0),  # the first slot to free
        (4.0, 0.0, [5.0, 3.0], [], 4.0),  # one freed already
        (0.0, 0.0, [0.0, 10.0], [(2.0, 1.0)], 3.0),  # behind one: its prefill, its decode
        (0.0, 0.0, [0.0, 0.0], [(4.0, 0.1)], 4.0),  # a slot, but the compute is taken
        (0.0, 6.0, [1.0, 2.0], [], 6.0),  # prefills sent before it end first
        (0.0, 0.0, [0.0, 0.0], [(1.0, 5.0), (1.0, 5.0)], 6.0),  # both slots decode
        (1.0, 3.0, [], [(1.0, 1.0)], 3.0),  # no slot model: the compute only
    ],
)
def test_start_after(now: float, compute: float, slots: list[float],
                     ahead: list[tuple[float, float]], want: float) -> None:
    assert start_after(now, compute, slots, ahead) == pytest.approx(want)


def by_scan(now: float, compute: float, slots: list[float],
            ahead: list[tuple[float, float]]) -> float:
    """Reference: each request takes the slot freeing first, found by a scan."""
    free = [max(now, t) for t in slots]
    c = max(now, compute)
    for prefill, after in ahead:
        i = min(range(len(free)), key=free.__getitem__)
        c = max(free[i], c) + prefill
        free[i] = c + after
    return max(min(free), c)


times = st.floats(0.0, 50.0)


@given(times, times, st.lists(times, min_size=1, max_size=4),
       st.lists(st.tuples(times, times), max_size=8), st.tuples(times, times))
def test_start_after_as_a_scan_and_never_sooner_with_more_ahead(
        now: float, compute: float, slots: list[float], ahead: list[tuple[float, float]],
        one_more: tuple[float, float]) -> None:
    got = start_after(now, compute, slots, ahead)
    assert got == pytest.approx(by_scan(now, compute, slots, ahead))
    assert got >= max(now, compute)
    assert start_after(now, compute, slots, [*ahead, one_more]) >= got - 1e-9


def test_priority_ages_and_starves() -> None:
    s = RouterSettings(wait_ageing=0.5, wait_starve_s=30.0)
    assert priority(4.0, 0.0, 0, s) == 4.0
    assert priority(4.0, 2.0, 0, s) == 2.0  # two seconds waited halve it
    assert priority(4.0, 2.0, 1, s) == 1.0  # a follower halves it again
    assert priority(100.0, 30.0, 0, s) == -1.0  # waited too long: first


def busy_backend(waiters: list[int]) -> BackendState:
    """A backend of two busy slots (expected to free at 1 and 2 s) and requests of
    ``waiters`` tokens waiting for any slot, queued at 0."""
    st_ = BackendState(BackendCache(BackendCapacity("b", 2, 65_536, 0, 8192), RadixTree()),
                       rate=1000.0)
    st_.service_s = st_.after_prefill_s = 1.0
    for slot in (0, 1):
        st_.cache.start(slot, to_token_bytes(list(range(slot * 1000, slot * 1000 + 500))),
                        {}, {}, 500)
        st_.slot_free_at[slot] = 1.0 + slot
    for rid, n in enumerate(waiters):
        first = 10_000 * (rid + 1)
        prompt = to_token_bytes(list(range(first, first + n)))
        st_.enqueue(rid, Queued(n, prompt), None)
    return st_


def test_a_short_request_starts_when_a_slot_frees_however_many_long_ones_wait() -> None:
    s = RouterSettings()
    st_ = busy_backend([8000, 8000, 8000])
    assert st_.queue_start(0.1, 0.0, s) == pytest.approx(1.0)
    # a longer one than all of them waits for their prefills, one after another
    assert st_.queue_start(20.0, 0.0, s) > 3 * st_.prefill_s(0, 8000)


def test_a_long_waiter_aged_enough_goes_first() -> None:
    s = RouterSettings(wait_ageing=0.5, wait_starve_s=30.0)
    st_ = busy_backend([8000])
    fresh = st_.queue_start(1.0, 0.0, s)
    assert fresh == pytest.approx(1.0)
    assert st_.queue_start(1.0, 31.0, s) > 31.0 + st_.prefill_s(0, 8000)


HIST = list(range(100_000, 103_000))  # a conversation's history, running on a


def decide(r: Router, tokens: list[int], now: float, among: tuple[str, ...] | None = None
           ) -> Routed:
    d = r.decide(tokens, now=now, among=among)
    assert isinstance(d, Routed), d
    return d


def test_a_turn_waits_for_its_history_behind_long_queued_prompts() -> None:
    """a runs the conversation's previous turn (3,000 tokens) and another request;
    three 8,000-token prompts wait there for a slot; b's slots run short requests. The
    next turn, sent now, waits for its history's slot: it prefills 100 tokens once that
    frees, before any of the long prompts (the queue serves the shortest first), where
    b would give it a slot as soon and 3,100 tokens to prefill."""
    r = Router()
    for name in ("a", "b"):
        r.add_backend(BackendCapacity(name, 2, 16_384, 1 << 30, 8192))
    for i, name in enumerate(r.backends):  # rates (1,500 tokens/s) and durations learned
        w = decide(r, list(range(500_000 + 1000 * i, 500_300 + 1000 * i)), 0.0, (name,))
        r.complete(w, Report(prompt_ms=200.0, prompt_n=300), now=0.3)
    decide(r, HIST, 1.0, ("a",))
    decide(r, list(range(200_000, 200_500)), 1.0, ("a",))
    for i in range(2):
        decide(r, list(range(210_000 + 1000 * i, 210_500 + 1000 * i)), 1.0, ("b",))
    for i in range(3):
        assert decide(r, list(range(300_000 + 10_000 * i, 308_000 + 10_000 * i)), 1.0,
                      ("a",)).queued
    nxt = decide(r, [*HIST, *range(600_000, 600_100)], 1.1)
    assert nxt.backend == "a" and nxt.predicted_cached == len(HIST), nxt.reasons
