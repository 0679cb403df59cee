"""The queue's index: the waiter tree against a brute-force reference, the search over it,
and a Router driven at random whose every hand-off and queued landing is checked against
the scan of every waiter that the index replaces."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import proxy.routing.queue as queue_module
from proxy.routing.backend_state import BackendState
from proxy.routing.cache.checkpoints import DENSE, Memory, reusable
from proxy.routing.cache.model import BackendCache
from proxy.routing.cache.values import BackendCapacity, Placement
from proxy.routing.decision import Report
from proxy.routing.options import Candidate
from proxy.routing.routed import Routed
from proxy.routing.router import Router
from proxy.routing.settings import RouterSettings
from proxy.routing.tree.token_bytes import to_token_bytes
from proxy.routing.tree.waiters import WaiterTree, most_reuse


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def tb(tokens: list[int]) -> bytes:
    return to_token_bytes(tokens)


# ------------------------------------------------------------------ the tree
@pytest.mark.parametrize(
    ("prompts", "seq", "want"),
    [
        ({}, [1, 2], []),
        # most shared first, the oldest first among equals
        ({0: [1, 2, 3], 1: [1, 2, 4], 2: [1, 2, 3, 5]}, [1, 2, 3, 9],
         [(3, 0), (3, 2), (2, 1)]),
        # a prompt that is a prefix of the sequence, and one the sequence is a prefix of
        ({3: [1, 2], 1: [1, 2, 3, 4, 5]}, [1, 2, 3], [(3, 1), (2, 3)]),
        # diverging inside an edge: everyone below it shares as much
        ({0: [1, 2, 3, 4], 1: [1, 2, 3, 4, 5]}, [1, 2, 7], [(2, 0), (2, 1)]),
        # nothing shared
        ({0: [5, 6]}, [1], []),
    ],
)
def test_sharing_table(prompts: dict[int, list[int]], seq: list[int],
                       want: list[tuple[int, int]]) -> None:
    t = WaiterTree()
    for rid, p in prompts.items():
        t.add(rid, tb(p))
    t.check()
    assert list(t.sharing(tb(seq))) == want
    assert t.oldest() == (min(prompts) if prompts else None)


TOKENS = st.lists(st.integers(0, 3), min_size=1, max_size=8)
TREE_OPS = st.lists(st.tuples(st.sampled_from(["add", "add", "remove"]), st.integers(0, 9),
                              TOKENS), max_size=40)


@settings(max_examples=400, deadline=None)
@given(ops=TREE_OPS, queries=st.lists(TOKENS, min_size=1, max_size=4))
def test_sharing_matches_brute_force(ops: list[tuple[str, int, list[int]]],
                                     queries: list[list[int]]) -> None:
    t = WaiterTree()
    ref: dict[int, list[int]] = {}
    for kind, rid, p in ops:
        if kind == "add":
            t.add(rid, tb(p))
            ref[rid] = p
        else:
            t.remove(rid)
            ref.pop(rid, None)
        t.check()
        assert len(t) == len(ref) and t.oldest() == (min(ref) if ref else None)
    for q in queries:
        want = sorted(((lcp(p, q), rid) for rid, p in ref.items() if lcp(p, q)),
                      key=lambda x: (-x[0], x[1]))
        assert list(t.sharing(tb(q))) == want


# ---------------------------------------------------------------- the search
@settings(max_examples=400, deadline=None)
@given(prompts=st.dictionaries(st.integers(0, 30), TOKENS, max_size=12),
       holders=st.lists(TOKENS, max_size=4), cuts=st.lists(st.integers(0, 3), min_size=31,
                                                          max_size=31),
       at_least=st.integers(1, 5))
def test_most_reuse_is_the_scan(prompts: dict[int, list[int]], holders: list[list[int]],
                                cuts: list[int], at_least: int) -> None:
    """Any reuse bounded by what a waiter shares with a holder (and by its cap): the
    search finds the scan's answer, the most, the oldest of equals."""
    t = WaiterTree()
    for rid, p in prompts.items():
        t.add(rid, tb(p))

    def cap(rid: int, shared: int) -> int:
        return min(shared, len(prompts[rid]) - 1)

    def reuse(rid: int) -> int:
        most = max((lcp(prompts[rid], h) for h in holders), default=0)
        return max(0, min(most, len(prompts[rid]) - 1) - cuts[rid])

    longest_first = sorted(holders, key=len, reverse=True)
    got = most_reuse([(len(h), t.sharing(tb(h))) for h in longest_first], cap, reuse,
                     at_least)
    best, most = None, at_least - 1
    for rid in sorted(prompts):
        if reuse(rid) > most:
            best, most = rid, reuse(rid)
    assert got == best


