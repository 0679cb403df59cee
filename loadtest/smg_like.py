"""``smg_like``: a simulation baseline after SGLang's router ``smg --policy cache_aware``.

For the simulator only (loadtest/simulate.py registers it when asked for it; the proxy
never offers it). What it models of smg 1.13.0's cache_aware policy
(../shared/notes/peers.md):

- an approximate tree of the request prompts each worker was sent (here over tokens, not
  characters; no eviction: smg's tree holds ~2^26 characters, more than a replay sends);
- load = requests in flight per worker, as smg counts them for llama-servers (which
  report no load of their own): from dispatch to the end of the answer;
- if the best match ratio (matched tokens / prompt tokens) > ``cache_threshold`` (0.3,
  what `smg launch` runs with; its log prints it), the workers holding that match, less
  those that spill (load > 1.5 x the mean and > the mean + min(64, max(4, 2 sqrt(mean))):
  ``cache_aware.rs``, candidate_requires_spill); if all spill, the workers that do not;
- else (a miss) every worker; among those, the fewest in flight, ties at random
  (``least_load.rs``, with no load reports);
- the prompt goes into the chosen worker's tree either way;
- requests are sent unpinned: the server picks the slot, or queues the request FIFO
  (the simulator sends a queued ``smg_like`` request to the server's queue, it is not
  held by the proxy: ``SmgLike.server_queues``).
"""

from __future__ import annotations

import math
import random
from bisect import bisect_left, insort
from typing import ClassVar

from proxy.routing.options import Candidate
from proxy.routing.policies import _Baseline
from proxy.routing.policy import Choice
from proxy.routing.settings import RouterSettings


def _lcp_bytes(a: bytes, b: bytes) -> int:
    """Common prefix length in bytes (a bisection over slices, fast on long prompts)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class _PromptSet:
    """The prompts sent to one worker: the longest prefix any of them shares with a new
    one (the neighbours in sorted order hold it), and the radix tree's size in tokens."""

    def __init__(self) -> None:
        self._sorted: list[bytes] = []
        self.size = 0

    def match(self, q: bytes) -> int:
        i = bisect_left(self._sorted, q)
        best = 0
        for j in (i - 1, i):
            if 0 <= j < len(self._sorted):
                best = max(best, _lcp_bytes(self._sorted[j], q))
        return best // 4

    def insert(self, q: bytes) -> None:
        got = self.match(q)
        self.size += len(q) // 4 - got
        if got < len(q) // 4:
            insort(self._sorted, q)


class SmgLike(_Baseline):
    name = "smg_like"
    description = ("simulation baseline (loadtest only): SGLang smg cache_aware, "
                   "match ratio > 0.3 else fewest in flight, holders that spill skipped")
    server_queues: ClassVar[bool] = True  # a request with no idle slot waits in the server

    cache_threshold = 0.3
    spill_rel = 1.5
    spill_abs = 64

    def __init__(self, settings: RouterSettings, seed: int) -> None:
        super().__init__(settings, seed)
        self.trees: dict[str, _PromptSet] = {}
        self.rng = random.Random(seed)
        self.last_why = ""

    def choose(self, cands: list[Candidate], ask: object) -> Choice:
        self._q = cands[0].prompt
        return super().choose(cands, ask)  # type: ignore[arg-type]

    def pick(self, cands: list[Candidate]) -> Candidate:
        q = self._q
        trees = [self.trees.setdefault(c.name, _PromptSet()) for c in cands]
        loads = [c.state.inflight for c in cands]
        everyone = range(len(cands))
        matches = [t.match(q) for t in trees]
        best = max(matches)
        pool: list[int] = list(everyone)
        self.last_why = "miss"
        if best / max(1, len(q) // 4) > self.cache_threshold:
            fine = [k for k in everyone if not self._spills(loads[k], loads)]
            holders = [k for k in fine if matches[k] == best]
            pool, self.last_why = (holders, "match") if holders else (fine or pool, "spill")
        low = min(loads[k] for k in pool)
        i = self.rng.choice([k for k in pool if loads[k] == low])
        trees[i].insert(q)
        return cands[i]

    def _spills(self, load: int, loads: list[int]) -> bool:
        mean = sum(loads) / len(loads)
        margin = min(self.spill_abs, max(4, math.ceil(2 * math.sqrt(mean))))
        return load > self.spill_rel * mean and load > mean + margin


def register() -> None:
    """Make ``smg_like`` a policy name for the simulator's Router."""
    from proxy.routing.policies import REGISTRY

    REGISTRY.setdefault(SmgLike.name, SmgLike)
