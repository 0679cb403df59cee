"""A request predicted to load a RAM entry names the request whose start creates that
entry (``Decision.after``, ``Handoff.after``) exactly while that request is not known
posted on its server: decided back to back, and handed freed slots one after the other."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from proxy.routing.cache.values import BackendCapacity
from proxy.routing.decision import Handoff, Report
from proxy.routing.routed import Routed
from proxy.routing.router import Router
from proxy.routing.settings import RouterSettings

CONV = list(range(100_000, 101_000))  # a conversation slot 1 holds
OTHER = list(range(200_000, 202_000))  # what slot 0 holds
LONG = list(range(300_000, 303_000))  # an unrelated long prompt
TURN = [*CONV, 1, 7, 7, 7, 7, 9, 9]  # the conversation's next turn
DONE = Report(output_tokens=[7] * 4)


def decide(r: Router, tokens: list[int], now: float) -> Routed:
    d = r.decide(tokens, now=now, defer=True)  # (as the proxy decides)
    assert isinstance(d, Routed), d
    return d


def two_slots(settings: RouterSettings | None = None) -> Router:
    """One backend of 2 slots: slot 0 holds OTHER, slot 1 holds CONV (ended), idle."""
    r = Router(settings=settings)
    r.add_backend(BackendCapacity("a", 2, 16384, 1 << 30, 8192))
    other = decide(r, [*OTHER, 1], 0.0)
    r.complete(other, DONE, now=1.0)
    conv = decide(r, [*CONV, 1], 1.0)
    r.complete(conv, DONE, now=2.0)
    assert (other.slot, conv.slot) == (0, 1)
    return r


Between = Callable[[Router, Routed], object]

DECIDED: list[tuple[str, Between, bool]] = [
    ("next at once", lambda r, x: None, True),
    ("creator posted first", lambda r, x: x.posted(), False),
    ("creator failed first", lambda r, x: x.abort(now=3.05), False),
    ("creator's backend reset first", lambda r, x: r.add_backend(
        BackendCapacity("a", 2, 16384, 1 << 30, 8192)), False),
]


@pytest.mark.parametrize(("between", "named"), [(b, n) for _, b, n in DECIDED],
                         ids=[i for i, _, _ in DECIDED])
def test_a_decided_request_names_the_unposted_start_that_saves_what_it_loads(
        between: Between, named: bool) -> None:
    """LONG takes slot 1, its start saving CONV to RAM; the conversation's next turn,
    decided just after on slot 0, loads that entry."""
    r = two_slots()
    x = decide(r, LONG, 3.0)
    assert x.slot == 1 and x.prediction.after is None
    assert r.unposted(x.request_id)
    between(r, x)
    y = decide(r, TURN, 3.1)
    if named:
        assert (y.slot, y.tier, y.predicted_cached) == (0, "ram", len(CONV) + 5)
        assert y.prediction.after == x.request_id
    else:
        assert y.prediction.after is None
        assert not r.unposted(x.request_id)


def test_a_request_reusing_its_slot_names_no_one() -> None:
    """The next turn of what slot 0 holds, decided just after LONG's start: it loads
    nothing from RAM."""
    r = two_slots()
    x = decide(r, LONG, 3.0)
    y = decide(r, [*OTHER, 1, 7, 7, 7, 7, 9], 3.1)
    assert (y.slot, y.tier) == (0, "slot") and y.prediction.after is None
    assert r.unposted(x.request_id)


HANDED: list[tuple[str, bool, bool]] = [
    # (case, the first handed is posted before the second slot frees, named)
    ("handed one after the other", False, True),
    ("first handed posted before the next hand-off", True, False),
]


@pytest.mark.parametrize(("posted", "named"), [(p, n) for _, p, n in HANDED],
                         ids=[i for i, _, _ in HANDED])
def test_a_handed_request_names_the_unposted_start_that_saves_what_it_loads(
        posted: bool, named: bool) -> None:
    """Both slots busy, LONG (waiting long enough to go first) and the next turn of
    CONV wait for any slot. Slot 1 (CONV) frees first and goes to LONG, whose start
    saves CONV to RAM; slot 0 frees next and goes to the turn, which loads that entry."""
    r = two_slots(RouterSettings(wait_min_tokens=1 << 30))  # (no waiting for one slot)
    b0 = decide(r, [*OTHER, 1, 2, 3], 3.0)
    b1 = decide(r, [*CONV, 1, 7, 7, 7, 7, 8], 3.0)
    assert (b0.slot, b1.slot) == (0, 1)
    a = decide(r, LONG, 3.1)
    b = decide(r, TURN, 40.0)
    assert a.queued and b.queued
    got = r.complete(b1, DONE, now=40.5)
    assert [h.request_id for h in got] == [a.request_id] and got[0].after is None
    if posted:
        a.posted()
    got = r.complete(b0, DONE, now=41.0)
    creator = a.request_id if named else None
    assert got == [Handoff(b.request_id, "a", 0, len(CONV) + 5, "ram", after=creator)]
    assert b.prediction.after == creator