# ------------------------------------------------------- against the scan
def scan_next_waiter(r: Router, st: BackendState, now: float) -> int:
    """The hand-off's choice as a scan of every waiter: the reference. Of a queue longer
    than the scan's bound, only the candidates count: the oldest and the shortest
    (``_CANDIDATES`` of each) and the one reusing most, if at least wait_min_tokens."""
    waiting = [rid for rid in st.queued if st.waits_any(rid)]
    if r.policy != "prefix":
        return waiting[0]
    cache = st.cache

    def landing(rid: int) -> Placement | None:
        f = r._ledger[rid]
        return cache.predict(None, *r._queue.lcps(cache, f.prompt), f.n)

    cands = waiting
    if len(waiting) > queue_module._SCAN_AT_MOST:
        k = queue_module._CANDIDATES
        by_size = sorted(waiting, key=lambda rid: (st.queued[rid].n, rid))
        cands = [*waiting[:k], *by_size[:k]]
        most, top = max(1, r.settings.wait_min_tokens) - 1, None
        for rid in waiting:
            p = landing(rid)
            if p is not None and p.reuse > most:
                most, top = p.reuse, rid
        cands += [] if top is None else [top]
    best, key = waiting[0], (float("inf"), 0.0)
    for rid in cands:
        p = landing(rid)
        if p is None:
            continue
        started = r._ledger[rid].started
        waited, rs = now - started, r.settings
        k = (-1.0 if waited >= rs.wait_starve_s else
             st.prefill_s(p.reuse, st.queued[rid].n) / (1 + rs.wait_ageing * waited)
             / (1 + len(st.followers.get(rid, ()))), started)
        if k < key:
            best, key = rid, k
    return best


def landing_reference(cache: BackendCache, slot_lcp: dict[int, int],
                      ram_lcp: dict[int, int], ahead: list[tuple[int, int]],
                      n_prompt: int) -> Placement:
    """The queued landing read off the whole list of requests ahead: the reference."""
    order = sorted(range(len(cache.slots)), key=lambda i: cache.slots[i].last_used)
    k = len(ahead)
    slot = order[k % len(order)]

    def held_then(j: int) -> int:
        return cache.slots[order[j]].n_tokens if j < len(order) else ahead[j - len(order)][1]

    n_slot = held_then(k)
    lcp_ = min(slot_lcp.get(slot, 0), n_slot) if k < len(order) else ahead[k - len(order)][0]
    entry, got, displaced, saved, destroyed = None, lcp_, 0, False, 0
    if n_slot == 0 or cache._saves(n_slot, lcp_, n_prompt, pinned=False):
        saved = n_slot > 0
        displaced = n_slot - lcp_
        pushed = sum(cache.cap.entry_bytes(n) for n in map(held_then, range(k + 1))
                     if n and cache._can_save(n))
        entry, got = cache._best_ram(ram_lcp, n_prompt, lcp_, n_slot,
                                     cache._fifo_evicted(pushed))
    elif k < len(order) and lcp_ < n_slot:
        destroyed = cache._unique_tail(slot, lcp_, lcp_, n_prompt)
    if cache.checkpointed and got:
        if entry is not None:
            got = cache._from_entry(entry, got, n_prompt)
        elif k < len(order):
            got = cache._from_slot(slot, got, n_prompt)
        else:
            got = reusable(cache.cap.memory, got, n_prompt, n_slot, (), 0).n_past
    reuse = max(0, min(got, n_prompt - 1))
    tier = "none" if reuse == 0 else ("ram" if entry is not None else "slot")
    return Placement(slot, reuse, tier, entry, displaced, saved, destroyed, held=n_slot)


