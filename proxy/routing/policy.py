"""Routing policies: which backend (and slot) gets a request, and why.

``prefix`` (default) picks the option with the lowest *expected time to first token*:

    ttft(b, option) = backlog(b) + slot_wait(b) + prefill(b, reuse, prompt)
                      + ram_load_s_per_token * reuse   (only when reuse comes from RAM)

- ``reuse`` comes from the cache model (proxy/routing/cache/model.py), which mirrors llama-server:
  which idle slot the request lands in, whether the slot's state is kept, saved to RAM or
  replaced by a RAM entry. Options per backend: pin each idle slot, or let the server
  pick (an unpinned request to an empty slot may load from RAM; a pinned one may not).
- A prefix that every backend holds costs the same everywhere, so it gives no preference:
  only the match *beyond* the best alternative moves the choice (reported as
  ``beyond_alt``). A 20k-token system prompt shared by many sessions therefore does not
  herd them, and the load bound below spreads them even when one backend holds it alone
  (while a backend is idle: see its exemptions).
- ``prefill(b, reuse, prompt)``: the time positions ``[reuse, prompt)`` take there, a
  per-token term and one growing with each token's position (attention), fitted to the
  ``prompt_n`` / ``prompt_ms`` after the reused tokens the backend reports, recent
  prefills weighing most (``rate_ewma_alpha``; proxy/routing/prefill.py). Until it
  reports one, its peers' mean terms, or ``default_prefill_tps`` at every position.
- ``backlog(b)`` is the server's modelled prefill queue: each request sent there
  (placed in a slot, or handed one from the proxy's queue) adds its prefill time to a
  per-backend virtual finish time. ``rate(b)``, below, is the mean tokens/s of its
  recent prefills (EWMA), for bounds counted in tokens.
- ``slot_wait(b)``: when no slot is idle the request is not pinned (a pinned request to a
  busy slot would disturb it); the proxy holds it and hands a freed slot to the waiter
  of shortest expected prefill there, with ageing (proxy/routing/queue.py). Its wait is
  priced in that order (proxy/routing/service_order.py): each waiter served before it
  takes the slot that frees first (a busy slot at its expected end, and no sooner than
  one mean service time / n_slots from now), their prefills taking the server's
  compute in turn, then its own. So a turn with little left to prefill starts when a
  slot frees, however many long prompts wait there, and a long prompt is priced behind
  every shorter one. Its reuse is what the server will give it in the slot it gets
  (``BackendCache.predict_queued``): a queued request sharing a system prompt with the
  running ones reuses it, so queueing there is priced (and predicted) as such. One that
  would reuse at least ``wait_min_tokens`` here is predicted as the next one served:
  its RAM entry is then loaded before the starts of the requests queued ahead of it
  save their slots and evict it.
- Waiting for a busy slot: a slot running a request that holds at least
  ``wait_min_tokens`` of this prompt is an option too (an agent's summary sent with its
  session's next turn, a turn sent before the previous answer ended). The request is
  held by the proxy and sent pinned to that slot when it frees (``Handoff``); expected
  ttft = the slot's expected end (its prefill in the backlog, then the backend's mean
  time after prefill) + the rest of the prompt. Taken only when that is sooner than
  running now anywhere (a burst of new sessions over one prefix still spreads), at most
  ``_WAITERS_PER_SLOT_IDLE`` waiters per slot while a backend has no work (options.py;
  each after the first, an unnamed request only, waits for the turns ahead too, each
  priced by its own prefill and decode, and reuses what it shares with the last one's
  prompt), and never for a slot running another named session's request (its next
  turn is due: see ``options.best_options``); a waiter whose slot runs far past its
  expected end (``wait_grace_s``) is routed again. Without it such a call recomputes
  the history elsewhere, or lands in another session's slot and destroys that history;
  and requests over one document sent together (the Mooncake replay's siblings: one
  prefix, another question) would each recompute it and each leave a copy of it in the
  small RAM tier.
- Following a waiter: a request sharing at least ``wait_min_tokens`` with a request
  the proxy holds, more than any slot or RAM entry holds (a turn sent while the
  previous one waits, an agent's side call over it), may queue behind it: it is handed
  that request's slot once that request ends (``_follow``, proxy/routing/options.py).
  Elsewhere it would prefill the history a second time. Priced as the queue's wait,
  one service time for the leader and each follower ahead, then the rest of the
  prompt; chosen by score.
- The choice minimises ``ttft + queue_cost x added(b)``, where ``added`` is the time of
  the prefill the placement adds there (its uncached prompt, and the history it
  destroys, which its owner prefills again on return) and ``queue_cost =
  queue_cost_weight x (1 + queue_cost_per_waiter x waiting)``, ``waiting`` the mean, over
  the candidate backends, of the requests waiting for any slot: that prefill delays the
  requests that come after it, and the more of them the further past its knee the
  fleet runs (requests wait only when no slot is idle). So recomputing a long prefix
  elsewhere to save a little of this request's ttft is a bad trade, and past the
  servers' knee a worse one. The fleet's mean, not the backend's own count: the choice
  spreads load, so a prefill added where none waits yet delays as many soon; counted
  per backend, a turn's history on a queued backend looks dear to reuse and the turn
  moves off it, recomputing it. (The chat replays of BENCHMARKS.md, simulated at
  700-1,500 prefill tokens/s, 5 seeds: 2 and 1 beside 1 and 0 raise reuse on the
  conversation trace by 2-8% on average and lower mean ttft; a burst of new sessions
  over one prefix still spreads: a constant weight of 2.5 or more herds it. The same
  replays at 750 and 850 tokens/s, 20 seeds: the fleet's mean puts reuse and TTFT
  ahead of smg's in as many runs as the backend's own count or more. With the queue's
  order priced, 2 per waiter beside 1, 1,150-1,300 tokens/s, 20 seeds: higher reuse on
  the conversation trace and fewer cells below smg_like's (lowest 0.95x against
  0.88x), slightly lower on the synthetic one.)
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
  (an agent's summary or title call): moving either recomputes its history elsewhere;
  and, with no backend idle (none without in-flight work), an unnamed one that reuses
  ``continuation_min_tokens`` from a slot and prefills no more than the slack there
  (another question over a long document; see ``_adds_little``).
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
  then charged once their prefill time, what their owner pays on return (and, as
  prefill added there, the queue cost above).
- Among equal-cost options, the slot whose content is least valuable to lose wins:
  ``displace_weight`` x the displaced tokens' prefill time is added (empty and short slots
  first), then least recently used. A tenth of their prefill time: content displaced into
  a small RAM tier is soon evicted from it, so long conversations are worth keeping in
  their slots (the chat replay of BENCHMARKS.md, simulated: best at 0.1 of 0 to 1). A
  ``session`` hint breaks remaining ties by rendezvous hash, so new conversations of one
  session stick together while distinct sessions spread.
- A prompt sharing fewer than 16 tokens with all a backend holds (a chat template's
  opening) takes an empty slot there if one is idle: the near tie would otherwise be
  decided by timing.
- ``max_resident_tokens`` caps the router's token tree (LRU leaves evicted first);
  ``slot_prompt_similarity``, ``keep_threshold``, ``ram_min_share``, ``cache_idle_slots``
  and ``kv_unified`` mirror the server's settings (see proxy/routing/cache/model.py) and must
  match its flags.
- ``min_rate_sample_tokens``: smaller prefills are not used to learn the rate nor the
  prefill time (noise).

``round_robin``, ``least_loaded`` (fewest in-flight requests) and ``random`` are the
baselines: they choose only the backend and let the server pick the slot.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from functools import lru_cache
from typing import NamedTuple

from proxy.routing.backend_state import BackendState
from proxy.routing.cache.values import CONTINUATION_SLACK, Placement
from proxy.routing.options import FOLLOWS, Candidate, best_options, redo_s
from proxy.routing.settings import RouterSettings

__all__ = ["BackendState", "Choice", "RouterSettings", "choose_prefix"]


class Choice(NamedTuple):  # not a frozen dataclass: its __init__ is ~4x slower
    """A policy's answer before the router applies it."""

    backend: str
    slot: int | None  # slot to pin (None: let the server pick or queue)
    placement: Placement | None  # predicted landing (None: queued, no idle slot)
    reasons: dict[str, object]
    queued: Placement | None = None  # when queued: predicted landing once a slot frees
    follows: int | None = None  # queued behind this waiter, for its slot (see options._follow)


