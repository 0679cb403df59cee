"""``smg_like``: a simulation baseline after SGLang's router ``smg --policy cache_aware``.

For the simulator only (loadtest/simulate.py registers it when asked for it; the proxy
never offers it). What it models of smg 1.13.0's cache_aware policy
(../shared/notes/peers.md):

- an approximate tree of the request prompts each worker was sent (here over tokens, not
  characters; no eviction: smg's tree holds ~2^26 characters, more than a replay sends);
- load = requests in flight per worker. Imbalanced when max - min > ``balance_abs`` (64)
  and max > min x ``balance_rel`` (1.5): then the shortest queue;
- else, if the best match ratio (matched tokens / prompt tokens) > ``cache_threshold``
  (0.5), the worker with the best match; else the worker with the smallest tree;
- the prompt goes into the chosen worker's tree either way;
- requests are sent unpinned: the server picks the slot, or queues the request FIFO
  (the simulator sends a queued ``smg_like`` request to the server's queue, it is not
  held by the proxy: ``SmgLike.server_queues``).
"""

from __future__ import annotations

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
                   "match ratio > 0.5 else smallest tree, shortest queue if imbalanced")
    server_queues: ClassVar[bool] = True  # a request with no idle slot waits in the server

    cache_threshold = 0.5
    balance_abs = 64
    balance_rel = 1.5

    def __init__(self, settings: RouterSettings, seed: int) -> None:
        super().__init__(settings, seed)
        self.trees: dict[str, _PromptSet] = {}
        self.last_why = ""

    def choose(self, cands: list[Candidate], ask: object) -> Choice:
        self._q = cands[0].prompt
        return super().choose(cands, ask)  # type: ignore[arg-type]

    def pick(self, cands: list[Candidate]) -> Candidate:
        q = self._q
        trees = [self.trees.setdefault(c.name, _PromptSet()) for c in cands]
        loads = [c.state.inflight for c in cands]
        hi, lo = max(loads), min(loads)
        if hi - lo > self.balance_abs and hi > lo * self.balance_rel:
            i = loads.index(lo)
            self.last_why = "imbalanced"
        else:
            n = max(1, len(q) // 4)
            matches = [t.match(q) for t in trees]
            best = max(range(len(cands)), key=lambda k: (matches[k], -trees[k].size))
            if matches[best] / n > self.cache_threshold:
                i = best
                self.last_why = "match"
            else:
                i = min(range(len(cands)), key=lambda k: (trees[k].size, k))
                self.last_why = "smallest tree"
        trees[i].insert(q)
        return cands[i]


def register() -> None:
    """Make ``smg_like`` a policy name for the simulator's Router."""
    from proxy.routing.policies import REGISTRY

    REGISTRY.setdefault(SmgLike.name, SmgLike)
