"""Routing policies: which backend (and slot) gets a request, and why.

``prefix`` (default) picks the option with the lowest *expected time to first token*:

    ttft(b, option) = backlog(b) + slot_wait(b) + (prompt - reuse) / rate(b)
                      + ram_load_s_per_token * reuse   (only when reuse comes from RAM)

- ``reuse`` comes from the cache model (proxy/cache_model.py), which mirrors llama-server:
  which idle slot the request lands in, whether the slot's state is kept, saved to RAM or
  replaced by a RAM entry. Options per backend: pin each idle slot, or let the server
  pick (an unpinned request to an empty slot may load from RAM; a pinned one may not).
- A prefix that every backend holds costs the same everywhere, so it gives no preference:
  only the match *beyond* the best alternative moves the choice (reported as
  ``beyond_alt``). A 20k-token system prompt shared by many sessions therefore does not
  herd them, and the load bound below spreads them even when one backend holds it alone.
- ``backlog(b)`` is the modelled prefill queue: each decision adds its uncached tokens /
  rate to a per-backend virtual finish time; ``rate(b)`` is learned (EWMA,
  ``rate_ewma_alpha``) from the ``prompt_n`` / ``prompt_ms`` the backend reports, starting
  at ``default_prefill_tps``.
- ``slot_wait(b)``: when no slot is idle the request is not pinned (a pinned request to a
  busy slot would disturb it) and queues on the server; it waits about one mean service
  time (EWMA of observed durations, ``default_service_s`` until learned) / n_slots. Its
  reuse is what the server will give it in the slot it gets when one frees
  (``BackendCache.predict_queued``): a queued request sharing a system prompt with the
  running ones reuses it, so queueing there is priced (and predicted) as such.
- The choice minimises ``ttft + queue_cost_weight x (prompt - reuse) / rate(b)``: the
  uncached prefill also delays every request that queues behind it on that backend, so
  recomputing a long prefix elsewhere to save a little of this request's ttft is a bad
  trade (on the Mooncake trace it costs hit ratio *and* mean ttft; BENCHMARKS.md).
- Bounded load: ``work(b)`` = uncached prompt tokens + ``request_overhead_tokens`` of each
  in-flight request. A backend is eligible only if its work after taking the request
  stays within ``load_factor`` x the mean work after the request + slack, where slack =
  ``load_slack_s`` seconds of prefill at the mean rate + ``load_slack_tokens``. The slack
  keeps a nearly idle cluster from being forced around; it is in seconds so that the
  bound means the same on a 1.5k tok/s CPU backend as on a 20k tok/s GPU. If none is
  eligible, the one with least work after the request is.
- Destroying unique content is charged ``destroy_weight`` x its prefill time: when the
  server *keeps* a slot (the prompt shares >= ``keep_threshold`` of it) it truncates the
  slot's sequence after the common prefix without saving it, so a conversation's own
  history that no other slot and no loadable RAM entry holds is gone
  (``Placement.destroyed``). Its owner will pay for it on every return: once packed onto a
  shared prefix, each visit recomputes its own tail and truncates the next one's. So a
  second conversation sharing only a prefix with the first goes to an empty slot when
  one exists, while sessions whose own part is small next to the shared prefix (a big
  system prompt and short turns) still reuse it: the charge is proportional.
- Among equal-cost options, the slot whose content is least valuable to lose wins:
  ``displace_weight`` x displaced tokens / rate is added (empty and short slots first),
  then least recently used. A ``session`` hint breaks remaining ties by rendezvous hash,
  so new conversations of one session stick together while distinct sessions spread.
- ``max_resident_tokens`` caps the router's token tree (LRU leaves evicted first);
  ``slot_prompt_similarity``, ``keep_threshold``, ``ram_min_share``, ``cache_idle_slots``
  and ``kv_unified`` mirror the server's settings (see proxy/cache_model.py) and must
  match its flags.
- ``min_rate_sample_tokens``: smaller prefills are not used to learn the rate (noise).

``round_robin``, ``least_loaded`` (fewest in-flight requests) and ``random`` are the
baselines: they choose only the backend and let the server pick the slot.
"""

from __future__ import annotations

import hashlib
import random
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from proxy.cache_model import BackendCache, Placement, ServerRules

POLICIES = ("prefix", "round_robin", "least_loaded", "random")


