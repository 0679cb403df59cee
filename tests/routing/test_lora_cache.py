"""LoRA adapters in the cache model: a request naming another set than the slot's last
request ran under reuses nothing (the rules measured in tests/backends/test_demo_lora.py)."""

from __future__ import annotations

from typing import Any

import pytest
from cache_steps import run
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.routing.cache.lora import Lora, f32, requested, scales
from proxy.routing.cache.model import BackendCache
from proxy.routing.cache.values import SLOT, BackendCapacity, Launch, ServerRules
from proxy.routing.decision import Report
from proxy.routing.routed import Routed
from proxy.routing.router import Router
from proxy.routing.tree.radix import RadixTree
from proxy.routing.tree.token_bytes import to_token_bytes

A0: Lora = ((0, 1.0),)
A1: Lora = ((1, 1.0),)
BOTH: Lora = ((0, 1.0), (1, 1.0))
HALF: Lora = ((0, 0.5),)
P = [1, 2, 3, *range(100, 400)]  # 303 tokens
Q = [1, 2, 3, *range(500, 800)]


@pytest.mark.parametrize("body, want", [
    ({}, None),
    ({"lora": []}, None),
    ({"lora": "x"}, None),  # (the server refuses it)
    ({"lora": [{"id": 0, "scale": 1.0}]}, ((0, 1.0),)),
    ({"lora": [{"id": 1, "scale": 0.5}, {"id": 0, "scale": 1}]}, ((0, 1.0), (1, 0.5))),
    ({"lora": [{"id": 0, "scale": 1.0}, {"id": 0, "scale": 0.25}]}, ((0, 0.25),)),
    ({"lora": [{"id": 0}]}, ((0, 0.0),)),
    ({"lora": [{"scale": 1.0}]}, ((-1, 1.0),)),
    ({"lora": [{"id": "0", "scale": "1"}]}, ((-1, 0.0),)),
    ({"lora": [{"id": 1.9, "scale": True}]}, ((1, 1.0),)),
    ({"lora": [3]}, ((-1, 0.0),)),
    ({"lora": [{"id": 0, "scale": 0.1}]}, ((0, f32(0.1)),)),
    ({"lora": [{"id": 0, "scale": 3e9}]}, ((0, f32(3e9)),)),  # a float, however large
    ({"lora": [{"id": 1e12, "scale": 1}]}, ((-1, 1.0),)),  # (no adapter has that id)
])
def test_requested_reads_the_field_as_the_server(body: dict[str, Any], want: Lora | None
                                                 ) -> None:
    assert requested(body) == want


@pytest.mark.parametrize("lora, n, want", [
    (A0, 2, (1.0, 0.0)),
    (A1, 2, (0.0, 1.0)),
    (((-1, 1.0), (5, 1.0)), 2, (0.0, 0.0)),  # ids it has not: ignored
    (A0, 0, ()),
])
def test_scales_names_every_adapter(lora: Lora, n: int, want: tuple[float, ...]) -> None:
    assert scales(lora, n) == want


def make(adapters: tuple[float, ...] = (1.0, 1.0), slots: int = 1,
         ram_bytes: int = 256 << 20) -> BackendCache:
    cap = BackendCapacity("b0", slots, 4096, ram_bytes, 1024, lora=adapters)
    return BackendCache(cap, RadixTree(), ServerRules())


def test_the_servers_steps() -> None:
    """The sequences tests/backends/test_demo_lora.py measures, as the model predicts
    them for what kvroute sends (a request without the field names the global set)."""
    c, n = make(), len(P)
    steps: list[tuple[Lora | None, int]] = [
        (None, 0), (None, n - 1),  # the global set: reused
        (A0, 0), (A0, n - 1),  # another set clears, the same reuses
        (None, 0),  # the global set, named: never over KV made under adapter 0
        (BOTH, n - 1),  # the same set as the global one
        (HALF, 0), (A0, 0), (A1, 0), (((0, 0.0),), 0), (BOTH, 0),  # each another set
    ]
    for i, (lora, reuse) in enumerate(steps):
        assert run(c, P, lora).reuse == reuse, f"step {i}"


