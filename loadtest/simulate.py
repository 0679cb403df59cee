"""Discrete-event replay of a workload against modelled llama-server backends.

Each backend is a :class:`~proxy.routing.cache.model.BackendCache` (the same llama-server model
the router uses, but its own instance: the "truth") plus a prefill queue and per-slot
decode:

- prefill is one FIFO compute queue per backend at ``prefill_tps`` at a context's start,
  each token slower by ``prefill_s_per_position`` per token before it (attention; see
  proxy/routing/prefill.py), uncached tokens only, each request's prefill time times a
  log-normal factor of mean 1 and sigma ``prefill_noise`` (live servers' times scatter
  about their fit with the other slot's batch and the machine; drawn from the seed, so
  a replay repeats); tokens loaded from the RAM cache cost ``ram_load_s_per_token``;
- decode runs in the slot at ``decode_tps`` per slot after the first token;
- a request the router queued (no idle slot, or waiting for a busy one) is held, as the
  proxy holds it, until the router hands it a slot (``Handoff``), then sent pinned there;
  one the server cannot place waits in the server's queue (FIFO) until a slot frees;
- ``smg_like`` (loadtest/smg_like.py, a simulation baseline after SGLang's smg router)
  holds nothing: what it queues waits unpinned in the server's queue.

The real :class:`~proxy.routing.router.Router` decides every request and gets the truth back in
``complete()`` (reused tokens, prompt timings, slot), exactly as the live proxy would.
The oracle hit ratio assumes an unbounded cache and perfect routing: every prompt reuses
the longest prefix any earlier prompt had.
"""

from __future__ import annotations

import gc
import heapq
import math
import random
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from loadtest.trace import BlockPrompts, TraceRequest
from proxy.routing.cache.checkpoints import DENSE, Memory
from proxy.routing.cache.model import BackendCache
from proxy.routing.cache.values import RAM, SLOT, BackendCapacity, Launch
from proxy.routing.decision import Report
from proxy.routing.prefill import PrefillCost
from proxy.routing.routed import Routed
from proxy.routing.router import Router
from proxy.routing.settings import RouterSettings
from proxy.routing.tree.radix import RadixTree

if TYPE_CHECKING:
    from loadtest.workloads import Workload


@dataclass(frozen=True)
class SimBackend:
    n_slots: int = 8
    slot_ctx: int = 262_144
    ram_cache_tokens: int = 1_000_000  # host-RAM prompt cache size, in tokens of KV
    kv_bytes_per_token: int = 131_072  # Llama-3-8B f16
    prefill_tps: float = 20_000.0  # at position 0
    prefill_s_per_position: float = 0.0  # a token's extra seconds per token before it
    prefill_noise: float = 0.0  # sigma of the log-normal factor on each prefill's time
    decode_tps: float = 40.0  # per slot
    ram_load_s_per_token: float = 2e-6
    memory: Memory = DENSE  # sliding-window or hybrid: reuse up to checkpoints


