"""Requests the proxy holds for a slot: waiters behind waiters, and the order freed slots
are handed out in."""

from __future__ import annotations

from proxy.routing.cache.values import BackendCapacity
from proxy.routing.decision import Handoff, Report
from proxy.routing.routed import Routed
from proxy.routing.router import Router

DOC = list(range(100_000, 102_000))  # one document, asked about by several requests


def cap(name: str, slots: int = 1, ram: int = 1 << 30) -> BackendCapacity:
    return BackendCapacity(name, slots, 16384, ram, 8192)


def decide(r: Router, tokens: list[int], now: float) -> Routed:
    d = r.decide(tokens, now=now)
    assert isinstance(d, Routed), d
    return d


def test_siblings_queue_behind_the_first_waiter_of_their_slot() -> None:
    """Three requests over one document, sent together, the other slot busy with a
    long unrelated request: the first runs, the second waits for its slot, the third
    behind the second and the fourth behind the third, each reusing the document from
    the prompt ahead (the other slot, freed first, would make them recompute it). A
    fifth does not queue there: with no backend idle, three waiters per slot at most
    (two while one is idle: test_policy.py, concurrent sessions on a shared prompt)."""
    r = Router()
    r.add_backend(cap("a", slots=2))
    w = decide(r, list(range(500_000, 500_300)), now=0.0)
    r.complete(w, Report(prompt_ms=200.0, prompt_n=300), now=0.3)  # 1500 tokens/s, 0.3 s a request
    du = decide(r, list(range(200_000, 203_000)), now=0.5)
    d1 = decide(r, [*DOC, *[1] * 10], now=1.0)
    d2 = decide(r, [*DOC, *[2] * 10], now=1.5)
    d3 = decide(r, [*DOC, *[3] * 10], now=1.6)
    d4 = decide(r, [*DOC, *[4] * 10], now=1.65)
    for d in (d2, d3, d4):
        assert d.queued and d.reasons["waits_for_slot"] == d1.slot
        assert d.predicted_cached == len(DOC)
    d5 = decide(r, [*DOC, *[5] * 10], now=1.7)
    assert d5.queued and "waits_for_slot" not in d5.reasons
    got = r.complete(d1, Report(output_tokens=[7] * 4, reported_cached=0), now=2.5)
    assert got == [Handoff(d2.request_id, "a", d1.slot, len(DOC))]
    got = r.complete(d2, Report(output_tokens=[7] * 4, reported_cached=len(DOC)), now=3.0)
    assert got == [Handoff(d3.request_id, "a", d1.slot, len(DOC))]
    got = r.complete(du, Report(output_tokens=[7] * 4, reported_cached=0), now=3.5)
    assert [h.request_id for h in got] == [d5.request_id]
    five = got[0].predicted_cached
    got = r.complete(d3, Report(output_tokens=[7] * 4, reported_cached=len(DOC)), now=4.0)
    assert got == [Handoff(d4.request_id, "a", d1.slot, len(DOC))]
    r.complete(d4, Report(reported_cached=len(DOC)), now=4.5)
    r.complete(d5, Report(reported_cached=five), now=4.5)
    assert r.mispredictions == 0 and r.snapshot()["inflight"] == 0


def test_a_freed_slot_goes_to_the_waiter_that_loads_its_prefix_from_ram() -> None:
    """One slot. The document's request ran, then an unrelated one took the slot (the
    document went to RAM). Two requests wait: an unrelated one, then one over the
    document. The freed slot goes to the second, which loads the document from RAM:
    started after the other, it would come after that start's save of the slot to RAM,
    which on a RAM tier of a few prompts evicts the document."""
    r = Router()
    r.add_backend(cap("a"))
    dx = decide(r, [*DOC, 1], now=0.0)
    r.complete(dx, Report(output_tokens=[7] * 4), now=1.0)
    dy = decide(r, list(range(200_000, 201_000)), now=1.0)  # displaces the document
    w1 = decide(r, list(range(300_000, 301_000)), now=1.1)
    w2 = decide(r, [*DOC, 2], now=1.2)
    assert w1.queued and w2.queued
    got = r.complete(dy, Report(output_tokens=[7] * 4), now=2.0)
    assert [h.request_id for h in got] == [w2.request_id]
    assert got[0].predicted_cached == len(DOC)


def _order(long_at: float, short_at: float, freed_at: float) -> list[str]:
    """One slot, busy; a long prompt (3,000 tokens) and a short one (100) wait for it,
    sharing nothing with anything: who gets the slot when it frees, then who next."""
    r = Router()
    r.add_backend(cap("a", ram=0))
    busy = decide(r, list(range(900_000, 900_050)), now=0.0)
    waiters = {"long": (long_at, list(range(300_000, 303_000))),
               "short": (short_at, list(range(400_000, 400_100)))}
    ids = {}
    for name, (at, prompt) in sorted(waiters.items(), key=lambda w: w[1][0]):
        d = decide(r, prompt, now=at)
        assert d.queued
        ids[d.request_id] = (name, d)
    (first,) = r.complete(busy, Report(output_tokens=[7]), now=freed_at)
    name, d = ids[first.request_id]
    (second,) = r.complete(d, Report(output_tokens=[7]), now=freed_at + 1)
    return [name, ids[second.request_id][0]]


def test_the_shortest_expected_prefill_goes_first_and_an_old_waiter_is_not_passed_forever(
) -> None:
    # at the default 1,500 tokens/s the long prompt takes 2 s, the short one 0.07 s;
    # each one's divided by 1 + 0.5 x the seconds it has waited (wait_ageing); one that
    # has waited 30 s (wait_starve_s) goes first
    for long_at, short_at, freed_at, order in [
        (0.5, 1.0, 2.0, ["short", "long"]),    # came later, served first
        (0.5, 20.0, 21.0, ["short", "long"]),  # 0.18 s against 0.04 s: still
        (0.5, 30.0, 31.0, ["long", "short"]),  # the long one has waited 30 s
        (1.0, 0.5, 2.0, ["short", "long"]),    # first and shortest
    ]:
        assert _order(long_at, short_at, freed_at) == order, (long_at, short_at)