@dataclass(frozen=True)
class RouterSettings:
    load_factor: float = 1.25  # max work of a backend / mean work (bounded load)
    load_slack_s: float = 2.0  # slack on the bound, in seconds of prefill at the mean rate
    load_slack_tokens: int = 0  # extra absolute slack on the bound, in tokens of work
    # a request that continues a conversation a backend holds whole (at least this many
    # tokens) is exempt from the load bound there: see choose_prefix
    continuation_min_tokens: int = 1024
    max_resident_tokens: int = 64_000_000  # cap on tokens in the router's tree (LRU leaves)
    default_prefill_tps: float = 1500.0  # prefill tokens/s until a backend reports timings
    rate_ewma_alpha: float = 0.2  # weight of a new prefill-rate sample
    ram_load_s_per_token: float = 2e-6  # cost of restoring one token of KV from host RAM
    request_overhead_tokens: int = 256  # work units per request beyond its uncached prompt
    default_service_s: float = 5.0  # request duration assumed until one is observed
    displace_weight: float = 0.02  # fraction of displaced tokens' prefill time charged
    destroy_weight: float = 8.0  # x prefill time of unique tokens a placement destroys
    min_rate_sample_tokens: int = 32  # ignore rate samples from smaller prefills (noise)
    queue_cost_weight: float = 1.0  # extra charge on uncached prefill s (delays the queue)
    # llama-server behaviour mirrored by the cache model (defaults of the pinned build)
    slot_prompt_similarity: float = 0.10  # --slot-prompt-similarity
    keep_threshold: float = 0.5  # below this kept fraction the slot state goes to RAM
    ram_min_share: float = 0.25  # RAM entries must share this fraction of their tokens
    cache_idle_slots: bool = True  # --cache-idle-slots (on unless --no-cache-idle-slots)
    kv_unified: bool = False  # --kv-unified (llama-server's default only when -np is auto)

    @property
    def rules(self) -> ServerRules:
        return ServerRules(
            self.keep_threshold,
            self.ram_min_share,
            self.slot_prompt_similarity,
            self.cache_idle_slots,
            self.kv_unified,
        )

    def __post_init__(self) -> None:
        positive = {
            "load_factor": self.load_factor,
            "max_resident_tokens": self.max_resident_tokens,
            "default_prefill_tps": self.default_prefill_tps,
            "default_service_s": self.default_service_s,
        }
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"{name}: must be > 0, got {value!r}")
        if self.load_factor < 1.0:
            raise ValueError(f"load_factor: must be >= 1.0, got {self.load_factor!r}")
        if not 0.0 < self.rate_ewma_alpha <= 1.0:
            raise ValueError(f"rate_ewma_alpha: must be in (0, 1], got {self.rate_ewma_alpha!r}")
        nonneg = {
            "load_slack_tokens": self.load_slack_tokens,
            "load_slack_s": self.load_slack_s,
            "queue_cost_weight": self.queue_cost_weight,
            "ram_load_s_per_token": self.ram_load_s_per_token,
            "request_overhead_tokens": self.request_overhead_tokens,
            "displace_weight": self.displace_weight,
            "destroy_weight": self.destroy_weight,
            "min_rate_sample_tokens": self.min_rate_sample_tokens,
        }
        for name, value in nonneg.items():
            if value < 0:
                raise ValueError(f"{name}: must be >= 0, got {value!r}")
        fractions = {
            "slot_prompt_similarity": self.slot_prompt_similarity,
            "keep_threshold": self.keep_threshold,
            "ram_min_share": self.ram_min_share,
        }
        for name, value in fractions.items():
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name}: must be in [0, 1], got {value!r}")


@dataclass
class BackendState:
    """Router-side state of one backend (mutable; owned by the Router)."""

    cache: BackendCache
    rate: float  # learned prefill tokens/s
    rate_learned: bool = False
    busy_until: float = 0.0  # virtual finish time of the modelled prefill queue
    work: int = 0  # in-flight work, tokens
    inflight: int = 0  # in-flight requests
    service_s: float = 0.0  # EWMA of request durations (0 = not learned)
    queued: deque[int] = field(default_factory=deque)  # request ids waiting on the server
    queued_n: dict[int, int] = field(default_factory=dict)  # queued request id -> tokens


