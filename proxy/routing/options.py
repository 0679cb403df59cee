"""A request's options on one backend, each priced by its expected time to first token
and what it takes from the slot's content: run now in an idle slot or in the server's
queue, wait for a busy slot holding much of the prompt, or follow a waiter that shares
it. proxy/routing/policy.py chooses among every backend's options (its doc says how
each is priced and why)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from proxy.routing.backend_state import BackendState, Queued
from proxy.routing.cache.lora import Lora, should_clear
from proxy.routing.cache.values import Placement
from proxy.routing.prefill import PrefillCost
from proxy.routing.settings import RouterSettings
from proxy.routing.tree.token_bytes import common_len

__all__ = ["FOLLOWS", "RELATED_TOKENS", "Candidate", "Option", "best_options", "redo_s"]


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ is ~4x slower
class Candidate:
    """Per-backend inputs to a policy for one request."""

    name: str
    state: BackendState
    slot_lcp: dict[int, int]  # slot -> tokens of the prompt that slot holds
    ram_lcp: dict[int, int]  # RAM entry -> tokens of the prompt that entry holds
    prompt: bytes = b""  # the prompt (int32 token bytes; its head, decided on its head)
    lora: Lora | None = None  # the adapters it names (None: no `lora` field)

    def shared(self, q: Queued) -> int:
        """Tokens of the prompt that queued request ``q``'s prompt has too, as KV this
        request may reuse there (none when its adapters clear what ``q`` leaves)."""
        return common_len(q.prompt, self.prompt, 0) if self.goes_on(q) else 0

    def goes_on(self, q: Queued) -> bool:
        """This request may reuse what queued request ``q`` leaves in its slot: its
        adapters keep what ``q``'s leave (the same, or an aLoRA's over the base model's)."""
        cache = self.state.cache
        return not should_clear(cache.lora_set(q.lora), cache.lora_set(self.lora),
                                cache.cap.alora)

    def matched(self) -> int:
        """The most tokens of the prompt one slot or RAM entry here holds."""
        return max(max(self.slot_lcp.values(), default=0),
                   max(self.ram_lcp.values(), default=0))

    def predict_queued(self, n: int, min_tokens: int | None) -> tuple[Placement, int | None]:
        """Landing of a request that must wait for a slot here, and the busy slot it
        waits for (None: the first to free). With ``min_tokens``, the busy slot holding
        the most of its prompt, at least that many tokens, that no one waits for yet, if
        it reuses as much there: the first slot to free would make it recompute that part,
        and whoever waits for its own slot would then find it gone. Else the slot the
        server's queue gives it."""
        st = self.state
        cache = st.cache
        k = len(st.waiting)
        behind, ahead_saved = None, 0
        if k >= len(cache.slots):
            # of the requests ahead, the server's queue gives this one the slot of the
            # n_slots-th from the end; all but the last n_slots - 1 save theirs before
            newest = st.newest_waiting()
            later = sum(cache.save_bytes(next(newest).n) for _ in range(len(cache.slots) - 1))
            q = next(newest)
            behind, ahead_saved = (self.shared(q), q.n), st.waiting_bytes - later
        first = cache.predict_behind(self.slot_lcp, self.ram_lcp, k, behind, ahead_saved, n,
                                     self.lora)
        if min_tokens is not None and k:
            # the proxy hands a freed slot to the waiter of shortest expected prefill
            # there (SlotQueue._next_waiter), not to the oldest: reusing at least
            # min_tokens, this one is served first, before the starts ahead of it save
            # their slots to RAM and evict the entry it would load
            alone = cache.predict_behind(self.slot_lcp, self.ram_lcp, 0, None, 0, n, self.lora)
            if alone.reuse >= min_tokens and alone.reuse > first.reuse:
                first = alone
        most = cache.alora_most(self.lora, self.prompt)
        if most is not None and first.reuse > most:  # (an aLoRA runs from its invocation)
            first = first._replace(reuse=most, tier=first.tier if most else "none")
        if min_tokens is not None:
            awaited = st.targets.values()
            held = [(got, i) for i, got in self.slot_lcp.items()
                    if got >= min_tokens and cache.slots[i].busy and i not in awaited]
            if held:
                slot = max(held)[1]
                p = cache.predict(slot, self.slot_lcp, self.ram_lcp, n, after_busy=True,
                                  lora=self.lora, prompt=self.prompt)
                assert p is not None
                if p.reuse >= first.reuse:
                    return p, slot
        return first, None