def check_landings(r: Router, tokens: list[int]) -> None:
    """Each backend's queued landing, against the reference over the list of waiters."""
    found = r._booking.candidates(tb(tokens), len(tokens), False, None)
    assert isinstance(found, tuple)
    for c in found[0]:
        st = c.state
        ahead = [(lcp(_ints(q.prompt), tokens), q.n) for rid, q in st.queued.items()
                 if st.waits_any(rid)]
        want = landing_reference(st.cache, c.slot_lcp, c.ram_lcp, ahead, len(tokens))
        assert Candidate.predict_queued(c, len(tokens), None) == (want, None)


def _ints(b: bytes) -> list[int]:
    from proxy.routing.tree.token_bytes import from_token_bytes
    return from_token_bytes(b)


# families of system prompts (none, short, long): conversations over one share it
FAMILIES = [[], [10_000 + i for i in range(24)], [20_000 + i for i in range(90)]]
# (op, a, b): decide (a: conversation, b: new tokens), head (the same, decided on its
# first half, the rest given by a later extend), complete / abort / extend (a: which
# live request, b: answer tokens)
Op = tuple[str, int, int]
ROUTER_OPS = st.lists(
    st.tuples(st.sampled_from(["decide", "decide", "decide", "head", "complete", "complete",
                               "abort", "extend"]),
              st.integers(0, 7), st.integers(1, 60)), min_size=1, max_size=60)


