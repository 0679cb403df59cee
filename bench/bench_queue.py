"""Router CPU per event against the number of requests waiting in its queue.

Pure and in-process (no servers): one Router, 8 backends x 4 slots. 32 + N requests are
routed (the policy queues some before every slot is taken), after the same 2000
requests have gone through at a short queue (the RAM tiers full), then each step ends the
oldest running request (its slot freed: a waiter is handed it) and routes a new one: the
router keeps about N queued. The prompts mix small ones and ~30k-token agent
turns sharing a 10k-token system prompt, each agent's history in its own tail (siblings
share it: another turn of the agent sent before the first one ended). Prints the
router's CPU per event at each N and the ratios N=256 / N=16 and N=1024 / N=64, which a
queue indexed for its hand-offs keeps near 1 but for the backends still with an idle slot
at small N ("full backends": the policy does more for a backend whose slots are all busy,
however long its queue).

Run: ``python bench/bench_queue.py [--waiters 16,64,256,1024] [--steps 300]``.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from proxy.routing.cache.values import BackendCapacity
from proxy.routing.decision import Handoff, Report
from proxy.routing.routed import Routed
from proxy.routing.router import Router

BACKENDS, SLOTS = 8, 4
SYSTEM = 10_000  # tokens of the agents' shared system prompt
HISTORY = 19_000  # tokens of an agent's own history when it starts
TURN = 1_000  # tokens each agent turn adds
KV_BYTES = 32 * 1024  # per token
RAM = 8 << 30  # per backend: a handful of agent turns
WARMUP = 2000  # requests completed before the queue grows


class Workload:
    """Prompts: half small and unrelated, half the next turn of one of 64 agents (two
    turns of one agent in flight at once are siblings: one history, each its own end)."""

    def __init__(self, seed: int, agents: int = 64) -> None:
        self.rng = random.Random(seed)
        self.system = self.rng.randbytes(4 * SYSTEM)
        self.history = [self._fresh() for _ in range(agents)]
        self.agent: dict[int, int] = {}  # request id -> its agent

    def _fresh(self) -> bytes:
        return self.system + self.rng.randbytes(4 * HISTORY)

    def prompt(self) -> tuple[bytes, int | None]:
        if self.rng.random() < 0.5:
            a = self.rng.randrange(len(self.history))
            if len(self.history[a]) > 4 * (SYSTEM + HISTORY + 12 * TURN):
                self.history[a] = self._fresh()  # a new task: a new history
            return self.history[a] + self.rng.randbytes(4 * TURN), a
        return self.rng.randbytes(4 * self.rng.randint(200, 2000)), None

    def answer(self, rid: int, prompt: bytes) -> bytes:
        out = self.rng.randbytes(4 * 50)
        a = self.agent.pop(rid, None)
        if a is not None:
            self.history[a] = prompt + out
        return out


def run(n_waiters: int, steps: int, seed: int = 0) -> tuple[float, float, float, float]:
    """Mean router CPU (us) of an arrival (decide) and of a slot freed (complete) with
    about ``n_waiters`` queued, the mean number queued, and the mean number of backends
    with no idle slot as a request arrives (each costs an arrival more: the policy
    predicts its queue's landing and weighs waiting for each busy slot)."""
    r = Router()
    for i in range(BACKENDS):
        r.add_backend(BackendCapacity(f"b{i}", SLOTS, 65_536, RAM, KV_BYTES))
    w = Workload(seed)
    running: deque[tuple[Routed, bytes]] = deque()  # oldest start first
    waiting: dict[int, tuple[Routed, bytes]] = {}
    now = 0.0

    def arrive() -> int:
        nonlocal now
        now += 0.01
        prompt, agent = w.prompt()
        t0 = time.process_time_ns()
        d = r.decide(prompt, now=now)
        spent = time.process_time_ns() - t0
        assert isinstance(d, Routed)
        if agent is not None:
            w.agent[d.request_id] = agent
        (waiting.__setitem__(d.request_id, (d, prompt)) if d.queued
         else running.append((d, prompt)))
        return spent

    def free() -> int:
        nonlocal now
        now += 0.01
        d, prompt = running.popleft()
        out = w.answer(d.request_id, prompt)
        t0 = time.process_time_ns()
        handed: list[Handoff] = r.complete(d, Report(output_tokens=out,
                                                     reported_cached=d.predicted_cached,
                                                     prompt_ms=1000.0,
                                                     prompt_n=d.prompt_tokens), now=now)
        spent = time.process_time_ns() - t0
        for h in handed:
            running.append(waiting.pop(h.request_id))
        return spent

    # the same history at every N (the RAM tiers fill up), then the queue grows to N
    while r.completed < WARMUP:
        while len(running) + len(waiting) < BACKENDS * SLOTS + 16:
            arrive()
        free()
    while len(running) + len(waiting) < BACKENDS * SLOTS + n_waiters:
        arrive()
    gc.collect()
    arrivals = frees = queued = full = 0
    for _ in range(steps):
        frees += free()
        full += sum(all(s["busy"] for s in b["slots"])  # type: ignore[index]
                    for b in r.snapshot()["backends"].values())  # type: ignore[union-attr]
        arrivals += arrive()
        queued += len(waiting)
    return arrivals / steps / 1e3, frees / steps / 1e3, queued / steps, full / steps


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--waiters", default="16,64,256,1024")
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    got: dict[int, tuple[float, float]] = {}
    print(f"{'waiters':>8} {'queued':>7} {'full backends':>14} {'arrival us':>11} "
          f"{'slot freed us':>14} {'per event us':>13}")
    for n in (int(x) for x in args.waiters.split(",")):
        a, f, queued, full = run(n, args.steps)
        got[n] = a, f
        print(f"{n:>8} {queued:>7.0f} {full:>14.1f} {a:>11.0f} {f:>14.0f} "
              f"{(a + f) / 2:>13.0f}", flush=True)
    for lo, hi in ((16, 256), (64, 1024)):
        if lo in got and hi in got:
            (a_lo, f_lo), (a_hi, f_hi) = got[lo], got[hi]
            print(f"ratio {hi}/{lo}: arrival {a_hi / a_lo:.2f}x, slot freed "
                  f"{f_hi / f_lo:.2f}x, per event {(a_hi + f_hi) / (a_lo + f_lo):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