def test_a_backend_without_adapters_never_clears() -> None:
    c = make(adapters=())
    run(c, P, A0)
    assert run(c, P, A1).reuse == len(P) - 1


def test_a_never_used_slot_differs_from_any_set() -> None:
    """A slot given a prompt by a restore (no request ran there) holds no set."""
    c = make()
    c.seed(0, to_token_bytes([*P, 7]))
    assert run(c, P, BOTH).reuse == 0


def test_a_ram_entry_loaded_into_another_sets_slot_is_lost() -> None:
    """The RAM tier keys by tokens: the entry is loaded, then cleared with the slot."""
    c = make()
    run(c, P, A0)
    run(c, Q, A1)  # P's state goes to RAM (Q keeps nothing of it)
    assert len(c.ram) == 1
    p = run(c, P, A0)  # loaded into the slot of set A1, then cleared
    assert (p.reuse, p.tier, p.ram_entry is not None) == (0, "none", True)
    assert run(c, Q, A1).reuse == 0  # (P displaced Q; P's entry no longer in RAM)


@pytest.mark.parametrize("made_under, want", [
    (A1, (0, True)),  # another set's KV: recomputed (cache_prompt false), reuses nothing
    (A0, (len(P) - 1, False)),  # its own set's: loaded and reused
])
def test_a_ram_entry_of_another_set_is_never_run_over(made_under: Lora,
                                                      want: tuple[int, bool]) -> None:
    """The server loads a RAM entry into a slot by its tokens alone, and keeps it when
    the slot's last request ran under the request's set: over KV another set made, the
    answer would be wrong. Slot 0 last ran under A0 (Q), P's state was saved from a slot
    of ``made_under``; P under A0 pinned to slot 0 loads it."""
    c = make(slots=2)
    run(c, P, made_under, slot=1)
    run(c, Q, A0, slot=0)  # (slot 1 idle: its P saved to RAM at this start)
    run(c, Q, A1, slot=1)  # (P's idle copy stays; slot 0's Q saved as an idle one)
    assert len(c.ram) == 2
    p = run(c, [*P[:-1], 9], A0, slot=0)
    assert (p.reuse, p.recompute) == want
    assert p.ram_entry is not None and len(c.ram) == 1  # (loaded either way: gone)


def test_global_scales_change_what_no_field_runs_under() -> None:
    c = make()
    run(c, P, None)  # under the global set (1, 1)
    c.lora_global = (1.0, 0.0)
    run(c, P, None)
    assert run(c, P, A0).reuse == len(P) - 1  # (1, 0) is what the slot last ran under


def test_the_policy_picks_the_slot_of_the_requests_set() -> None:
    """Two slots hold the same prompt under two sets: each set's request goes on in its
    own (the other is a cold start for it)."""
    r = Router()
    r.add_backend(BackendCapacity("b0", 2, 4096, 0, 1024, lora=(1.0, 1.0)))
    for lora, reuse in ((A0, 0), (A1, 0), (A0, len(P) - 1), (A1, len(P) - 1),
                        (A0, len(P) - 1)):
        d = r.decide(P, launch=Launch(lora=lora))
        assert isinstance(d, Routed) and d.prediction.predicted_cached == reuse, lora
        d.placed()
        d.complete(Report(output_tokens=[7], reported_cached=reuse), now=0.0)


SETS: list[Lora | None] = [None, A0, A1, BOTH, HALF]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(range(len(SETS))), st.integers(0, 3),
                          st.integers(1, 60)), min_size=1, max_size=12),
       st.sampled_from([(1.0, 1.0), (0.25, 0.0), (0.0, 0.0)]))