class Choice(NamedTuple):  # not a frozen dataclass: its __init__ is ~4x slower
    """A policy's answer before the router applies it."""

    backend: str
    slot: int | None  # slot to pin (None: let the server pick or queue)
    placement: Placement | None  # predicted landing (None: queued, no idle slot)
    reasons: dict[str, object]
    queued: Placement | None = None  # when queued: predicted landing once a slot frees


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ is ~4x slower
class Candidate:
    """Per-backend inputs to a policy for one request."""

    name: str
    state: BackendState
    slot_lcp: dict[int, int]  # slot -> tokens of the prompt that slot holds
    ram_lcp: dict[int, int]  # RAM entry -> tokens of the prompt that entry holds
    pending_lcp: dict[int, int] = field(default_factory=dict)  # queued request id -> tokens

    def predict_queued(self, n: int) -> Placement:
        """Landing of an unpinned request that must wait for a slot here."""
        st = self.state
        pend = self.pending_lcp
        ahead = [(pend.get(r, 0), st.queued_n[r]) for r in st.queued]
        return st.cache.predict_queued(self.slot_lcp, self.ram_lcp, ahead, n)


def _most(lcp: dict[int, int]) -> int:
    return max(lcp.values()) if lcp else 0


def _hash_rank(session: str, name: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{session}\0{name}".encode(), digest_size=8).digest())


def _best_option(
    c: Candidate, n: int, s: RouterSettings, now: float
) -> tuple[float, float, Placement | None, int | None, bool]:
    """Cheapest way to run on backend ``c``: (score, ttft, placement, slot to pin, queued).

    The score adds the displacement and destruction penalties to the ttft, so that
    between otherwise equal backends a new conversation lands where it evicts the least
    (spreading content) and never wipes out history it could have left alone."""
    st = c.state
    backlog = max(0.0, st.busy_until - now)
    cache = st.cache
    slots = cache.slots
    slot_lcp = c.slot_lcp
    # NOTE: empty idle slots are interchangeable, and idle slots sharing nothing with the
    # prompt differ only in what they displace: evaluate one of each kind (the first
    # empty one; the smallest, least recently used unrelated one)
    options: list[int | None] = []
    empty = cold = None
    cold_key = (0, 0)
    for i in cache.idle:
        sl = slots[i]
        if sl.n_tokens == 0:
            if empty is None:
                empty = i
        elif i in slot_lcp:
            options.append(i)
        elif cold is None or (sl.n_tokens, sl.last_used) < cold_key:
            cold, cold_key = i, (sl.n_tokens, sl.last_used)
    ram_match = bool(c.ram_lcp)
    # without a RAM match, displacing an unrelated slot only costs: the empty one wins
    if cold is not None and (empty is None or ram_match):
        options.append(cold)
    if empty is not None:
        options.append(empty)
        if ram_match:
            options.append(None)  # unpinned: an empty slot then consults the RAM cache
    if not options:
        # queued on the server: it gets the slot that frees, whose content it may share
        service = st.service_s or s.default_service_s
        p = c.predict_queued(n)
        wait = service / cache.cap.n_slots
        ttft = backlog + wait + (n - p.reuse) / st.rate
        if p.tier == "ram":
            ttft += s.ram_load_s_per_token * p.reuse
        return ttft + _penalty(p, s, st.rate), ttft, p, None, True
    rate = st.rate
    ram_lcp = c.ram_lcp
    best: tuple[tuple[float, float, int], Placement, int | None] | None = None
    for opt in options:
        p = cache.predict(opt, slot_lcp, ram_lcp, n)
        assert p is not None, "idle slots exist"
        ttft = backlog + (n - p.reuse) / rate
        if p.tier == "ram":
            ttft += s.ram_load_s_per_token * p.reuse
        key = (ttft + _penalty(p, s, rate), ttft, slots[p.slot].last_used)
        if best is None or key < best[0]:
            best = (key, p, opt)
    assert best is not None
    return best[0][0], best[0][1], best[1], best[2], False


def _penalty(p: Placement, s: RouterSettings, rate: float) -> float:
    """Seconds charged for what a placement takes away from the slot's current content."""
    return (s.displace_weight * p.displaced + s.destroy_weight * p.destroyed) / rate


def _continues(c: Candidate, p: Placement | None, min_tokens: int) -> bool:
    """Does placement `p` extend the whole sequence its slot (or RAM entry) holds?"""
    if p is None or p.reuse < min_tokens:
        return False
    if p.tier == "ram" and p.ram_entry is not None:
        held = c.state.cache.ram.get(p.ram_entry, 0)
        lcp = c.ram_lcp.get(p.ram_entry, 0)
    elif p.tier == "slot":
        held = c.state.cache.slots[p.slot].n_tokens
        lcp = c.slot_lcp.get(p.slot, 0)
    else:
        return False
    # NOTE: the server may not keep the last generated token(s): a few may differ
    return held - lcp <= _CONTINUATION_SLACK


_CONTINUATION_SLACK = 4


def choose_prefix(
    cands: list[Candidate], n: int, s: RouterSettings, now: float, session: str | None
) -> Choice:
    evals = []
    ttfts: dict[str, float] = {}
    matched: dict[str, int] = {}  # longest match per backend, for the reasons
    total = 0  # in-flight work of all candidates
    total_rate = 0.0
    for c in cands:
        st = c.state
        score, ttft, p, pin, queued = _best_option(c, n, s, now)
        ttfts[c.name] = round(ttft, 4)
        matched[c.name] = max(_most(c.slot_lcp), _most(c.ram_lcp))
        uncached = n - (p.reuse if p is not None else 0)
        # NOTE: the uncached prefill also delays every request queued behind it
        score += s.queue_cost_weight * uncached / st.rate
        work = st.work + uncached + s.request_overhead_tokens
        evals.append((c, score, p, pin, work, queued))
        total += st.work
        total_rate += st.rate
    k = len(cands)
    slack = s.load_slack_tokens + s.load_slack_s * total_rate / k
    allowed = []
    for e in evals:
        work = e[0].state.work
        # NOTE: the bound decides where *conversations* live, so that sessions sharing a
        # prefix spread. The next turn of a conversation a backend holds whole adds only
        # its tail there, while moving it re-creates its whole history elsewhere (a
        # Claude Code turn: ~19k tokens for ~100 new); it stays unless the TTFT says
        # otherwise (the backlog term still moves it off a swamped backend).
        if e[4] <= s.load_factor * (total + e[4] - work) / k + slack or \
                _continues(e[0], e[2], s.continuation_min_tokens):
            allowed.append(e)
    why = "lowest expected ttft"
    if not allowed:
        allowed = [min(evals, key=lambda e: e[4])]
        why = "all above load bound: least work"

    def key(
        e: tuple[Candidate, float, Placement | None, int | None, int, bool],
    ) -> tuple[float, int]:
        rank = _hash_rank(session, e[0].name) if session else 0
        return (e[1], rank)

    c, _, p, pin, _, queued = min(allowed, key=key)
    if len(allowed) < len(evals) and why == "lowest expected ttft":
        best_any = min(evals, key=key)
        if best_any[0].name != c.name:
            why = f"lowest expected ttft within load bound ({best_any[0].name} over bound)"
    alt = max((v for name, v in matched.items() if name != c.name), default=0)
    reasons: dict[str, object] = {
        "policy": "prefix",
        "why": why,
        "matched": matched,
        "beyond_alt": matched[c.name] - alt,
        "ttft_s": ttfts,
        "work": {e[0].name: e[0].state.work for e in evals},
        "eligible": [e[0].name for e in allowed],
    }
    if queued:
        return Choice(c.name, None, None, reasons, queued=p)
    return Choice(c.name, pin if p is not None else None, p, reasons)


@dataclass
class Baselines:
    """State of the comparison policies."""

    seed: int = 0
    rr_next: int = 0
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def choose(self, policy: str, cands: list[Candidate], n: int) -> Choice:
        if policy == "round_robin":
            c = cands[self.rr_next % len(cands)]
            self.rr_next += 1
        elif policy == "least_loaded":
            c = min(cands, key=lambda x: (x.state.inflight, x.state.work))
        elif policy == "random":
            c = self.rng.choice(cands)
        else:
            raise AssertionError(f"unknown policy {policy}")
        p = c.state.cache.predict(None, c.slot_lcp, c.ram_lcp, n)
        matched = {x.name: max(_most(x.slot_lcp), _most(x.ram_lcp)) for x in cands}
        reasons: dict[str, object] = {
            "policy": policy,
            "why": policy,
            "matched": matched,
            "inflight": {x.name: x.state.inflight for x in cands},
        }
        return Choice(c.name, None, p, reasons)
