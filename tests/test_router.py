"""Router facade: lifecycle, feedback, failures and the snapshot."""

from __future__ import annotations

import json
from array import array

import pytest

from proxy.router import BackendCapacity, Decision, NoBackend, Router, RouterSettings


def cap(name: str, slots: int = 2, ctx: int = 4096, ram: int = 1 << 30) -> BackendCapacity:
    return BackendCapacity(name, slots, ctx, ram, 8192)


def decide(r: Router, tokens: list[int], now: float = 0.0) -> Decision:
    d = r.decide(tokens, now=now)
    assert isinstance(d, Decision), d
    return d


@pytest.mark.parametrize(
    ("backends", "tokens", "reason"),
    [
        ([], [1, 2], "no healthy backend"),
        ([cap("a")], [], "empty prompt"),
        ([cap("a", ctx=10)], list(range(10)), "exceeds every backend's slot context"),
    ],
)
def test_no_backend_is_a_result(
    backends: list[BackendCapacity], tokens: list[int], reason: str
) -> None:
    r = Router()
    for c in backends:
        r.add_backend(c)
    got = r.decide(tokens)
    assert isinstance(got, NoBackend) and reason in got.reason


def test_unknown_policy_rejected() -> None:
    with pytest.raises(ValueError, match="policy"):
        Router("fastest")


def test_complete_extends_slot_and_learns_rate() -> None:
    r = Router()
    r.add_backend(cap("a"))
    d = decide(r, list(range(100)))
    r.complete(d, output_tokens=[7, 8], reported_cached=0, prompt_ms=50.0, prompt_n=100, now=1)
    snap = r.snapshot()
    b = snap["backends"]["a"]  # type: ignore[index]
    assert b["prefill_tps"] == 2000.0 and b["rate_learned"]
    assert b["slots"][d.slot]["tokens"] == 102 and not b["slots"][d.slot]["busy"]
    d2 = decide(r, [*range(100), 7, 8, 9], now=2)
    assert (d2.slot, d2.predicted_cached, d2.tier) == (d.slot, 102, "slot")
    json.dumps(snap)


def test_array_input_equals_list_input() -> None:
    r1, r2 = Router(), Router()
    for r in (r1, r2):
        r.add_backend(cap("a"))
    d1 = decide(r1, list(range(50)))
    d2 = r2.decide(array("i", range(50)))
    assert isinstance(d2, Decision)
    assert (d1.backend, d1.slot, d1.prompt_tokens) == (d2.backend, d2.slot, d2.prompt_tokens)


def test_abort_frees_slot_and_forgets_content() -> None:
    r = Router()
    r.add_backend(cap("a", slots=1))
    d = decide(r, list(range(100)))
    r.abort(d)
    b = r.snapshot()["backends"]["a"]  # type: ignore[index]
    assert b["slots"][0] == {"id": 0, "busy": False, "tokens": 0}
    assert b["inflight"] == 0 and b["work_tokens"] == 0
    assert decide(r, list(range(100))).predicted_cached == 0


def test_reported_slot_disagreeing_moves_the_content() -> None:
    r = Router("round_robin")
    r.add_backend(cap("a", slots=2))
    d = decide(r, list(range(100)))  # unpinned: model predicts slot 0
    r.complete(d, reported_cached=0, reported_slot=1, now=1)
    d2 = r.decide(list(range(101)), now=2)
    assert isinstance(d2, Decision)
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
    assert r.tree.match(list(range(200, 300))).matched == 100  # recorded while queued
    r.complete(a, now=1)
    slots = r.snapshot()["backends"]["a"]["slots"]  # type: ignore[index]
    assert slots[0]["busy"] and slots[0]["tokens"] == 100  # the queued one got it
    r.complete(q, reported_slot=0, now=2)
    assert decide(r, list(range(200, 301)), now=3).predicted_cached == 100
    assert r.snapshot()["inflight"] == 1


def test_mispredictions_counted() -> None:
    r = Router()
    r.add_backend(cap("a"))
    d = decide(r, list(range(10)))
    r.complete(d, reported_cached=5, now=1)
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
    r.complete(d2, reported_cached=len(doc), now=3.0)
    r.complete(other, now=3.0)
    assert r.mispredictions == 0