class Drive:
    """A Router driven by ops whose ``_next_waiter`` is checked against the scan."""

    def __init__(self, slots: int, ram_tokens: int, memory: Memory, s: RouterSettings,
                 policy: str = "prefix") -> None:
        self.r = Router(policy, settings=s)
        for name in ("a", "b", "c")[:2 if slots > 1 else 3]:
            self.r.add_backend(BackendCapacity(name, slots, 4096, ram_tokens * 8192, 8192,
                                               memory=memory))
        self.live: list[tuple[Routed, int, list[int], list[int] | None]] = []
        self.history: dict[int, list[int]] = {}
        self.running: set[int] = set()  # requests that have their slot
        self.picks = self.not_oldest = 0
        self.t = 0
        inner = self.r._queue._next_waiter

        def checked(st: BackendState, now: float) -> int:
            want = scan_next_waiter(self.r, st, now)
            got = inner(st, now)
            assert got == want
            self.picks += 1
            self.not_oldest += got != st.waiting.oldest()
            return got

        self.r._queue._next_waiter = checked  # type: ignore[method-assign]

    def step(self, op: Op) -> None:
        kind, a, b = op
        self.t += 1
        now = self.t * 0.1
        if kind in ("decide", "head"):
            prompt = self._prompt(a, b)
            check_landings(self.r, prompt)
            known = prompt[:max(1, len(prompt) // 2)] if kind == "head" else prompt
            d = self.r.decide(known, now=now, n_prompt=len(prompt),
                              session=f"s{a}" if a % 2 else None)
            if not isinstance(d, Routed):
                d = self.r.decide(prompt, now=now)
                known = prompt
            assert isinstance(d, Routed)
            self.live.append((d, a, prompt, None if known is prompt else prompt))
            if not d.queued:
                self.running.add(d.request_id)
            return
        # a request ends once it has a slot, but may be aborted while it waits
        live = [x for x in self.live if kind == "abort" or x[0].request_id in self.running]
        if not live:
            return
        d, conv, prompt, rest = live[a % len(live)]
        i = self.live.index(live[a % len(live)])
        if kind == "extend":
            if rest is not None:
                self.live[i] = (self.r.extend(d, rest), conv, prompt, None)
            return
        if rest is not None:
            d = self.r.extend(d, rest)
        del self.live[i]
        self.running.discard(d.request_id)
        if kind == "abort":
            handed = self.r.abort(d, now=now)
        else:
            out = [7000 + self.t + j for j in range(b % 5)]
            self.history[conv] = prompt + out
            handed = self.r.complete(d, Report(output_tokens=out,
                                               reported_cached=d.predicted_cached, prompt_ms=5.0,
                                               prompt_n=d.prompt_tokens), now=now)
        self.running.update(h.request_id for h in handed)

    def _prompt(self, conv: int, new: int) -> list[int]:
        head = self.history.get(conv, [*FAMILIES[conv % 3], 30_000 + conv])
        return head + [40_000 + 97 * self.t + i for i in range(new)]

    def finish(self) -> None:
        """Ends every request left, oldest first (each end hands out freed slots)."""
        while self.live:
            self.step(("complete", 0, 3) if self.running else ("abort", 0, 0))
        for b in self.r._backends.values():
            assert not b.queued and not b.waiting and not b.waiting_bytes


ROUTER_CASE = {
    "ops": ROUTER_OPS,
    "slots": st.integers(1, 2),
    "ram_tokens": st.sampled_from([0, 60, 150, 400, 1 << 17]),
    "wait_min": st.sampled_from([1, 8, 40, 256]),
    "similarity": st.sampled_from([0.0, 0.1, 0.5]),
    "hybrid": st.booleans(),
    "ageing": st.sampled_from([0.0, 0.5]),
    "starve": st.sampled_from([0.3, 30.0]),
}


@settings(max_examples=300, deadline=None)
@given(**ROUTER_CASE)
def test_hand_offs_match_the_scan(ops: list[Op], slots: int, ram_tokens: int, wait_min: int,
                                  similarity: float, hybrid: bool, ageing: float,
                                  starve: float) -> None:
    s = RouterSettings(wait_min_tokens=wait_min, slot_prompt_similarity=similarity,
                       ram_entries_tracked=3, ram_track_min_tokens=100, wait_ageing=ageing,
                       wait_starve_s=starve)
    scan_at_most = queue_module._SCAN_AT_MOST
    queue_module._SCAN_AT_MOST = 0  # the index's search, however short the queue
    try:
        run = Drive(slots, ram_tokens, Memory(recurrent=True) if hybrid else DENSE, s)
        for op in ops:
            run.step(op)
        run.finish()
    finally:
        queue_module._SCAN_AT_MOST = scan_at_most


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("policy", ["prefix", "round_robin"])
def test_long_random_runs_match_the_scan(seed: int, policy: str) -> None:
    """Long queues (hypothesis keeps its runs short): hundreds of ops, a fifth of them
    ends. The prefix policy's picks do skip the oldest waiter, so the check is not
    vacuous."""
    rng = random.Random(seed)
    s = RouterSettings(wait_min_tokens=rng.choice([8, 40]), ram_entries_tracked=4,
                       ram_track_min_tokens=150, wait_ageing=rng.choice([0.0, 0.5]),
                       wait_starve_s=30.0)
    run = Drive(rng.choice([1, 2]), rng.choice([150, 400, 1 << 17]),
                rng.choice([DENSE, Memory(recurrent=True)]), s, policy)
    kinds = ["decide"] * 4 + ["head", "complete"]
    for _ in range(400):
        run.step((rng.choice(kinds), rng.randrange(8), rng.randrange(1, 60)))
    run.finish()
    assert run.picks > 50
    assert (run.not_oldest > 0) == (policy == "prefix")
