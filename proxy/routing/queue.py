"""The requests the router holds for a slot (`SlotQueue`).

A request decided while every slot of its backend is busy is queued in the model, and
handed a slot when one frees (see ``Handoff``): its record's prediction then says where.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from dataclasses import replace
from itertools import islice
from typing import Any

from proxy.routing.backend_state import BackendState
from proxy.routing.cache.model import BackendCache
from proxy.routing.cache.values import RAM, SLOT, CacheHolder, Launch, from_disk
from proxy.routing.decision import Handoff
from proxy.routing.disk import DiskIndex
from proxy.routing.observed import PeerRequests
from proxy.routing.policies import Policy
from proxy.routing.posting import Unposted
from proxy.routing.routed import Ledger
from proxy.routing.service_order import priority
from proxy.routing.settings import RouterSettings
from proxy.routing.tree.radix import RadixTree
from proxy.routing.tree.waiters import most_reuse

# Waiters a freed slot's pick predicts one by one, at most (more: the candidates' search)
_SCAN_AT_MOST = 8
# Of a longer queue, the oldest waiters, and the shortest, whose start is predicted
_CANDIDATES = 4


class SlotQueue:
    """Hand-offs of queued requests: who gets a slot that frees, and what it reuses."""

    def __init__(self, tree: RadixTree, ledger: Ledger, policy: Policy, disk: DiskIndex,
                 peers: PeerRequests, settings: RouterSettings, unposted: Unposted) -> None:
        self._tree, self._ledger, self._policy = tree, ledger, policy
        self._disk, self._peers, self._settings = disk, peers, settings
        self._unposted = unposted

    def drain(self, st: BackendState, backend: str, now: float) -> list[Handoff]:
        """A slot freed. A request waiting for that very slot gets it, pinned (the first
        of its waiters); otherwise a request waiting for any slot gets the one the
        server would give it unpinned: the waiter of shortest expected prefill there
        (see ``_next_waiter``; a waiter whose conversation's next turn the freed slot or
        a RAM entry holds has little left to prefill). The proxy holds them, so it need not
        hand slots out in arrival order as the server's queue does: a turn that came
        while its slot was busy would otherwise take whichever slot freed first and
        leave its history to the waiter behind it, which recomputes it again; and each
        start ahead of a waiter saves the slot it takes to RAM, which on a small RAM tier
        evicts the entry that waiter was sent here to load. The model records the
        hand-off now."""
        out: list[Handoff] = []
        cache = st.cache
        for rid, slot in self._peers.waiters_first(st.targets):
            if not cache.slots[slot].busy:
                out.append(self.hand(st, backend, rid, slot, now))
        while cache.idle and st.waiting:
            out.append(self.hand(st, backend, self._next_waiter(st, now), None, now))
        return out

    def _next_waiter(self, st: BackendState, now: float) -> int:
        """The waiter an idle slot goes to (see ``drain``): the one of lowest
        ``service_order.priority``, of its expected prefill there (its prompt less what
        its unpinned start, as ``hand`` makes it, reuses from a slot or from RAM); the
        oldest of those that have waited ``wait_starve_s`` first. The baseline policies
        keep the server's order.

        A short queue is scanned. A long one is searched among the waiters that can
        win: the oldest, the shortest prompts, and the one reusing most there (at least
        ``wait_min_tokens``: ``WaiterTree.sharing`` ranks them without predicting
        each), ``_CANDIDATES`` of each: a few predictions, however many wait."""
        oldest = st.waiting.oldest()
        assert oldest is not None, "someone waits"
        if not self._policy.orders_waiters:
            return oldest
        landed: dict[int, int] = {}  # waiter -> its predicted reuse (-1: no landing)
        if len(st.waiting) <= _SCAN_AT_MOST:
            cands: Iterable[int] = (r for r in st.queued if st.waits_any(r))
        else:
            cands = self._candidates(st, landed)
        queued, s, followers = st.queued, self._settings, st.followers
        best, key = oldest, (float("inf"), 0.0)
        for rid in cands:
            reuse = landed[rid] if rid in landed else self._reuse(st, rid)
            if reuse < 0:
                continue
            q = queued[rid]
            k = (priority(st.prefill_s(reuse, q.n), now - q.since,
                          len(followers.get(rid, ())), s), q.since)
            if k < key:
                best, key = rid, k
        return best

    def _reuse(self, st: BackendState, rid: int) -> int:
        """What waiter ``rid``'s unpinned start on ``st`` reuses (-1: it cannot start)."""
        q = st.queued[rid]
        p = st.cache.predict(None, *self.lcps(st.cache, q.prompt), q.n, lora=q.lora,
                             prompt=q.prompt)
        return -1 if p is None else p.reuse

    def _candidates(self, st: BackendState, landed: dict[int, int]) -> set[int]:
        """The waiters of a long queue that can be the next one served (see
        ``_next_waiter``); the reuse of those the search predicted goes into ``landed``."""
        out = set(islice((r for r in st.queued if st.waits_any(r)), _CANDIDATES))
        out.update(rid for _, rid in islice(st.waiting_by_size, _CANDIDATES))
        cache, queued = st.cache, st.queued

        def reuse(rid: int) -> int:
            landed[rid] = got = self._reuse(st, rid)
            return got

        slots = sorted(((n, cache.slot_holder(i)) for i in cache.idle
                        if (n := self._tree.held_len(cache.slot_holder(i)))), reverse=True)
        holders = heapq.merge(slots, cache.ram_by_size(), key=lambda x: -x[0])
        streams = ((n, self._sharing(st, h)) for n, h in holders)
        got = most_reuse(streams, lambda rid, shared: min(shared, queued[rid].n - 1), reuse,
                         max(1, self._settings.wait_min_tokens))
        if got is not None:
            out.add(got)
        return out

    def _sharing(self, st: BackendState, holder: CacheHolder) -> Iterator[tuple[int, int]]:
        """(tokens shared, waiter) with what ``holder`` holds (see WaiterTree.sharing);
        its sequence is read only once the stream is opened."""
        yield from st.waiting.sharing(self._tree.tokens_of(holder))

    def hand(self, st: BackendState, backend: str, rid: int, slot: int | None,
              now: float) -> Handoff:
        f = self._ledger[rid]
        st.dequeue(rid, release=False)  # (its followers wait for its slot: see below)
        cache = st.cache
        held = self._tree.match(f.prompt).held
        slot_lcp, ram_lcp = self.split(cache, held)
        p = cache.predict(slot, slot_lcp, ram_lcp, f.n, lora=f.lora, prompt=f.prompt)
        assert p is not None, "handed an idle slot"
        had = cache.held(p.slot) if self._disk.spilling(backend) else None
        # a peer's request is restored by the replica that routed it, if at all
        restore = (self._disk.gain(held, p, f.n, backend)
                   if self._disk and not f.observed else None)
        if restore is None:
            p = cache.start(slot, f.prompt, slot_lcp, ram_lcp, f.n, p,
                            Launch(f.user_starts, f.lora))
        else:
            cache.restore(p.slot, restore[1])
            p = from_disk(cache.start(p.slot, f.prompt, {**slot_lcp, p.slot: restore[2]},
                                      ram_lcp, f.n, launch=Launch(f.user_starts, f.lora)))
            if had is not None and restore[1].startswith(had):
                had = None  # (the file holds it already: an earlier point of its conversation)
        assert p is not None
        after = None if f.observed else self._unposted.creator(rid, backend, p.ram_entry)
        if not f.observed:  # (a peer's request: sent by its replica, its posting not seen)
            self._unposted.started(rid, backend, cache.created, cache.starts)
        f.slot = p.slot
        st.follow_to(rid, p.slot)  # handed it pinned when rid ends: see drain
        st.occupy(p.slot, f.session)
        f.started = max(f.started, now)  # its duration counts from here, not its wait
        st.busy_until = max(st.busy_until, now) + st.prefill_s(p.reuse, f.n)
        st.expect_free(p.slot, now)
        kept = p.reuse if p.tier == "slot" else 0
        file = restore[0] if restore is not None else None
        if f.prediction is not None:  # (what the request is sent with, pinned)
            f.prediction = replace(f.prediction, slot=p.slot, predicted_cached=p.reuse,
                                   tier=p.tier, restore=file, after=after,
                                   recompute=p.recompute)
        return Handoff(rid, backend, p.slot, p.reuse, p.tier, file,
                       had if had is not None and len(had) // 4 > kept else None, after)

    def lcps(self, cache: BackendCache, q: bytes) -> tuple[dict[int, int], dict[int, int]]:
        """What of prompt ``q`` ``cache``'s slots and RAM entries hold."""
        return self.split(cache, self._tree.match(q).held)

    @staticmethod
    def split(cache: BackendCache, held: dict[Any, int]
               ) -> tuple[dict[int, int], dict[int, int]]:
        """What of a prompt ``cache``'s slots and RAM entries hold, from the tree's match."""
        slot_lcp: dict[int, int] = {}
        ram_lcp: dict[int, int] = {}
        for (b, kind, idx), got in held.items():
            if b == cache.cap.name:
                if kind == SLOT:
                    slot_lcp[idx] = got
                elif kind == RAM:
                    ram_lcp[idx] = got
        return slot_lcp, ram_lcp

    def server_pick_now(self, cache: BackendCache, q: bytes) -> int | None:
        return cache.server_pick(self.lcps(cache, q)[0], max(1, len(q) // 4))