class Option(NamedTuple):
    """One way to run a request on a backend, as `best_options` prices it."""

    score: float  # ttft + the penalties: what the choice minimises
    ttft: float  # expected time to first token
    placement: Placement | None
    pin: int | None  # the slot to pin, or the busy slot to wait for (None: the server's)
    queued: bool  # it waits (for a busy slot, or for any)
    leader: int | None = None  # the waiter it follows (see _follow)


def best_options(c: Candidate, n: int, s: RouterSettings, now: float, session: str | None,
                 *, none_idle: bool) -> tuple[Option, Option | None, Option | None]:
    """Cheapest way to run on backend ``c`` now or queued for any slot, cheapest
    way waiting for one of its busy slots (None: no such slot), and following the
    waiter that shares most of the prompt (None: none worth it, see ``_follow``).
    ``none_idle``: every candidate backend has work (see ``_WAITERS_PER_SLOT_IDLE``).

    The score adds the displacement and destruction penalties to the ttft, so that
    between otherwise equal backends a new conversation lands where it evicts the least
    (spreading content) and never wipes out history it could have left alone."""
    backlog = max(0.0, c.state.busy_until - now)
    cap = _WAITERS_PER_SLOT_MOST if none_idle else _WAITERS_PER_SLOT_IDLE
    return (_plain_option(c, n, s, now, backlog),
            _wait_option(c, n, s, now, session, backlog, cap), _follow(c, n, s, session, now))


# A prompt sharing fewer tokens with a backend's slots and RAM entries (a chat template's
# opening) is unrelated to what they hold
RELATED_TOKENS = 16


def _idle_options(c: Candidate) -> list[int | None]:
    """The idle slots worth pricing (None: unpinned, where an empty slot loads from RAM).
    Empty idle slots are interchangeable, and idle slots sharing nothing with the prompt
    differ only in what they displace: one of each kind is priced (the first empty one;
    the smallest, least recently used unrelated one)."""
    cache = c.state.cache
    options: list[int | None] = []
    empty = cold = None
    cold_key = (0, 0)
    n_slots, first = len(cache.slots), c.state.empty_from
    for i in cache.idle:
        sl = cache.slots[i]
        if sl.n_tokens == 0:
            # the first in this replica's order: replicas starting conversations at the
            # same moment, unseen by each other, then take different empty slots
            if empty is None or (i - first) % n_slots < (empty - first) % n_slots:
                empty = i
        elif i in c.slot_lcp:
            options.append(i)
        elif cold is None or (sl.n_tokens, sl.last_used) < cold_key:
            cold, cold_key = i, (sl.n_tokens, sl.last_used)
    if empty is not None and c.matched() < RELATED_TOKENS:
        # nothing here holds more than a template's opening of it: taking a slot would
        # save those few tokens and displace content an empty slot leaves alone
        return [empty]
    ram_match = bool(c.ram_lcp)
    # without a RAM match, displacing an unrelated slot only costs: the empty one wins
    if cold is not None and (empty is None or ram_match):
        options.append(cold)
    if empty is not None:
        options.append(empty)
        if ram_match:
            options.append(None)  # unpinned: an empty slot then consults the RAM cache
    return options


def _plain_option(c: Candidate, n: int, s: RouterSettings, now: float,
                  backlog: float) -> Option:
    """The cheapest idle slot of ``c``, or, none being idle, waiting for one."""
    st = c.state
    cache, cost = st.cache, st.prefill
    best: tuple[tuple[float, float, int], Placement, int | None] | None = None
    for opt in _idle_options(c):
        p = cache.predict(opt, c.slot_lcp, c.ram_lcp, n, lora=c.lora, prompt=c.prompt)
        assert p is not None, "idle slots exist"
        ttft = _ttft(backlog, p, n, cost, s)
        key = (ttft + _penalty(p, s, cost), ttft, cache.slots[p.slot].last_used)
        if best is None or key < best[0]:
            best = (key, p, opt)
    if best is not None:
        return Option(best[0][0], best[0][1], best[1], best[2], False)
    # queued: it gets the slot that frees when its turn in the queue's order comes
    # (``slot``: the busy one whose content it shares, predicted to be the one it gets)
    p, slot = c.predict_queued(n, s.wait_min_tokens)
    start = (st.queue_start(cost.seconds(p.reuse, n), now, s) if slot is None
             else st.slot_start(slot, now, s))
    ttft = _ttft(start - now, p, n, cost, s)
    return Option(ttft + _penalty(p, s, cost), ttft, p, slot, True)