@dataclass(frozen=True)
class SimResult:
    policy: str
    n_backends: int
    requests: int
    rejected: int
    prompt_tokens: int
    reused_tokens: int
    held_tokens: int  # of each prompt, the longest prefix any backend held as it arrived
    ttft_mean: float
    ttft_p90: float
    imbalance: float  # max / mean of per-backend busy seconds (prefill + decode)
    req_imbalance: float  # max / mean of requests per backend
    wall_s: float
    mispredicted: float  # share of completions whose reuse the router predicted wrong
    cpu_s: float = 0.0  # process CPU time of the replay (steadier than wall on a busy host)
    # per started request, in start order: (trace index, backend, slot, reused, ttft s)
    starts: tuple[tuple[int, str, int, int, float], ...] = ()

    @property
    def hit_ratio(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def held_ratio(self) -> float:
        """What perfect routing could have reused of what the fleet held: the oracle less
        this is lost to eviction, this less the hit ratio to routing and queueing."""
        return self.held_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.wall_s if self.wall_s else 0.0

    @property
    def requests_per_cpu_s(self) -> float:
        return self.requests / self.cpu_s if self.cpu_s else 0.0


@dataclass
class _Req:
    idx: int
    arrival: float
    prompt: bytes
    n: int
    out: int
    decision: Routed
    slot: int | None = None  # pinned slot, then the slot it runs in
    user_starts: tuple[int, ...] = ()
    held: int = 0  # the longest prefix any backend held as it arrived
    reuse: int = 0
    prefill_s: float = 0.0


@dataclass
class _Server:
    cache: BackendCache
    compute_free: float = 0.0
    waiting: deque[_Req] = field(default_factory=deque)
    busy_s: float = 0.0
    served: int = 0


def simulate(
    trace: Sequence[TraceRequest],
    policy: str,
    n_backends: int,
    backend: SimBackend | None = None,
    settings: RouterSettings | None = None,
    time_scale: float = 1.0,
    seed: int = 0,
    prompts: Sequence[bytes] | None = None,
    user_starts: Sequence[tuple[int, ...]] | None = None,
) -> SimResult:
    """Replay ``trace`` (arrivals divided by ``time_scale``) through one policy.
    ``prompts``: each request's prompt as int32 token bytes, instead of its blocks'
    token ids (a chat replay, tokenized through the template as the server does);
    ``user_starts``: where each one's user messages start (checkpointed memory)."""
    be = backend or SimBackend()
    s = settings or RouterSettings(default_prefill_tps=be.prefill_tps)
    if policy == "smg_like":
        from loadtest.smg_like import register

        register()
    replay = _Replay(trace, Router(policy, settings=s, seed=seed), n_backends, be, seed,
                     time_scale)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    # NOTE: the replay allocates millions of small containers but makes no reference
    # cycles (tree nodes are unlinked by hand), so the cyclic GC only re-scans the
    # ever larger trees: ~5% of the replay's CPU. Paused for the loop only.
    gc_enabled = gc.isenabled()
    gc.disable()
    try:
        replay.run(prompts, user_starts)
    finally:
        if gc_enabled:
            gc.enable()
    return replay.result(policy, time.perf_counter() - wall0, time.process_time() - cpu0)


class _Replay:
    """One replay's state: the router deciding, the servers it sends to (each a model of
    its own: the truth), the events to come (arrival 0, end of prefill 2, end 1) and the
    tallies."""

    def __init__(self, trace: Sequence[TraceRequest], router: Router, n_backends: int,
                 be: SimBackend, seed: int, time_scale: float) -> None:
        self.trace, self.router, self.be = trace, router, be
        kvb = be.kv_bytes_per_token
        self.prefill = PrefillCost(1.0 / be.prefill_tps, be.prefill_s_per_position)
        # a baseline after a router that holds nothing: what has no slot waits in the
        # server
        self.server_queues = getattr(router._policy, "server_queues", False)
        self.truth_tree = RadixTree()
        self.servers: dict[str, _Server] = {}
        for i in range(n_backends):
            cap = BackendCapacity(f"b{i}", be.n_slots, be.slot_ctx, be.ram_cache_tokens * kvb,
                                  kvb, memory=be.memory)
            router.add_backend(cap)
            # the server itself searches every RAM entry it has (the router's model may not)
            self.servers[cap.name] = _Server(BackendCache(cap, self.truth_tree,
                                                          router.settings.rules,
                                                          max_tracked=1 << 62))
        # one factor per request, drawn up front from a stream of its own: every policy
        # replayed with a seed meets the same noise on the same request (their difference
        # is not the draws'); of mean 1, as the scatter about a least-squares fit
        sigma = be.prefill_noise
        rng = random.Random(f"prefill noise {seed}")
        self.noise = [rng.lognormvariate(-sigma * sigma / 2, sigma) if sigma else 1.0
                      for _ in trace]
        self.blocks = BlockPrompts()
        self.filler = bytes(4 * max((r.output_length for r in trace), default=0))  # token 0
        self.events: list[tuple[float, int, int, _Req | None]] = [
            (r.timestamp_ms / 1000.0 / time_scale, i, 0, None) for i, r in enumerate(trace)]
        heapq.heapify(self.events)
        self.order = len(trace)
        self.held: dict[int, _Req] = {}  # queued decisions, by request id
        self.ttfts: list[float] = []
        self.starts: list[tuple[int, str, int, int, float]] = []
        self.prompt_tokens = self.reused = self.held_tokens = self.rejected = 0

    def run(self, prompts: Sequence[bytes] | None,
            user_starts: Sequence[tuple[int, ...]] | None) -> None:
        events = self.events
        while events:
            now, idx, kind, req = heapq.heappop(events)
            if kind == 0:
                q = prompts[idx] if prompts is not None else self.blocks.prompt(self.trace[idx])
                self.arrive(idx, q, user_starts[idx] if user_starts is not None else (), now)
            elif kind == 2:
                assert req is not None
                self.router.prefilled(req.decision)
            else:
                assert req is not None
                self.finish(req, now)

    def _push(self, t: float, kind: int, req: _Req) -> None:
        self.order += 1
        heapq.heappush(self.events, (t, self.order, kind, req))

    def _lcps(self, name: str, q: bytes) -> tuple[dict[int, int], dict[int, int]]:
        slot_lcp: dict[int, int] = {}
        ram_lcp: dict[int, int] = {}
        for (b, kind, idx), got in self.truth_tree.match(q).held.items():  # type: ignore[misc]
            if b == name:
                if kind == SLOT:
                    slot_lcp[idx] = got
                elif kind == RAM:
                    ram_lcp[idx] = got
        return slot_lcp, ram_lcp

    def arrive(self, idx: int, q: bytes, users: tuple[int, ...], now: float) -> None:
        """A request arrives: the router decides, it is held by the proxy (queued there) or
        sent, and waits in the server's queue when it cannot start."""
        d = self.router.decide(q, now=now, launch=Launch(users))  # int32 token bytes
        if not isinstance(d, Routed):
            self.rejected += 1
            return
        n = len(q) // 4
        req = _Req(idx, now, q, n, self.trace[idx].output_length, d, d.slot, users,
                   held=min(self.truth_tree.match(q).matched, n - 1))
        if d.queued and not self.server_queues:
            self.held[d.request_id] = req  # the proxy holds it until its Handoff
            return
        self._send(self.servers[d.backend], req, now)

    def _send(self, srv: _Server, req: _Req, now: float) -> None:
        if srv.waiting or not self._try_start(srv, req, now):
            srv.waiting.append(req)

    def _try_start(self, srv: _Server, req: _Req, now: float) -> bool:
        cache, be = srv.cache, self.be
        if req.slot is not None and cache.slots[req.slot].busy:
            return False
        slot_lcp, ram_lcp = self._lcps(cache.cap.name, req.prompt)
        p = cache.start(req.slot, req.prompt, slot_lcp, ram_lcp, req.n,
                        launch=Launch(req.user_starts))
        if p is None:
            return False
        req.slot, req.reuse = p.slot, p.reuse
        req.prefill_s = self.prefill.seconds(p.reuse, req.n) * self.noise[req.idx]
        load = be.ram_load_s_per_token * p.reuse if p.tier == "ram" else 0.0
        srv.compute_free = max(now, srv.compute_free) + req.prefill_s + load
        first = srv.compute_free
        self.ttfts.append(first - req.arrival)
        self.starts.append((req.idx, req.decision.backend, p.slot, p.reuse,
                            first - req.arrival))
        decode = req.out / be.decode_tps
        srv.busy_s += req.prefill_s + load + decode
        srv.served += 1
        self.prompt_tokens += req.n
        self.reused += p.reuse
        self.held_tokens += req.held
        self._push(first, 2, req)  # its first token: prefilled
        self._push(first + decode, 1, req)
        return True

    def finish(self, req: _Req, now: float) -> None:
        """A request ends: the truth and the router learn it, the server retries its
        queue, then the proxy sends the requests handed the slots that freed."""
        assert req.slot is not None
        srv = self.servers[req.decision.backend]
        out = self.filler[: 4 * req.out]
        srv.cache.finish_generated(req.slot, out)
        handoffs = self.router.complete(req.decision, Report(
            output_tokens=out, reported_cached=req.reuse, prompt_ms=req.prefill_s * 1000.0,
            prompt_n=req.n - req.reuse, reported_slot=req.slot), now=now)
        # the server retries its deferred tasks in order when a slot frees
        if srv.waiting:
            srv.waiting = deque(w for w in srv.waiting if not self._try_start(srv, w, now))
        # then the proxy sends the requests it held, pinned to the slots handed them
        for h in handoffs:
            if self.server_queues:
                continue  # (sent already: it waits in the server's queue)
            w = self.held.pop(h.request_id)
            w.slot = h.slot  # (its record's prediction says so too)
            self._send(self.servers[h.backend], w, now)

    def result(self, policy: str, wall: float, cpu: float) -> SimResult:
        busy = [srv.busy_s for srv in self.servers.values()]
        served = [srv.served for srv in self.servers.values()]
        ttfts = sorted(self.ttfts)
        done = len(ttfts)
        return SimResult(
            policy=policy,
            n_backends=len(self.servers),
            requests=done,
            rejected=self.rejected,
            prompt_tokens=self.prompt_tokens,
            reused_tokens=self.reused,
            held_tokens=self.held_tokens,
            ttft_mean=sum(ttfts) / done if done else math.nan,
            ttft_p90=ttfts[min(done - 1, int(0.9 * done))] if done else math.nan,
            imbalance=max(busy) / (sum(busy) / len(busy)) if sum(busy) else 1.0,
            req_imbalance=max(served) / (sum(served) / len(served)) if sum(served) else 1.0,
            wall_s=wall,
            mispredicted=self.router.mispredictions / max(1, self.router.completed),
            cpu_s=cpu,
            starts=tuple(self.starts),
        )


def format_table(results: Sequence[SimResult], oracle: float) -> str:
    """Policies side by side, one column each."""
    rows = [
        ("hit ratio", lambda r: f"{r.hit_ratio:.3f}"),
        ("oracle hit ratio", lambda r: f"{oracle:.3f}"),
        ("held at arrival", lambda r: f"{r.held_ratio:.3f}"),
        ("ttft mean s", lambda r: f"{r.ttft_mean:.3f}"),
        ("ttft p90 s", lambda r: f"{r.ttft_p90:.3f}"),
        ("imbalance (busy max/mean)", lambda r: f"{r.imbalance:.3f}"),
        ("requests max/mean", lambda r: f"{r.req_imbalance:.3f}"),
        ("requests", lambda r: str(r.requests)),
        ("rejected", lambda r: str(r.rejected)),
        ("mispredicted", lambda r: f"{r.mispredicted:.3f}"),
        ("sim requests/s", lambda r: f"{r.requests_per_s:,.0f}"),
        ("sim requests/cpu-s", lambda r: f"{r.requests_per_cpu_s:,.0f}"),
    ]
    head = ["metric", *[r.policy for r in results]]
    body = [[name, *[fmt(r) for r in results]] for name, fmt in rows]
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in [head]]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in body]
    return "\n".join(lines)


def chat_replay(workload: Workload, gguf: Path
                ) -> tuple[list[TraceRequest], list[bytes], list[tuple[int, ...]]]:
    """A chat workload's requests as the simulator takes them: arrivals and output
    lengths, each prompt tokenized as the server would (template, then vocabulary), and
    where the server finds its user messages starting."""
    from proxy.prompt.builder import PromptBuilder
    from proxy.prompt.delimiters import user_starts

    builder = PromptBuilder.load(gguf)
    trace, prompts, starts = [], [], []
    for sess in workload.sessions:
        req = sess.steps[0].main
        ids = builder.chat_ids(req.body).tobytes()
        prompts.append(ids)
        starts.append(user_starts(ids, builder.message_delimiters))
        trace.append(TraceRequest(sess.start_s * 1000.0, len(ids) // 4,
                                  int(req.body.get("max_tokens", 1)), ()))
    return trace, prompts, starts