def _hash_rank(session: str, name: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{session}\0{name}".encode(), digest_size=8).digest())


class Evaluated(NamedTuple):
    """An option of one candidate, with what it adds to the cluster's load."""

    cand: Candidate
    score: float  # the option's, plus the queue cost of the prefill it adds
    placement: Placement | None
    pin: int | None
    work: int  # the backend's in-flight work after taking the request
    queued: bool
    ttft: float
    leader: int | None = None


def _continues(c: Candidate, p: Placement | None, min_tokens: int, known: int | None) -> bool:
    """Does placement `p` extend the whole sequence its slot (or RAM entry) holds?
    ``known``: only that head of the prompt is known (see ``Router.decide``)."""
    if p is None or p.reuse < min_tokens or p.slot == FOLLOWS:
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
    none_idle: bool  # every candidate has work


def _price(cands: list[Candidate], n: int, s: RouterSettings, now: float,
           session: str | None) -> _Field:
    evals: list[Evaluated] = []
    waits: list[Evaluated] = []
    follows: list[Evaluated] = []
    ttfts: dict[str, float] = {}
    matched: dict[str, int] = {}
    total, total_rate = 0, 0.0
    none_idle = all(c.state.work for c in cands)
    waiting = sum(len(c.state.waiting) for c in cands) / len(cands)
    # NOTE: an uncached prefill also delays the requests served after it: the fleet's,
    # whose load the choice spreads, so the mean waiting per backend prices it anywhere
    queue_cost = s.queue_cost_weight * (1.0 + s.queue_cost_per_waiter * waiting)
    for c in cands:
        st = c.state
        plain, wait, follow = best_options(c, n, s, now, session, none_idle=none_idle)
        ttfts[c.name] = round(plain.ttft, 4)
        matched[c.name] = c.matched()
        for opt, into in ((plain, evals), (wait, waits), (follow, follows)):
            if opt is None:
                continue
            p = opt.placement
            uncached = n - (p.reuse if p is not None else 0)
            # (what it destroys is prefilled there again when its owner returns)
            added = st.prefill_s(0, n) if p is None else (
                st.prefill_s(p.reuse, n) + redo_s(p, st.prefill, p.destroyed))
            score = opt.score + queue_cost * added
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
    return _Field(evals, ttfts, matched, total, total_rate, none_idle)


def _add_follows(evals: list[Evaluated], follows: list[Evaluated], most: int) -> None:
    """Add the follows that reuse more than ``most`` (what they share with the prompt
    they find in the slot: their leader's, or the last follower's ahead), what any
    holder anywhere holds (else waiting for that holder, or running on it, reuses as
    much); by score only, unlike a wait: the holder of that prefix is not running yet,
    so nothing else reuses it, and a burst of new sessions over it is priced by the
    service times of those following already. A follow replaces its backend's plain
    option when that is the queue for any slot predicted to reuse as much (from that
    prompt, in the server's order): it does so only if it starts after the leader, in
    its slot, which following makes sure of (the proxy, not the server, orders its
    waiters)."""
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


def _within_bound(f: _Field, k: int, n: int, s: RouterSettings, session: str | None,
                  known: int | None) -> list[Evaluated]:
    """The options whose backend stays within the load bound after taking the request.

    The bound decides where *conversations* live, so that sessions sharing a prefix
    spread. The next turn of a conversation a backend holds whole adds only its tail
    there, while moving it re-creates its whole history elsewhere (a Claude Code turn:
    ~19k tokens for ~100 new); it stays unless the TTFT says otherwise (the backlog term
    still moves it off a swamped backend). So does a request of the session whose
    history the slot holds (a side call): that the client names its session tells it
    from a new conversation over a shared prompt; and a follower (see ``options._follow``),
    whose history only its leader's slot will hold; and, with no backend idle, a request
    adding little where a slot holds much of it (``_adds_little``). An idle backend is
    always within the bound: with k backends and one request in flight, the mean is 1/k
    of it, and a long prompt would be "over" everywhere."""
    slack = s.load_slack_tokens + s.load_slack_s * f.total_rate / k
    return [e for e in f.evals
            if not (work := e.cand.state.work)
            or e.work <= s.load_factor * (f.total + e.work - work) / k + slack
            or e.leader is not None
            or _continues(e.cand, e.placement, s.continuation_min_tokens, known)
            or _own_history(e.cand, e.placement, session, s.continuation_min_tokens)
            or (f.none_idle and _adds_little(e, n, s, session, slack))]


def _adds_little(e: Evaluated, n: int, s: RouterSettings, session: str | None,
                 slack: float) -> bool:
    """Does option ``e`` of an unnamed request reuse at least ``continuation_min_tokens``
    from a slot and prefill no more than the bound's slack there? With no backend idle,
    moving it recomputes what it reuses on a backend busy too, which the bound then
    finds over it in turn (a sibling of a long prompt still in prefill: one document,
    another question), while it adds little where it is; the backlog term still moves
    it, and the next such request, off a swamped backend. Unnamed: a named session's
    request stays with its own history already (``_own_history``), and a new one over
    another's shared prompt is what the bound spreads. A slot only: reusing a RAM
    entry, new conversations over a shared prefix would pile onto the backend holding
    it; taking another conversation's slot is charged the history it destroys."""
    p = e.placement
    return (session is None and p is not None and p.tier == "slot"
            and p.slot != FOLLOWS  # (a follow has a leader: within the bound already)
            and p.reuse >= s.continuation_min_tokens and n - p.reuse <= slack)


# Destroyed tokens cost their owner one recomputation when it returns. ``destroy_weight``
# charges more to keep a second conversation out of a slot whose history it would
# truncate while an empty slot can take it; with no empty slot idle anywhere, the
# alternative displaces some slot's content too, and the surcharge only moves the damage:
# their prefill time remains, with its queue cost (simulated on both traces: reuse and
# mean TTFT equal or better)
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
    allowed = _within_bound(f, len(cands), n, s, session, known)
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
