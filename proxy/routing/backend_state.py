"""Router-side state of one backend: its cache model, learned rates, in-flight work and
the requests queued on it. Mutable, owned by the Router; read by the policy."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from sortedcontainers import SortedList

from proxy.routing.cache.lora import Lora
from proxy.routing.cache.model import BackendCache
from proxy.routing.prefill import PrefillCost
from proxy.routing.service_order import priority, start_after
from proxy.routing.settings import RouterSettings
from proxy.routing.tree.waiters import WaiterTree


class Queued(NamedTuple):
    """A request queued on a backend."""

    n: int  # prompt tokens
    prompt: bytes  # int32 token bytes (the head, when decided on its head)
    session: str | None = None  # the client's session hint
    lora: Lora | None = None  # the adapters it names (None: no `lora` field)
    reuse: int = 0  # what its start is expected to reuse, tokens
    since: float = 0.0  # when it was queued


@dataclass
class BackendState:
    """Router-side state of one backend (mutable; owned by the Router)."""

    cache: BackendCache
    # learned mean prefill tokens/s: a throughput, for bounds counted in tokens (the load
    # bound's slack, how long a stalled backend's batches may take)
    rate: float
    # the time a given range of a prompt takes to prefill (grows with its positions):
    # what every expected time is made of (see proxy/routing/prefill.py)
    prefill: PrefillCost = field(init=False)
    rate_learned: bool = False
    # virtual finish time of the prefills sent to the server (the requests the router
    # holds add theirs once handed a slot: see ``queue_start``)
    busy_until: float = 0.0
    work: int = 0  # in-flight work, tokens
    inflight: int = 0  # in-flight requests
    service_s: float = 0.0  # EWMA of request durations (0 = not learned)
    after_prefill_s: float = 0.0  # EWMA of duration - reported prefill time (decode etc.)
    # request id -> the request, of those waiting for a slot, oldest first
    queued: OrderedDict[int, Queued] = field(default_factory=OrderedDict)
    # queued request id -> the busy slot it waits for (see options.best_options)
    targets: dict[int, int] = field(default_factory=dict)
    # queued request id -> the waiter it follows: it waits for the slot that waiter is
    # handed, then becomes its target (see options._follow, SlotQueue.hand)
    leader_of: dict[int, int] = field(default_factory=dict)
    # a waiter -> the requests following it, oldest first
    followers: dict[int, list[int]] = field(default_factory=dict)
    # the queued requests waiting for any slot (not in targets), by prompt
    waiting: WaiterTree = field(default_factory=WaiterTree)
    # the RAM bytes saving a slot of each one's length would take (see predict_queued)
    waiting_bytes: int = 0
    # the same requests by prompt length, shortest first: (tokens, request id)
    waiting_by_size: SortedList = field(default_factory=SortedList)
    slot_free_at: dict[int, float] = field(default_factory=dict)  # busy slot -> expected end
    # of the empty idle slots, the one from which this replica takes the first (the
    # others' take theirs from elsewhere: see Router.spread)
    empty_from: int = 0
    # slot -> session hint of the request last placed there (absent: none given)
    slot_session: dict[int, str] = field(default_factory=dict)
    # this replica's requests sent, streamed, whose launch on the server is not heard
    # yet, in sending order (see Report.unlaunched_at_end)
    unlaunched: dict[int, None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.prefill = PrefillCost.at_rate(self.rate)

    def occupy(self, slot: int, session: str | None) -> None:
        """A request of ``session`` was placed in ``slot``."""
        if session is None:
            self.slot_session.pop(slot, None)
        else:
            self.slot_session[slot] = session

    def enqueue(self, rid: int, q: Queued, slot: int | None, leader: int | None = None
                ) -> None:
        """``rid`` waits for a slot: ``slot`` once it frees, or any (None), or, with
        ``leader``, the one that waiter is handed."""
        self.queued[rid] = q
        if leader is not None:
            self.leader_of[rid] = leader
            self.followers.setdefault(leader, []).append(rid)
        elif slot is None:
            self._wait_any(rid, q.n, q.prompt)
        else:
            self.targets[rid] = slot

    def waits_any(self, rid: int) -> bool:
        """Does queued ``rid`` wait for any slot (neither a target nor a follower)?"""
        return rid not in self.targets and rid not in self.leader_of

    def _wait_any(self, rid: int, n: int, prompt: bytes) -> None:
        self.waiting.add(rid, prompt)
        self.waiting_bytes += self.cache.save_bytes(n)
        self.waiting_by_size.add((n, rid))

    def follow_to(self, leader: int, slot: int | None) -> list[int]:
        """Waiter ``leader`` no longer waits: its followers wait for ``slot``, the one it
        was handed, or, None (it ended unserved), for any slot. Returns them."""
        behind = self.followers.pop(leader, [])
        for rid in behind:
            del self.leader_of[rid]
            if slot is None:
                q = self.queued[rid]
                self._wait_any(rid, q.n, q.prompt)
            else:
                self.targets[rid] = slot
        return behind

    def requeue(self, rid: int, n: int, prompt: bytes, reuse: int) -> None:
        """Queued ``rid``'s whole prompt is known: ``prompt`` of ``n`` tokens, ``reuse``
        of them expected reused."""
        old = self.queued.get(rid)
        if old is None:
            return
        self.queued[rid] = old._replace(n=n, prompt=prompt, reuse=reuse)  # (keeps its place)
        if self.waits_any(rid):
            self.waiting.add(rid, prompt)
            self.waiting_bytes += self.cache.save_bytes(n) - self.cache.save_bytes(old.n)
            self.waiting_by_size.remove((old.n, rid))
            self.waiting_by_size.add((n, rid))

    def dequeue(self, rid: int, release: bool = True) -> list[int]:
        """``rid`` no longer waits (handed a slot, ended, or gone). With ``release``,
        its followers wait for any slot then: returns them (else ``follow_to`` is due)."""
        old = self.queued.pop(rid, None)
        if old is None:
            return []
        leader = self.leader_of.pop(rid, None)
        if leader is not None:
            behind = self.followers[leader]
            behind.remove(rid)
            if not behind:
                del self.followers[leader]
        elif self.targets.pop(rid, None) is None:
            self.waiting.remove(rid)
            self.waiting_bytes -= self.cache.save_bytes(old.n)
            self.waiting_by_size.remove((old.n, rid))
        return self.follow_to(rid, None) if release else []

    def newest_waiting(self) -> Iterator[Queued]:
        """The requests waiting for any slot, newest first (lazily: few are read)."""
        for rid in reversed(self.queued):
            if self.waits_any(rid):
                yield self.queued[rid]

    def after_s(self, s: RouterSettings) -> float:
        """Seconds a request keeps its slot after its prefill (decoding): as requests here
        did, or, until that is learned, a whole request's time."""
        return self.after_prefill_s or self.service_s or s.default_service_s

    def queue_start(self, cost: float, now: float, s: RouterSettings,
                    leader: int | None = None) -> float:
        """When a request of ``cost`` seconds of prefill, queued now for any slot, is
        expected to start its prefill: after the busy slots' requests, the waiters for
        given slots, and the waiters the queue serves before it (of lower
        ``priority``), each taking the slot that frees first, its followers after it
        in that slot (proxy/routing/service_order.py). With ``leader``, that waiter's
        own start instead (its rank is its priority; it is not ahead of itself)."""
        after = self.after_s(s)
        free, compute = self._slot_ends(now, s)
        rank = cost
        if leader is not None:
            q = self.queued[leader]
            rank = priority(self._cost(q), now - q.since, len(self.followers.get(leader, ())), s)
        ranked = sorted((k, q.since, rid) for rid, q in self.queued.items()
                        if rid != leader and self.waits_any(rid)
                        and (k := priority(self._cost(q), now - q.since,
                                           len(self.followers.get(rid, ())), s)) <= rank)
        ahead = [(self._cost(self.queued[rid]), after + self.followers_s(rid, s))
                 for _, _, rid in ranked]
        return start_after(now, compute, free, ahead)

    def slot_start(self, slot: int, now: float, s: RouterSettings) -> float:
        """When a request queued now for busy ``slot`` (after its other waiters) is
        expected to start its prefill."""
        free, compute = self._slot_ends(now, s)
        return max(free[slot], compute)

    def followers_s(self, rid: int, s: RouterSettings) -> float:
        """Seconds the followers of waiter ``rid`` keep its slot after it, one after
        another."""
        after = self.after_s(s)
        return sum(self._cost(self.queued[f]) + after for f in self.followers.get(rid, ()))

    def _slot_ends(self, now: float, s: RouterSettings) -> tuple[list[float], float]:
        """Each slot's expected end once its waiters (``targets``) had it, and when the
        prefills sent to the server and theirs end. A busy slot frees no sooner than
        one of them does on average: one past its expected end is still busy."""
        after = self.after_s(s)
        soon = now + (self.service_s or s.default_service_s) / len(self.cache.slots)
        free = [max(self.slot_free_at.get(i, now), soon) if sl.busy else now
                for i, sl in enumerate(self.cache.slots)]
        compute = max(now, self.busy_until)
        for rid, slot in self.targets.items():
            cost = self._cost(self.queued[rid])
            free[slot] = max(free[slot], now) + cost + after
            compute += cost
        return free, compute

    def _cost(self, q: Queued) -> float:
        return self.prefill_s(q.reuse, q.n)

    def prefill_s(self, reuse: int, n: int) -> float:
        """Expected prefill time of a prompt's positions ``[reuse, n)`` here."""
        return self.prefill.seconds(reuse, n)

    def learn(self, s: RouterSettings, took: float, prompt_ms: float | None,
              prompt_n: int | None, reused: int | None) -> None:
        """A request here completed in ``took`` seconds; the backend reported evaluating
        ``prompt_n`` tokens after the ``reused`` it kept, in ``prompt_ms``."""
        a = s.rate_ewma_alpha
        if took > 0:
            self.service_s = _ewma(self.service_s, took, a)
            if prompt_ms is not None:
                self.after_prefill_s = _ewma(self.after_prefill_s,
                                             max(0.0, took - prompt_ms / 1000.0), a)
        if prompt_ms and prompt_n and prompt_n >= s.min_rate_sample_tokens:
            sample = prompt_n / (prompt_ms / 1000.0)
            self.rate = (1 - a) * self.rate + a * sample if self.rate_learned else sample
            self.rate_learned = True
            if reused is not None:  # (else where the evaluated tokens start is unknown)
                self.prefill.learn(prompt_ms / 1000.0, reused, reused + prompt_n, a)

    def expect_free(self, slot: int, now: float) -> None:
        """A request was placed in ``slot``: when it should free. The modelled prefill
        queue ends after this request's prefill, then it decodes for about as long as
        requests here did after their prefill (0 until one is observed: a waiter misled
        by that gives up, see ``Router.wait_overdue``)."""
        self.slot_free_at[slot] = max(self.busy_until, now) + self.after_prefill_s

    def snapshot(self) -> dict[str, object]:
        return {
            **self.cache.snapshot(),
            "prefill_tps": round(self.rate, 1),
            "prefill_s_per_token": self.prefill.per_token,
            "prefill_s_per_position": self.prefill.per_position,
            "rate_learned": self.rate_learned,
            "work_tokens": self.work,
            "inflight": self.inflight,
            "service_s": round(self.service_s, 4),
            "after_prefill_s": round(self.after_prefill_s, 4),
        }

    def release(self, work: int, now: float) -> None:
        """A request carrying ``work`` left (completed, aborted or removed)."""
        self.work -= work
        self.inflight -= 1
        if self.inflight == 0:
            self.busy_until = min(self.busy_until, now)  # an idle backend has no backlog


def peer_rate(states: Iterable[BackendState], default: float) -> float:
    """The mean learned prefill rate of ``states``, or ``default`` if none learned one."""
    rates = [st.rate for st in states if st.rate_learned]
    return sum(rates) / len(rates) if rates else default


def share_rate(states: Collection[BackendState], default: float) -> None:
    """Price the backends that reported no prefill yet at their peers' learned rate and
    prefill terms (their mean). Not the default: the same model on the same kind of
    device, mostly (one managed llama-server per GPU), and a measured rate beats a
    constant."""
    peer = peer_rate(states, default)
    learned = [st.prefill for st in states if st.prefill.learned]
    terms = PrefillCost(sum(p.per_token for p in learned) / len(learned),
                        sum(p.per_position for p in learned) / len(learned)) \
        if learned else PrefillCost.at_rate(default)
    for st in states:
        if not st.rate_learned:
            st.rate = peer
        if not st.prefill.learned:
            st.prefill.copy_terms(terms)


def _ewma(old: float, sample: float, alpha: float) -> float:
    return sample if not old else (1 - alpha) * old + alpha * sample
