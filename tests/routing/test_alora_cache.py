"""Activated LoRA (aLoRA) adapters in the cache model: when a change of adapters keeps a
slot's cache, where the server finds an aLoRA's invocation, and what it then reuses
(the rules of proxy/routing/cache/lora.py; measured on real servers in
tests/forwarding/test_alora_routing.py)."""

from __future__ import annotations

import pytest
from cache_steps import run
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.routing.cache.lora import (
    Invocations,
    Lora,
    Scales,
    invocation_start,
    launched,
    should_clear,
)
from proxy.routing.cache.model import BackendCache
from proxy.routing.cache.values import BackendCapacity, Launch, ServerRules
from proxy.routing.decision import Report
from proxy.routing.routed import Routed
from proxy.routing.router import Router
from proxy.routing.tree.radix import RadixTree
from proxy.routing.tree.token_bytes import to_token_bytes

INV = (7, 8, 9)  # adapter 1's invocation tokens; adapter 0 and 2 are plain
ADAPTERS: Invocations = ((), INV, ())
PLAIN: Lora = ((0, 1.0),)
ALORA: Lora = ((1, 1.0),)
NONE: Lora = ((0, 0.0),)  # every adapter at 0: the base model
P = [1, 2, 3, *range(100, 300)]  # 203 tokens, no invocation


@pytest.mark.parametrize("current, new, clears", [
    ((1.0, 0.0, 0.0), (1.0, 0.0, 0.0), False),  # the same set
    ((0.0, 0.0, 0.0), (0.0, 1.0, 0.0), False),  # base model -> aLoRA: kept
    ((), (0.0, 1.0, 0.0), False),  # a slot that never ran -> aLoRA
    ((0.0, 1.0, 0.0), (0.0, 0.5, 0.0), False),  # aLoRA -> the same at another scale
    ((0.0, 1.0, 0.0), (0.0, 0.0, 0.0), True),  # aLoRA -> base model: cleared
    ((1.0, 0.0, 0.0), (0.0, 1.0, 0.0), True),  # plain -> aLoRA
    ((0.0, 0.0, 0.0), (1.0, 0.0, 0.0), True),  # base -> plain
    ((0.0, 0.0, 0.0), (1.0, 1.0, 0.0), True),  # base -> plain and aLoRA: not all aLoRA
    ((0.0, 1.0, 0.0), (1.0, 0.0, 0.0), True),  # aLoRA -> plain
    ((), (0.0, 0.0, 0.0), True),  # never ran -> base (no aLoRA named)
])
def test_should_clear_is_the_servers_rule(current: Scales, new: Scales, clears: bool) -> None:
    assert should_clear(current, new, ADAPTERS) is clears


def reference_scan(ids: list[int], seq: list[int]) -> int:
    """launch_slot_with_task's loop, as written in C++."""
    start = len(ids)
    match_idx = len(seq) - 1
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] == seq[match_idx]:
            if match_idx == 0:
                start = i
                break
            match_idx -= 1
        else:
            match_idx = len(seq) - 1
    return start


@pytest.mark.parametrize("ids, seq, want", [
    ([1, 7, 8, 9, 2], [7, 8, 9], 1),
    ([7, 8, 9, 1, 7, 8, 9], [7, 8, 9], 4),  # the last occurrence
    ([7, 8, 9], [7, 8, 9], 0),
    ([1, 2, 3], [7, 8, 9], 3),  # not found: the prompt's length
    ([7, 8, 8], [7, 8], 3),  # the server's scan misses it (8 8: starts over past the 8)
    ([7, 8, 7, 8], [7, 8], 2),
    ([], [7], 0),
])
def test_the_invocation_is_found_as_the_server_finds_it(ids: list[int], seq: list[int],
                                                         want: int) -> None:
    assert reference_scan(ids, seq) == want
    assert invocation_start(to_token_bytes(ids), tuple(seq)) == want


@settings(max_examples=400, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=40), st.lists(st.integers(0, 3), min_size=1,
                                                          max_size=4))
def test_the_scan_matches_the_servers_loop(ids: list[int], seq: list[int]) -> None:
    assert invocation_start(to_token_bytes(ids), tuple(seq)) == reference_scan(ids, seq)