def _wait_option(c: Candidate, n: int, s: RouterSettings, now: float, session: str | None,
                 backlog: float, cap: int) -> Option | None:
    """Waiting for a busy slot that holds much of the prompt (a side call sent with its
    session's turn, a turn sent before the previous answer ended): the caller holds the
    request and sends it pinned there when the slot frees (Router: targets, Handoff).
    Landing in an idle slot instead would recompute that part and, in a slot holding
    another conversation, destroy it. Never for the busy slot of another named session:
    that conversation is in progress, its next turn due in seconds, and the waiter
    would take its history just before (the destruction charge prices history alike,
    however soon it is needed)."""
    st = c.state
    slots, cost = st.cache.slots, st.prefill
    wait: tuple[tuple[float, float, int], Placement, int] | None = None
    awaited = list(st.targets.values())
    for i, got in c.slot_lcp.items():
        if got < s.wait_min_tokens or not slots[i].busy:
            continue
        if session is not None and st.slot_session.get(i, session) != session:
            continue
        if i in awaited:
            queued = None if awaited.count(i) >= cap else _behind_waiter(c, i, n, s, session,
                                                                          now)
            if queued is not None and (wait is None or queued[0] < wait[0]):
                wait = queued
            continue
        p = st.cache.predict(i, c.slot_lcp, c.ram_lcp, n, after_busy=True, lora=c.lora,
                             prompt=c.prompt)
        assert p is not None
        ttft = _ttft(max(backlog, st.slot_free_at.get(i, now) - now), p, n, cost, s)
        key = (ttft + _penalty(p, s, cost), ttft, slots[i].last_used)
        if wait is None or key < wait[0]:
            wait = (key, p, i)
    return None if wait is None else Option(wait[0][0], wait[0][1], wait[1], wait[2], True)


# Waiters one busy slot may have while a backend has no work: more would queue a burst of
# new conversations over one prefix behind each other there, while the running
# request's end looks near (it decodes for no time until requests here have ended:
# ``BackendState.expect_free``). With every backend working, a recompute takes its
# prefill from a busy backend's queue, and the turns ahead, each priced by what it
# prefills (``_turns_s``), decide: a burst of questions over one long document waits
# behind the first rather than prefill it again elsewhere. The second bound only keeps
# a decision's cost (a walk over the waiters) bounded: the replays never reach it.
_WAITERS_PER_SLOT_IDLE = 2
_WAITERS_PER_SLOT_MOST = 16


def _behind_waiter(c: Candidate, slot: int, n: int, s: RouterSettings, session: str | None,
                   now: float) -> tuple[tuple[float, float, int], Placement, int] | None:
    """Waiting for busy ``slot`` behind the requests already waiting for it (after the
    last of them): (key, placement, slot) as in ``best_options``, or None when not an
    option.

    Requests over one document sent together (the Mooncake replay: one prefix, another
    question each) arrive while the first of them is still being prefilled. The second
    waits for its slot; a third that recomputes the document elsewhere pays its whole
    prefill, and its copy of the document later takes a second place in a RAM tier that
    holds a few prompts. Behind the waiter it finds the waiter's prompt in the slot, so
    it reuses what the two share (the server keeps that prefix in the slot and
    truncates the rest). It waits for the running request's end, then the turns of the
    waiters ahead (``_turns_s``: each one's own prefill and decode, so a burst of ten
    questions over one long document queues behind the first rather than prefilling it
    again on another backend, where it would hold up everything after it). The last
    waiter's tail beyond the shared part is truncated then: charged as destroyed.
    Unnamed requests only: the waiter may be another session's turn, which the request
    behind it would truncate, and the policy cannot tell."""
    st = c.state
    if session is not None:
        return None
    queue = [st.queued[r] for r, t in st.targets.items() if t == slot]
    ahead = queue[-1]
    shared = min(c.shared(ahead), n - 1)
    if shared < s.wait_min_tokens:
        return None
    tail = max(0, ahead.n - shared)
    p = Placement(slot, shared, "slot", None, 0, False, tail, held=ahead.n)
    cost = st.prefill
    free = max(now, st.slot_free_at.get(slot, now)) + _turns_s(st, slot, queue, s)
    ttft = _ttft(max(st.busy_until - now, free - now, 0.0), p, n, cost, s)
    return (ttft + _penalty(p, s, cost), ttft, st.cache.slots[slot].last_used), p, slot


