"""Discrete-event replay of a workload against modelled llama-server backends.

Each backend is a :class:`~proxy.routing.cache.model.BackendCache` (the same llama-server model
the router uses, but its own instance: the "truth") plus a prefill queue and per-slot
decode:

- prefill is one FIFO compute queue per backend at ``prefill_tps`` at a context's start,
  each token slower by ``prefill_s_per_position`` per token before it (attention; see
  proxy/routing/prefill.py), uncached tokens only; tokens loaded from the RAM cache cost
  ``ram_load_s_per_token``;
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
    kvb = be.kv_bytes_per_token
    prefill = PrefillCost(1.0 / be.prefill_tps, be.prefill_s_per_position)
    caps = [
        BackendCapacity(f"b{i}", be.n_slots, be.slot_ctx, be.ram_cache_tokens * kvb, kvb,
                        memory=be.memory)
        for i in range(n_backends)
    ]
    s = settings or RouterSettings(default_prefill_tps=be.prefill_tps)
    if policy == "smg_like":
        from loadtest.smg_like import register

        register()
    router = Router(policy, settings=s, seed=seed)
    # a baseline after a router that holds nothing: what has no slot waits in the server
    server_queues = getattr(router._policy, "server_queues", False)
    truth_tree = RadixTree()
    servers: dict[str, _Server] = {}
    for cap in caps:
        router.add_backend(cap)
        # the server itself searches every RAM entry it has (the router's model may not)
        servers[cap.name] = _Server(BackendCache(cap, truth_tree, s.rules,
                                                 max_tracked=1 << 62))
    blocks = BlockPrompts()
    filler = bytes(4 * max((r.output_length for r in trace), default=0))  # token 0
    events: list[tuple[float, int, int, _Req | None]] = []  # (t, order, kind, req)
    for i, r in enumerate(trace):
        events.append((r.timestamp_ms / 1000.0 / time_scale, i, 0, None))
    heapq.heapify(events)
    order = len(trace)
    ttfts: list[float] = []
    prompt_tokens = reused = held_tokens = rejected = 0

    def lcps(name: str, q: bytes) -> tuple[dict[int, int], dict[int, int]]:
        slot_lcp: dict[int, int] = {}
        ram_lcp: dict[int, int] = {}
        for (b, kind, idx), got in truth_tree.match(q).held.items():  # type: ignore[misc]
            if b == name:
                if kind == SLOT:
                    slot_lcp[idx] = got
                elif kind == RAM:
                    ram_lcp[idx] = got
        return slot_lcp, ram_lcp

    def try_start(srv: _Server, req: _Req, now: float) -> bool:
        nonlocal order, prompt_tokens, reused, held_tokens
        cache = srv.cache
        slot = req.slot
        if slot is not None and cache.slots[slot].busy:
            return False
        slot_lcp, ram_lcp = lcps(cache.cap.name, req.prompt)
        p = cache.start(slot, req.prompt, slot_lcp, ram_lcp, req.n,
                        launch=Launch(req.user_starts))
        if p is None:
            return False
        req.slot, req.reuse = p.slot, p.reuse
        req.prefill_s = prefill.seconds(p.reuse, req.n)
        load = be.ram_load_s_per_token * p.reuse if p.tier == "ram" else 0.0
        begin = max(now, srv.compute_free)
        srv.compute_free = begin + req.prefill_s + load
        first = srv.compute_free
        ttfts.append(first - req.arrival)
        starts.append((req.idx, req.decision.backend, p.slot, p.reuse, first - req.arrival))
        decode = req.out / be.decode_tps
        srv.busy_s += req.prefill_s + load + decode
        srv.served += 1
        prompt_tokens += req.n
        reused += p.reuse
        held_tokens += req.held
        order += 1
        heapq.heappush(events, (first, order, 2, req))  # its first token: prefilled
        order += 1
        heapq.heappush(events, (first + decode, order, 1, req))
        return True

    held: dict[int, _Req] = {}  # queued decisions, by request id
    starts: list[tuple[int, str, int, int, float]] = []
    wall0 = time.perf_counter()
    cpu0 = time.process_time()
    # NOTE: the replay allocates millions of small containers but makes no reference
    # cycles (tree nodes are unlinked by hand), so the cyclic GC only re-scans the
    # ever larger trees: ~5% of the replay's CPU. Paused for the loop only.
    gc_enabled = gc.isenabled()
    gc.disable()
    try:
        while events:
            now, idx, kind, req = heapq.heappop(events)
            if kind == 0:
                r = trace[idx]
                q = blocks.prompt(r) if prompts is None else prompts[idx]
                users = user_starts[idx] if user_starts is not None else ()
                d = router.decide(q, now=now, launch=Launch(users))  # int32 token bytes
                if not isinstance(d, Routed):
                    rejected += 1
                    continue
                n = len(q) // 4
                req = _Req(idx, now, q, n, r.output_length, d, d.slot, users,
                           held=min(truth_tree.match(q).matched, n - 1))
                if d.queued and not server_queues:
                    held[d.request_id] = req  # the proxy holds it until its Handoff
                    continue
                srv = servers[d.backend]
                if srv.waiting or not try_start(srv, req, now):
                    srv.waiting.append(req)
                continue
            assert req is not None and req.slot is not None
            if kind == 2:
                router.prefilled(req.decision)
                continue
            srv = servers[req.decision.backend]
            out = filler[: 4 * req.out]
            srv.cache.finish_generated(req.slot, out)
            handoffs = router.complete(req.decision, Report(output_tokens=out,
                                                            reported_cached=req.reuse,
                                                            prompt_ms=req.prefill_s * 1000.0,
                                                            prompt_n=req.n - req.reuse,
                                                            reported_slot=req.slot), now=now)
            # the server retries its deferred tasks in order when a slot frees
            if srv.waiting:
                srv.waiting = deque(w for w in srv.waiting if not try_start(srv, w, now))
            # then the proxy sends the requests it held, pinned to the slots handed them
            for h in handoffs:
                if server_queues:
                    continue  # (sent already: it waits in the server's queue)
                w = held.pop(h.request_id)
                w.slot = h.slot  # (its record's prediction says so too)
                hsrv = servers[h.backend]
                if hsrv.waiting or not try_start(hsrv, w, now):
                    hsrv.waiting.append(w)
    finally:
        if gc_enabled:
            gc.enable()
    wall = time.perf_counter() - wall0
    cpu = time.process_time() - cpu0

    busy = [srv.busy_s for srv in servers.values()]
    served = [srv.served for srv in servers.values()]
    ttfts.sort()
    done = len(ttfts)
    return SimResult(
        policy=policy,
        n_backends=n_backends,
        requests=done,
        rejected=rejected,
        prompt_tokens=prompt_tokens,
        reused_tokens=reused,
        held_tokens=held_tokens,
        ttft_mean=sum(ttfts) / done if done else math.nan,
        ttft_p90=ttfts[min(done - 1, int(0.9 * done))] if done else math.nan,
        imbalance=max(busy) / (sum(busy) / len(busy)) if sum(busy) else 1.0,
        req_imbalance=max(served) / (sum(served) / len(served)) if sum(served) else 1.0,
        wall_s=wall,
        mispredicted=router.mispredictions / max(1, router.completed),
        cpu_s=cpu,
        starts=tuple(starts),
    )


def plan_capacity(
    trace: Sequence[TraceRequest],
    target_p90_s: float,
    backend: SimBackend | None = None,
    policy: str = "prefix",
    max_backends: int = 64,
    time_scale: float = 1.0,
    prompts: Sequence[bytes] | None = None,
) -> tuple[int | None, list[SimResult]]:
    """Fewest backends whose modelled p90 TTFT meets the target (None: not within max).

    Doubles until the target is met, then bisects; assumes more backends never hurt.
    """
    runs: dict[int, SimResult] = {}

    def ok(n: int) -> bool:
        if n not in runs:
            runs[n] = simulate(trace, policy, n, backend, time_scale=time_scale,
                               prompts=prompts)
        return runs[n].ttft_p90 <= target_p90_s

    hi = 1
    while not ok(hi):
        if hi >= max_backends:
            return None, [runs[k] for k in sorted(runs)]
        hi = min(max_backends, hi * 2)
    lo = hi // 2  # lo fails (or is 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi, [runs[k] for k in sorted(runs)]


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