@pytest.mark.parametrize("named, ids, want", [
    ((1.0, 0.0, 0.0), [1, 7, 8, 9], ((1.0, 0.0, 0.0), None)),  # plain: as named
    ((0.0, 1.0, 0.0), [1, 2, 7, 8, 9, 5], ((0.0, 1.0, 0.0), 1)),  # found at 2: reuse <= 1
    ((0.0, 1.0, 0.0), [7, 8, 9, 5], ((0.0, 1.0, 0.0), None)),  # found at 0: no limit
    ((0.0, 1.0, 0.0), [1, 2, 3], ((0.0, 0.0, 0.0), None)),  # not found: its scale to 0
    ((0.0, 0.0, 0.0), [7, 8, 9], ((0.0, 0.0, 0.0), None)),  # nothing enabled
])
def test_what_a_launch_keeps_and_reuses(named: Scales, ids: list[int],
                                        want: tuple[Scales, int | None]) -> None:
    assert launched(named, ADAPTERS, to_token_bytes(ids)) == want


def test_two_aloras_are_left_as_named() -> None:
    """(the server refuses the request: nothing starts)"""
    two: Invocations = (INV, (5, 6))
    assert launched((1.0, 1.0), two, to_token_bytes([5, 6, 7, 8, 9])) == ((1.0, 1.0), None)


def make(slots: int = 1, ram_bytes: int = 256 << 20) -> BackendCache:
    cap = BackendCapacity("b0", slots, 4096, ram_bytes, 1024, lora=(1.0, 0.0, 0.0),
                          alora=ADAPTERS)
    return BackendCache(cap, RadixTree(), ServerRules())


def test_a_conversation_asks_an_alora_then_goes_on() -> None:
    """The base model's conversation, then an aLoRA over it (kept, up to one token before
    its invocation), the aLoRA again (the same), then the base model (cleared)."""
    c, n = make(), len(P)
    asked = [*P, *INV]
    steps: list[tuple[list[int], Lora | None, int]] = [
        (P, NONE, 0), (P, NONE, n - 1),
        (asked, ALORA, n - 1),  # holds P and one token: reuses P up to its invocation - 1
        (asked, ALORA, n - 1),  # holds all of it: still capped at the invocation
        ([*P, 5, 11, 12], NONE, 0),  # aLoRA -> base: cleared
        (P, ALORA, n - 1),  # kept; no invocation: runs as the base model, its set
        (P, ALORA, n - 1),  # (0, 0, 0), the slot's set since -> aLoRA: kept
        (P, PLAIN, 0),  # -> plain: cleared
    ]
    for i, (prompt, lora, reuse) in enumerate(steps):
        assert run(c, prompt, lora).reuse == reuse, f"step {i}"


def test_an_alora_not_invoked_leaves_the_base_set() -> None:
    c = make()
    run(c, P, ALORA)
    assert c.slots[0].lora == (0.0, 0.0, 0.0)
    run(c, [*P, *INV], ALORA)
    assert c.slots[0].lora == (0.0, 1.0, 0.0)


def test_a_ram_entry_of_the_base_model_serves_an_alora() -> None:
    """A RAM entry made under the base model is no foreign KV to an aLoRA, whose KV
    before its invocation is the base model's: loaded and reused, not recomputed."""
    c, n = make(slots=2), len(P)
    Q = [1, 2, 3, *range(500, 700)]
    run(c, P, NONE, slot=1)
    run(c, Q, ALORA, slot=0)  # (slot 1's P saved to RAM at this start)
    run(c, Q, NONE, slot=1)  # (slot 0's Q saved as an idle one)
    assert any(c.ram_lora.get(e, ()) == (0.0, 0.0, 0.0) for e in c.ram)
    p = run(c, [*P, *INV], ALORA, slot=0)
    assert (p.tier, p.recompute) == ("ram", False)
    assert p.reuse == n - 1


@pytest.mark.parametrize("on_head", [False, True])
def test_decided_on_the_head_the_alora_is_found_in_the_whole(on_head: bool) -> None:
    """An aLoRA's invocation lies in the prompt's tail, past the head a long prompt is
    routed on: extended to the whole, the prediction is capped at the invocation and the
    slot keeps the aLoRA's set, as when decided on the whole."""
    r = Router()
    r.add_backend(make().cap)
    first = r.decide([*P, *INV], launch=Launch(lora=NONE))  # (under the base model)
    assert isinstance(first, Routed)
    first.placed()
    first.complete(Report(output_tokens=[5], reported_cached=0), now=0.0)
    whole = [*P, *INV, 5, 11]  # the slot holds all but the 11; the aLoRA runs from INV
    d = r.decide(P if on_head else whole, n_prompt=len(whole) if on_head else None,
                 launch=Launch(lora=ALORA))
    assert isinstance(d, Routed)
    d.placed()
    if on_head:
        d = r.extend(d, whole)
    assert d.predicted_cached == len(P) - 1
    d.complete(Report(output_tokens=[5], reported_cached=len(P) - 1), now=1.0)
    ((_, _, kept),) = r.peers.held_slots("b0")
    assert kept == ((0, 0.0), (1, 1.0), (2, 0.0))  # (a base request is cleared next)