def _turns_s(st: BackendState, slot: int, queue: list[Queued], s: RouterSettings) -> float:
    """Seconds the requests waiting for busy ``slot`` keep it, one after another: each
    prefills what it does not share with the prompt before it (the running request's,
    then the previous waiter's), then decodes for as long as a request here does after
    its prefill (a whole request's time until that is learned). A flat request duration
    per waiter would price a burst of turns over one long document (each reusing it
    whole) like as many fresh prefills of it."""
    cost = st.prefill
    after = st.after_s(s)
    before = st.cache.slots[slot].prompt or b""
    total = 0.0
    for q in queue:
        total += cost.seconds(min(common_len(before, q.prompt, 0), q.n - 1), q.n) + after
        before = q.prompt
    return total


# A follower's placement names no slot: its leader's, not known until it is handed one
FOLLOWS = -1


def _follow(c: Candidate, n: int, s: RouterSettings, session: str | None, now: float
            ) -> Option | None:
    """Following the waiter of ``c`` that shares the most of the prompt, at least
    ``wait_min_tokens`` (None: none does): the request waits for the slot that waiter is
    handed, and is handed it once that waiter and the followers before it end.

    A conversation's next turn, or an agent's side call over its history, sent while the
    previous request still waits here: that request is in no slot, so no holder shows
    the history, and landing elsewhere would prefill it a second time (and keep two
    copies of it). Expected ttft: the leader's start in the queue's order
    (``BackendState.queue_start``), its prefill and its time in the slot, each follower
    already behind it likewise, then the rest of the prompt. It finds the prompt of
    the last of those in the slot (the leader's, none following it yet): what it shares
    with that one is what it reuses, and that one's prompt beyond the shared part is
    truncated then (charged as destroyed, as for ``_behind_waiter``). Whether it beats
    an idle slot elsewhere is the choice's to say, by score: the prefill it saves is
    charged its queue cost over there. A request naming its session never follows
    another named session's request (the leader or a follower ahead), whose history it
    would truncate; one naming none follows any: nothing tells it from that
    conversation's next turn (from a client that names no session), and sharing more
    with the waiter than any holder has, it most likely is one. (Other replicas' waiters
    wait for a given slot: no leaders.)"""
    st = c.state
    # the top sharer only: it reuses the most, and any other shares a part of its prompt
    # at most: when it is another named session's, that part is a prompt sessions share
    # (a system prompt), not this conversation's history, which following is for
    shared, leader = next(st.waiting.sharing(c.prompt), (0, -1))
    if leader < 0 or shared < s.wait_min_tokens:
        return None
    # handed the slot after the leader's followers, it finds the last one's prompt there
    behind = st.followers.get(leader, ())
    queue = [st.queued[leader], *(st.queued[r] for r in behind)]
    ahead = queue[-1]
    if behind:
        shared = c.shared(ahead)
    shared = min(shared, n - 1)
    if shared < s.wait_min_tokens or not c.goes_on(ahead):
        return None
    # (an unnamed follower ahead may be the leader's session's next turn, as this one
    # would be another's: every one named must be this session)
    if session is not None and any((q.session or session) != session for q in queue):
        return None
    # the leader's start (in the queue's order, or when its slot frees), its prefill
    # and its time in the slot after, then each follower's
    lead = st.queued[leader]
    slot = st.targets.get(leader)
    start = (st.queue_start(0.0, now, s, leader) if slot is None
             else st.slot_start(slot, now, s))
    wait = (start - now + st.prefill_s(lead.reuse, lead.n) + st.after_s(s)
            + st.followers_s(leader, s))
    p = Placement(FOLLOWS, shared, "slot", None, 0, False, max(0, ahead.n - shared),
                  held=ahead.n)
    ttft = _ttft(wait, p, n, st.prefill, s)
    return Option(ttft + _penalty(p, s, st.prefill), ttft, p, None, True, leader)


def _ttft(wait: float, p: Placement, n: int, cost: PrefillCost, s: RouterSettings) -> float:
    """Expected time to first token: waiting, then the uncached prefill (and a RAM load)."""
    ttft = wait + cost.seconds(p.reuse, n)
    if p.tier == "ram":
        ttft += s.ram_load_s_per_token * p.reuse
    return ttft


def redo_s(p: Placement, cost: PrefillCost, tokens: int) -> float:
    """Prefill time of ``tokens`` of the slot's previous content, prefilled again when
    its owner returns: the last ones it held."""
    end = max(p.held, tokens)
    return cost.seconds(end - tokens, end)


def _penalty(p: Placement, s: RouterSettings, cost: PrefillCost) -> float:
    """Seconds charged for what a placement takes away from the slot's current content."""
    return (s.displace_weight * redo_s(p, cost, p.displaced)
            + s.destroy_weight * redo_s(p, cost, p.destroyed))
