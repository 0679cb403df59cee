"""Routing policies: which backend (and slot) gets a request, and why.

``prefix`` (default) picks the option with the lowest *expected time to first token*:

    ttft(b, option) = backlog(b) + slot_wait(b) + (prompt - reuse) / rate(b)
                      + ram_load_s_per_token * reuse   (only when reuse comes from RAM)

- ``reuse`` comes from the cache model (proxy/routing/cache/model.py), which mirrors llama-server:
  which idle slot the request lands in, whether the slot's state is kept, saved to RAM or
  replaced by a RAM entry. Options per backend: pin each idle slot, or let the server
  pick (an unpinned request to an empty slot may load from RAM; a pinned one may not).
- A prefix that every backend holds costs the same everywhere, so it gives no preference:
  only the match *beyond* the best alternative moves the choice (reported as
  ``beyond_alt``). A 20k-token system prompt shared by many sessions therefore does not
  herd them, and the load bound below spreads them even when one backend holds it alone.
- ``backlog(b)`` is the modelled prefill queue: each decision adds its uncached tokens /
  rate to a per-backend virtual finish time; ``rate(b)`` is learned (EWMA,
  ``rate_ewma_alpha``) from the ``prompt_n`` / ``prompt_ms`` the backend reports; until
  it reports one, the mean learned rate of the others, or ``default_prefill_tps``.
- ``slot_wait(b)``: when no slot is idle the request is not pinned (a pinned request to a
  busy slot would disturb it) and queues on the server; it waits about one mean service
  time (EWMA of observed durations, ``default_service_s`` until learned) / n_slots. Its
  reuse is what the server will give it in the slot it gets when one frees
  (``BackendCache.predict_queued``): a queued request sharing a system prompt with the
  running ones reuses it, so queueing there is priced (and predicted) as such. The
  proxy holds queued requests and hands a freed slot to the one of shortest expected
  prefill there, with ageing (proxy/routing/queue.py): one that would reuse at least
  ``wait_min_tokens`` here is priced as the next one served: its RAM entry is then loaded
  before the starts of the requests queued ahead of it save their slots and evict it.
- Waiting for a busy slot: a slot running a request that holds at least
  ``wait_min_tokens`` of this prompt is an option too (an agent's summary sent with its
  session's next turn, a turn sent before the previous answer ended). The request is
  held by the proxy and sent pinned to that slot when it frees (``Handoff``); expected
  ttft = the slot's expected end (its prefill in the backlog, then the backend's mean
  time after prefill) + the rest of the prompt. Taken only when that is sooner than
  running now anywhere (a burst of new sessions over one prefix still spreads), at most
  ``_WAITERS_PER_SLOT`` waiters per slot (the second, an unnamed request only, waits for
  the first one's turn too and reuses what it shares with the first one's prompt), and
  never for a slot running another named session's request (its next turn is due: see
  ``_best_option``); a waiter whose slot runs far past its expected end
  (``wait_grace_s``) is routed again. Without it such a call recomputes the history
  elsewhere, or lands in another session's slot and destroys that history; and requests
  over one document sent together (the Mooncake replay's siblings: one prefix, another
  question) would each recompute it and each leave a copy of it in the small RAM tier.
- Following a waiter: a request sharing at least ``wait_min_tokens`` with a request
  the proxy holds, more than any slot or RAM entry holds (a turn sent while the
  previous one waits, an agent's side call over it), may queue behind it: it is handed
  that request's slot once that request ends (``_follow``). Elsewhere it would prefill
  the history a second time. Priced as the queue's wait, one service time for the
  leader and each follower ahead, then the rest of the prompt; chosen by score.
- The choice minimises ``ttft + queue_cost_weight x (prompt - reuse) / rate(b)``: the
  uncached prefill also delays every request that queues behind it on that backend, so
  recomputing a long prefix elsewhere to save a little of this request's ttft is a bad
  trade (on the Mooncake trace it costs hit ratio *and* mean ttft; BENCHMARKS.md).
- Bounded load: ``work(b)`` = uncached prompt tokens + ``request_overhead_tokens`` of each
  in-flight request (only the latter once its first token came: it then only decodes,
  see ``Router.prefilled``). A backend is eligible only if its work after taking the request
  stays within ``load_factor`` x the mean work after the request + slack, where slack =
  ``load_slack_s`` seconds of prefill at the mean rate + ``load_slack_tokens``. The slack
  keeps a nearly idle cluster from being forced around; it is in seconds so that the
  bound means the same on a 1.5k tok/s CPU backend as on a 20k tok/s GPU. An idle backend
  is always eligible. If none is, the one with least work after the request is. Exempt:
  a request that continues the whole sequence a slot holds (the next turn of the
  conversation there), and one that reuses a slot last used by the session it names
  (an agent's summary or title call): moving either recomputes its history elsewhere.
- Destroying unique content is charged ``destroy_weight`` x its prefill time: when the
  server *keeps* a slot (the prompt shares >= ``keep_threshold`` of it) it truncates the
  slot's sequence after the common prefix without saving it, so a conversation's own
  history that no other slot and no loadable RAM entry holds is gone
  (``Placement.destroyed``). Its owner will pay for it on every return: once packed onto a
  shared prefix, each visit recomputes its own tail and truncates the next one's. So a
  second conversation sharing only a prefix with the first goes to an empty slot when
  one exists, while sessions whose own part is small next to the shared prefix (a big
  system prompt and short turns) still reuse it: the charge is proportional. With no
  empty slot idle on any candidate, every option takes something: destroyed tokens are
  then charged once their prefill time, what their owner pays on return.
- Among equal-cost options, the slot whose content is least valuable to lose wins:
  ``displace_weight`` x displaced tokens / rate is added (empty and short slots first),
  then least recently used. A tenth of their prefill time: content displaced into a
  small RAM tier is soon evicted from it, so long conversations are worth keeping in
  their slots (the chat replay of BENCHMARKS.md, simulated: best at 0.1 of 0 to 1).
  A ``session`` hint breaks remaining ties by rendezvous hash, so new conversations of
  one session stick together while distinct sessions spread.
- A prompt sharing fewer than 16 tokens with all a backend holds (a chat template's
  opening) takes an empty slot there if one is idle: the near tie would otherwise be
  decided by timing.
- ``max_resident_tokens`` caps the router's token tree (LRU leaves evicted first);
  ``slot_prompt_similarity``, ``keep_threshold``, ``ram_min_share``, ``cache_idle_slots``
  and ``kv_unified`` mirror the server's settings (see proxy/routing/cache/model.py) and must
  match its flags.
- ``min_rate_sample_tokens``: smaller prefills are not used to learn the rate (noise).

``round_robin``, ``least_loaded`` (fewest in-flight requests) and ``random`` are the
baselines: they choose only the backend and let the server pick the slot.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import NamedTuple

from proxy.routing.backend_state import BackendState, Queued
from proxy.routing.cache.lora import Lora
from proxy.routing.cache.predict import CONTINUATION_SLACK, Placement
from proxy.routing.settings import RouterSettings
from proxy.routing.tree.token_bytes import common_len

__all__ = ["BackendState", "Candidate", "Choice", "RouterSettings", "choose_prefix"]


class Choice(NamedTuple):  # not a frozen dataclass: its __init__ is ~4x slower
    """A policy's answer before the router applies it."""

    backend: str
    slot: int | None  # slot to pin (None: let the server pick or queue)
    placement: Placement | None  # predicted landing (None: queued, no idle slot)
    reasons: dict[str, object]
    queued: Placement | None = None  # when queued: predicted landing once a slot frees
    follows: int | None = None  # queued behind this waiter, for its slot (see _follow)


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
        """This request may reuse what queued request ``q`` leaves in its slot: it runs
        under the adapters ``q`` runs under."""
        cache = self.state.cache
        return cache.lora_set(self.lora) == cache.lora_set(q.lora)

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
        if min_tokens is not None:
            awaited = st.targets.values()
            held = [(got, i) for i, got in self.slot_lcp.items()
                    if got >= min_tokens and cache.slots[i].busy and i not in awaited]
            if held:
                slot = max(held)[1]
                p = cache.predict(slot, self.slot_lcp, self.ram_lcp, n, after_busy=True,
                                  lora=self.lora)
                assert p is not None
                if p.reuse >= first.reuse:
                    return p, slot
        return first, None


