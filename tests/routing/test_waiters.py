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
    """Five requests over one document, sent together, the other slot busy with a long
    unrelated request: the first runs, the second waits for its slot and each of the
    others behind the one before, each reusing the document from the prompt ahead (the
    other slot, freed first, would make them recompute it). With no backend idle there
    is no cap of two or three waiters: the fifth queues there too."""
    r = Router()
    r.add_backend(cap("a", slots=2))
    w = decide(r, list(range(500_000, 500_300)), now=0.0)
    r.complete(w, Report(prompt_ms=200.0, prompt_n=300), now=0.3)  # 1500 tokens/s, 0.3 s a request
    du = decide(r, list(range(200_000, 203_000)), now=0.5)
    d1 = decide(r, [*DOC, *[1] * 10], now=1.0)
    ds = [decide(r, [*DOC, *[k] * 10], now=1.4 + 0.1 * k) for k in range(2, 6)]
    for d in ds:
        assert d.queued and d.reasons["waits_for_slot"] == d1.slot
        assert d.predicted_cached == len(DOC)
    before, reused, t = d1, 0, 2.5
    for d in ds:
        got = r.complete(before, Report(output_tokens=[7] * 4, reported_cached=reused), now=t)
        assert got == [Handoff(d.request_id, "a", d1.slot, len(DOC))]
        before, reused, t = d, len(DOC), t + 0.5
    r.complete(before, Report(reported_cached=len(DOC)), now=t)
    assert r.complete(du, Report(output_tokens=[7] * 4, reported_cached=0), now=t) == []
    assert r.mispredictions == 0 and r.snapshot()["inflight"] == 0


def test_the_turns_ahead_of_a_waiter_are_priced_by_what_each_prefills() -> None:
    """A request's learned duration here is long (6.5 s: a 6,000-token prefill, then
    0.5 s). Three siblings over a document wait for the slot of the one running: the
    third waits for two turns ahead, each one token's prefill and 0.5 s after it (~3 s
    in all), where the server's queue would recompute the document once the other
    slot's long request ends (~9.7 s); two flat durations (13 s) would send it there."""
    r = Router()
    r.add_backend(cap("a", slots=2))
    w = decide(r, list(range(500_000, 506_000)), now=0.0)
    r.complete(w, Report(prompt_ms=6000.0, prompt_n=6000, reported_cached=0), now=6.5)
    decide(r, list(range(200_000, 203_000)), now=7.0)  # the other slot: a long request
    d1 = decide(r, [*DOC, 1], now=7.1)
    ds = [decide(r, [*DOC, k], now=7.2 + 0.1 * k) for k in (2, 3, 4)]
    assert [d.reasons.get("waits_for_slot") for d in ds] == [d1.slot] * 3, \
        [d.reasons for d in ds]
    assert [d.predicted_cached for d in ds] == [len(DOC)] * 3
    # the third's alternative: queued on the server, the document prefilled again
    assert 6.0 < ds[2].reasons["ttft_s"]["a"] < 13.0
    assert r.snapshot()["backends"]["a"]["after_prefill_s"] == 0.5


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