def test_one_slot_matches_a_reference(steps: list[tuple[int, int, int]],
                                      global_scales: tuple[float, float]) -> None:
    """One slot, no RAM tier: what the model predicts equals a reference that keeps the
    slot's tokens and the scales its last request ran under (each adapter's scale as
    named, else 0; the global ones where none is named: kvroute names them), and reuses
    the common prefix only under the same scales (launch_slot_with_task)."""
    c = make(adapters=global_scales, ram_bytes=0)
    held: list[int] = []
    held_scales: tuple[float, ...] | None = None  # (none yet: no request ran)
    for k, branch, size in steps:
        lora = SETS[k]
        prompt = [1, 2, 3] + [branch * 1000 + i for i in range(size)]
        lcp = next((i for i, (a, b) in enumerate(zip(held, prompt, strict=False)) if a != b),
                   min(len(held), len(prompt)))
        named = dict(lora or ())
        now = global_scales if lora is None else (named.get(0, 0.0), named.get(1, 0.0))
        want = min(lcp, len(prompt) - 1) if now == held_scales else 0
        assert run(c, prompt, lora).reuse == want
        held, held_scales = [*prompt, 7], now


@pytest.mark.parametrize("peer, mine, reuse", [
    (A0, A0, len(P) - 1), (A0, A1, 0), (None, BOTH, len(P) - 1), (None, A0, 0),
])
def test_a_peers_request_leaves_its_set_in_the_slot(peer: Lora | None, mine: Lora,
                                                     reuse: int) -> None:
    """Another replica's request, as its start tells it (with the adapters it names),
    leaves its slot under that set."""
    r = Router()
    r.add_backend(BackendCapacity("b0", 1, 4096, 0, 1024, lora=(1.0, 1.0)))
    told = r.observe_start("b0", 0, to_token_bytes(P), lora=peer)
    assert told is not None
    told.complete(Report(output_tokens=[7]), now=0.0)
    d = r.decide(P, launch=Launch(lora=mine))
    assert isinstance(d, Routed) and d.prediction.predicted_cached == reuse


@pytest.mark.parametrize("held, mine, reuse", [
    (A0, A0, len(P) - 1), (A0, A1, 0), (((0, 1.0), (1, 1.0)), None, len(P) - 1),
])
def test_a_slot_a_peer_says_it_holds_keeps_its_set(held: Lora, mine: Lora | None,
                                                    reuse: int) -> None:
    """What a joining replica hears an idle slot holds (a held event), with the scales
    its last request ran under, as the peer's model has them."""
    peer = Router()
    peer.add_backend(BackendCapacity("b0", 1, 4096, 0, 1024, lora=(1.0, 1.0)))
    told = peer.observe_start("b0", 0, to_token_bytes(P), lora=held)
    assert told is not None
    told.complete(Report(output_tokens=[7]), now=0.0)
    ((slot, sequence, lora),) = peer.peers.held_slots("b0")
    r = Router()
    r.add_backend(BackendCapacity("b0", 1, 4096, 0, 1024, lora=(1.0, 1.0)))
    assert r.observe("b0", slot, sequence, lora=lora)
    d = r.decide(P, launch=Launch(lora=mine))
    assert isinstance(d, Routed) and d.prediction.predicted_cached == reuse


@pytest.mark.parametrize("other_set, newcomer, lost", [
    (A1, None, True),  # no slot of adapter 0 left: P's RAM copy is of no use to it
    (A0, None, False),  # slot 1 runs adapter 0 too: P's next turn loads its copy there
    (A1, A0, False),  # the newcomer runs adapter 0: the slot stays of that set
])
def test_a_displaced_conversation_is_lost_with_the_last_slot_of_its_set(
        other_set: Lora, newcomer: Lora | None, lost: bool) -> None:
    c = make(slots=2)
    run(c, P, A0, slot=0)
    run(c, Q, other_set, slot=1)
    new = [1, 2, 3, *range(900, 1200)]
    held = c.tree.match(new).held
    slot_lcp = {i: n for (_, kind, i), n in held.items() if kind == SLOT}  # type: ignore[misc]
    p = c.predict(0, slot_lcp, {}, len(new), lora=newcomer)
    assert p is not None and p.saved
    assert (p.destroyed > len(P) - 3) is lost, p