def _hash_rank(session: str, name: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{session}\0{name}".encode(), digest_size=8).digest())


class Option(NamedTuple):
    """One way to run a request on a backend, as `_best_option` prices it."""

    score: float  # ttft + the penalties: what the choice minimises
    ttft: float  # expected time to first token
    placement: Placement | None
    pin: int | None  # the slot to pin, or the busy slot to wait for (None: the server's)
    queued: bool  # it waits (for a busy slot, or in the server's queue)
    leader: int | None = None  # the waiter it follows (see _follow)


class Evaluated(NamedTuple):
    """An option of one candidate, with what it adds to the cluster's load."""

    cand: Candidate
    score: float  # the option's, plus the queue cost of its uncached prefill
    placement: Placement | None
    pin: int | None
    work: int  # the backend's in-flight work after taking the request
    queued: bool
    ttft: float
    leader: int | None = None


def _best_option(c: Candidate, n: int, s: RouterSettings, now: float, session: str | None
                 ) -> tuple[Option, Option | None, Option | None]:
    """Cheapest way to run on backend ``c`` now or in the server's queue, cheapest
    way waiting for one of its busy slots (None: no such slot), and following the
    waiter that shares most of the prompt (None: none worth it, see ``_follow``).

    The score adds the displacement and destruction penalties to the ttft, so that
    between otherwise equal backends a new conversation lands where it evicts the least
    (spreading content) and never wipes out history it could have left alone."""
    backlog = max(0.0, c.state.busy_until - now)
    return (_plain_option(c, n, s, now, backlog), _wait_option(c, n, s, now, session, backlog),
            _follow(c, n, s, session, backlog))


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
    """The cheapest idle slot of ``c``, or, none being idle, the server's queue."""
    st = c.state
    cache, rate = st.cache, st.rate
    best: tuple[tuple[float, float, int], Placement, int | None] | None = None
    for opt in _idle_options(c):
        p = cache.predict(opt, c.slot_lcp, c.ram_lcp, n, lora=c.lora)
        assert p is not None, "idle slots exist"
        ttft = _ttft(backlog, p, n, rate, s)
        key = (ttft + _penalty(p, s, rate), ttft, cache.slots[p.slot].last_used)
        if best is None or key < best[0]:
            best = (key, p, opt)
    if best is not None:
        return Option(best[0][0], best[0][1], best[1], best[2], False)
    # queued on the server: it gets the slot that frees, whose content it may share
    p, slot = c.predict_queued(n, s.wait_min_tokens)
    if slot is None:
        service = st.service_s or s.default_service_s
        wait_s = backlog + service / cache.cap.n_slots
    else:
        wait_s = max(backlog, st.slot_free_at.get(slot, now) - now)
    ttft = _ttft(wait_s, p, n, rate, s)
    return Option(ttft + _penalty(p, s, rate), ttft, p, slot, True)


def _wait_option(c: Candidate, n: int, s: RouterSettings, now: float, session: str | None,
                 backlog: float) -> Option | None:
    """Waiting for a busy slot that holds much of the prompt (a side call sent with its
    session's turn, a turn sent before the previous answer ended): the caller holds the
    request and sends it pinned there when the slot frees (Router: targets, Handoff).
    Landing in an idle slot instead would recompute that part and, in a slot holding
    another conversation, destroy it. Never for the busy slot of another named session:
    that conversation is in progress, its next turn due in seconds, and the waiter
    would take its history just before (the destruction charge prices history alike,
    however soon it is needed)."""
    st = c.state
    slots, rate = st.cache.slots, st.rate
    wait: tuple[tuple[float, float, int], Placement, int] | None = None
    awaited = list(st.targets.values())
    for i, got in c.slot_lcp.items():
        if got < s.wait_min_tokens or not slots[i].busy:
            continue
        if session is not None and st.slot_session.get(i, session) != session:
            continue
        if i in awaited:
            queued = _behind_waiter(c, i, n, s, session, now, awaited.count(i))
            if queued is not None and (wait is None or queued[0] < wait[0]):
                wait = queued
            continue
        p = st.cache.predict(i, c.slot_lcp, c.ram_lcp, n, after_busy=True, lora=c.lora)
        assert p is not None
        ttft = _ttft(max(backlog, st.slot_free_at.get(i, now) - now), p, n, rate, s)
        key = (ttft + _penalty(p, s, rate), ttft, slots[i].last_used)
        if wait is None or key < wait[0]:
            wait = (key, p, i)
    return None if wait is None else Option(wait[0][0], wait[0][1], wait[1], wait[2], True)


# Waiters one busy slot may have. The second one waits for the first one's turn as well;
# more would queue a burst of new conversations over one prefix behind each other while
# other backends stand idle (each recompute elsewhere looks slower than one more turn).
_WAITERS_PER_SLOT = 2


def _behind_waiter(c: Candidate, slot: int, n: int, s: RouterSettings, session: str | None,
                   now: float, waiters: int
                   ) -> tuple[tuple[float, float, int], Placement, int] | None:
    """Waiting for busy ``slot`` behind the request already waiting for it: (key,
    placement, slot) as in ``_best_option``, or None when not an option.

    Requests over one document sent together (the Mooncake replay: one prefix, another
    question each) arrive while the first of them is still being prefilled. The second
    waits for its slot; a third that recomputes the document elsewhere pays its whole
    prefill, and its copy of the document later takes a second place in a RAM tier that
    holds a few prompts. Behind the waiter it finds the waiter's prompt in the slot, so
    it reuses what the two share (the server keeps that prefix in the slot and
    truncates the rest). It waits for the running request's end, the waiter's prefill,
    then one service time (the learned duration of a request, or ``default_service_s``,
    as for the server's queue). The waiter's own tail beyond the shared part is
    truncated then: charged as destroyed. Unnamed requests only: the waiter may be
    another session's turn, which the request behind it would truncate, and the policy
    cannot tell."""
    st = c.state
    if session is not None or waiters >= _WAITERS_PER_SLOT:
        return None
    ahead = st.queued[[r for r, t in st.targets.items() if t == slot][-1]]
    shared = min(c.shared(ahead), n - 1)
    if shared < s.wait_min_tokens:
        return None
    tail = max(0, ahead.n - shared)
    p = Placement(slot, shared, "slot", None, 0, False, tail)
    rate = st.rate
    free = max(now, st.slot_free_at.get(slot, now)) + tail / rate + (
        st.service_s or s.default_service_s)
    ttft = _ttft(max(st.busy_until - now, free - now, 0.0), p, n, rate, s)
    return (ttft + _penalty(p, s, rate), ttft, st.cache.slots[slot].last_used), p, slot


# A follower's placement names no slot: its leader's, not known until it is handed one
_FOLLOWS = -1


def _follow(c: Candidate, n: int, s: RouterSettings, session: str | None, backlog: float
            ) -> Option | None:
    """Following the waiter of ``c`` that shares the most of the prompt, at least
    ``wait_min_tokens`` (None: none does): the request waits for the slot that waiter
    is handed, and is handed it once that waiter ends, finding its prompt there.

    A conversation's next turn, or an agent's side call over its history, sent while
    the previous request still waits here: that request is in no slot, so no holder
    shows the history, and landing elsewhere would prefill it a second time (and keep
    two copies of it). Expected ttft: the queue's expected wait (as for the server's
    queue), one service time for the leader and one for each follower already behind
    it, then the rest of the prompt; the leader's prompt beyond the shared part is
    truncated then (charged as destroyed, as for ``_behind_waiter``). Whether it beats
    an idle slot elsewhere is the choice's to say, by score: the prefill it saves is
    charged ``queue_cost_weight`` over there. A request naming its session never follows
    another named session's request, whose history it would truncate; one naming none
    follows any: nothing tells it from that conversation's next turn (from a client
    that names no session), and sharing more with the waiter than any holder has, it
    most likely is one. (Other replicas' waiters wait for a given slot: no leaders.)"""
    st = c.state
    # the top sharer only: it reuses the most, and any other shares a part of its prompt
    # at most: when it is another named session's, that part is a prompt sessions share
    # (a system prompt), not this conversation's history, which following is for
    shared, leader = next(st.waiting.sharing(c.prompt), (0, -1))
    shared = min(shared, n - 1)
    if shared < s.wait_min_tokens:
        return None
    ahead = st.queued[leader]
    if (session is not None and (ahead.session or session) != session) or not c.goes_on(ahead):
        return None
    service = st.service_s or s.default_service_s
    behind = len(st.followers.get(leader, ()))
    wait = backlog + service / len(st.cache.slots) + (1 + behind) * service
    p = Placement(_FOLLOWS, shared, "slot", None, 0, False, max(0, ahead.n - shared))
    ttft = _ttft(wait, p, n, st.rate, s)
    return Option(ttft + _penalty(p, s, st.rate), ttft, p, None, True, leader)


def _ttft(wait: float, p: Placement, n: int, rate: float, s: RouterSettings) -> float:
    """Expected time to first token: waiting, then the uncached prefill (and a RAM load)."""
    ttft = wait + (n - p.reuse) / rate
    if p.tier == "ram":
        ttft += s.ram_load_s_per_token * p.reuse
    return ttft


def _penalty(p: Placement, s: RouterSettings, rate: float) -> float:
    """Seconds charged for what a placement takes away from the slot's current content."""
    return (s.displace_weight * p.displaced + s.destroy_weight * p.destroyed) / rate


def _continues(c: Candidate, p: Placement | None, min_tokens: int, known: int | None) -> bool:
    """Does placement `p` extend the whole sequence its slot (or RAM entry) holds?
    ``known``: only that head of the prompt is known (see ``Router.decide``)."""
    if p is None or p.reuse < min_tokens or p.slot == _FOLLOWS:
        return False
    if p.tier == "ram" and p.ram_entry is not None:
        held = c.state.cache.ram.get(p.ram_entry, 0)
        lcp = c.ram_lcp.get(p.ram_entry, 0)
    elif p.tier == "slot":
        held = c.state.cache.slots[p.slot].n_tokens
        lcp = c.slot_lcp.get(p.slot, 0)
    else:
        return False
    # NOTE: decided on its head, a turn matches its holder only as far as that head (the
    # last answer is in the untokenized rest): holding the whole head is all it can show
    if known is not None and lcp >= known:
        return True
    return held - lcp <= CONTINUATION_SLACK


def _own_history(c: Candidate, p: Placement | None, session: str | None,
                 min_tokens: int) -> bool:
    """Does placement ``p`` reuse at least ``min_tokens`` from a slot whose last request
    came from this same session? (An agent's side call, a summary or a title, shares
    its session's history but is not a continuation of the slot: the turn went on.)"""
    return (session is not None and p is not None and p.tier == "slot"
            and p.reuse >= min_tokens and c.state.slot_session.get(p.slot) == session)


class _Field(NamedTuple):
    """The candidates' options, priced, and what the choice's reasons report of them."""

    evals: list[Evaluated]  # each candidate's run now (or queued), and waits worth it
    ttfts: dict[str, float]
    matched: dict[str, int]  # longest match per backend
    total: int  # in-flight work of all candidates
    total_rate: float


def _price(cands: list[Candidate], n: int, s: RouterSettings, now: float,
           session: str | None) -> _Field:
    evals: list[Evaluated] = []
    waits: list[Evaluated] = []
    follows: list[Evaluated] = []
    ttfts: dict[str, float] = {}
    matched: dict[str, int] = {}
    total, total_rate = 0, 0.0
    for c in cands:
        st = c.state
        plain, wait, follow = _best_option(c, n, s, now, session)
        ttfts[c.name] = round(plain.ttft, 4)
        matched[c.name] = c.matched()
        for opt, into in ((plain, evals), (wait, waits), (follow, follows)):
            if opt is None:
                continue
            uncached = n - (opt.placement.reuse if opt.placement is not None else 0)
            # NOTE: the uncached prefill also delays every request queued behind it
            score = opt.score + s.queue_cost_weight * uncached / st.rate
            work = st.work + uncached + s.request_overhead_tokens
            into.append(Evaluated(c, score, opt.placement, opt.pin, work, opt.queued,
                                  opt.ttft, opt.leader))
        total += st.work
        total_rate += st.rate
    # A wait must be faster for this request than running now anywhere, not only cheaper
    # for the cluster: otherwise a burst of new sessions over one prefix would queue for
    # the first one's slot instead of spreading over idle backends.
    fastest = min(e.ttft for e in evals)
    evals += [e for e in waits if e.ttft < fastest]
    _add_follows(evals, follows, max(matched.values()))
    return _Field(evals, ttfts, matched, total, total_rate)


def _add_follows(evals: list[Evaluated], follows: list[Evaluated], most: int) -> None:
    """Add the follows whose leader shares more than ``most``, what any holder anywhere
    holds (else waiting for that holder, or running on it, reuses as much); by score
    only, unlike a wait: the holder of that prefix is not running yet, so nothing else
    reuses it, and a burst of new sessions over it is priced by the service times of
    those following already. A follow replaces its backend's plain option when that is
    the queue for any slot predicted to reuse as much (from the leader's prompt, in the
    server's order): it does so only if it starts after the leader, in its slot, which
    following makes sure of (the proxy, not the server, orders its waiters)."""
    for f in follows:
        assert f.placement is not None
        if f.placement.reuse <= most:
            continue
        i = next(i for i, e in enumerate(evals) if e.cand is f.cand)
        e = evals[i]
        if e.queued and e.pin is None and e.placement is not None \
                and e.placement.reuse >= f.placement.reuse:
            evals[i] = f
        else:
            evals.append(f)


def _within_bound(f: _Field, k: int, s: RouterSettings, session: str | None,
                  known: int | None) -> list[Evaluated]:
    """The options whose backend stays within the load bound after taking the request.

    The bound decides where *conversations* live, so that sessions sharing a prefix
    spread. The next turn of a conversation a backend holds whole adds only its tail
    there, while moving it re-creates its whole history elsewhere (a Claude Code turn:
    ~19k tokens for ~100 new); it stays unless the TTFT says otherwise (the backlog term
    still moves it off a swamped backend). So does a request of the session whose
    history the slot holds (a side call): that the client names its session tells it
    from a new conversation over a shared prompt; and a follower (see ``_follow``),
    whose history only its leader's slot will hold. An idle backend is always within the
    bound: with k backends and one request in flight, the mean is 1/k of it, and a long
    prompt would be "over" everywhere."""
    slack = s.load_slack_tokens + s.load_slack_s * f.total_rate / k
    return [e for e in f.evals
            if not (work := e.cand.state.work)
            or e.work <= s.load_factor * (f.total + e.work - work) / k + slack
            or e.leader is not None
            or _continues(e.cand, e.placement, s.continuation_min_tokens, known)
            or _own_history(e.cand, e.placement, session, s.continuation_min_tokens)]


# Destroyed tokens cost their owner one recomputation when it returns. ``destroy_weight``
# charges more to keep a second conversation out of a slot whose history it would
# truncate while an empty slot can take it; with no empty slot idle anywhere, the
# alternative displaces some slot's content too, and the surcharge only moves the damage:
# the plain cost remains (simulated on both traces: reuse and mean TTFT equal or better)
_DESTROY_WEIGHT_NO_EMPTY = 1.0


@lru_cache(maxsize=8)
def _with_no_empty_slot(s: RouterSettings) -> RouterSettings:
    return replace(s, destroy_weight=_DESTROY_WEIGHT_NO_EMPTY)


def _any_empty(cands: list[Candidate]) -> bool:
    """Does any candidate have an idle empty slot?"""
    for c in cands:
        slots = c.state.cache.slots
        if any(slots[i].n_tokens == 0 for i in c.state.cache.idle):
            return True
    return False


def choose_prefix(
    cands: list[Candidate], n: int, s: RouterSettings, now: float, session: str | None,
    known: int | None = None,
) -> Choice:
    """``n``: the prompt's length; ``known``: when only its first ``known`` tokens are
    known (the rest is being tokenized), that head's length."""
    if not _any_empty(cands) and s.destroy_weight > _DESTROY_WEIGHT_NO_EMPTY:
        s = _with_no_empty_slot(s)
    f = _price(cands, n, s, now, session)
    allowed = _within_bound(f, len(cands), s, session, known)
    why = "lowest expected ttft"
    if not allowed:
        allowed = [min(f.evals, key=lambda e: e.work)]
        why = "all above load bound: least work"

    def key(e: Evaluated) -> tuple[float, int]:
        return (e.score, _hash_rank(session, e.cand.name) if session else 0)

    c, _, p, pin, _, queued, _, leader = min(allowed, key=key)
    if len(allowed) < len(f.evals) and why == "lowest expected ttft":
        best_any = min(f.evals, key=key)
        if best_any.cand.name != c.name:
            why = f"lowest expected ttft within load bound ({best_any.cand.name} over bound)"
    alt = max((v for name, v in f.matched.items() if name != c.name), default=0)
    reasons: dict[str, object] = {
        "policy": "prefix",
        "why": why,
        "matched": f.matched,
        "beyond_alt": f.matched[c.name] - alt,
        "ttft_s": f.ttfts,
        "work": {e.cand.name: e.cand.state.work for e in f.evals},
        "eligible": list(dict.fromkeys(e.cand.name for e in allowed)),
    }
    if leader is not None:
        reasons["follows"] = leader
    if queued:  # pin: the busy slot it waits for, None: the server's queue or its leader's
        return Choice(c.name, pin, None, reasons, queued=p, follows=leader)
    return Choice(c.name, pin if p is not None else None, p, reasons)
