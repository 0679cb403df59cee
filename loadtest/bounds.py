"""What any router could reuse on a trace: with an unbounded cache (the oracle) and with
the memory the servers really have (a clairvoyant estimate, and one under the servers'
own least-recently-used eviction).

Both read each request as its sequence of block ids (the trace's hash ids) in arrival
order. The oracle says how much of the prompts was ever seen before: no router can reuse
more. The capacity estimate says how much of that a fleet with these slots and this much
host RAM keeps when it evicts, knowing the future, what is needed furthest ahead: a
reference for what memory allows, not a bound either way (it pools the backends and
ignores concurrency, which flatters it; evicting whole sequences by Belady's rule can keep
one that another already covers, which does not: two single-slot servers can reuse 6
tokens of `(1,2) (3,4,5) (1,6) (1,6,7) (3,4,5,8,9) (10,11,12)` where it finds 3). The
LRU estimate keeps what the servers keep instead: where it lies below the capacity
estimate, memory would allow more than the servers' eviction lets any router reach.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import NamedTuple

from loadtest.trace import BLOCK, TraceRequest


def oracle_hit_ratio(trace: Sequence[TraceRequest], block: int = BLOCK) -> float:
    """Unbounded cache, perfect routing: reuse = longest prefix seen before (<= n - 1)."""
    seen: dict[int, int] = {}  # chained block id -> tokens of it seen so far
    reused = total = 0
    for r in trace:
        got = 0
        for i, h in enumerate(r.hash_ids):
            in_req = min(block, r.input_length - i * block)
            have = seen.get(h, 0)
            got += min(have, in_req)
            if have < in_req:
                break
        for i, h in enumerate(r.hash_ids):
            in_req = min(block, r.input_length - i * block)
            if seen.get(h, 0) < in_req:
                seen[h] = in_req
        reused += min(got, r.input_length - 1)
        total += r.input_length
    return reused / total if total else 0.0


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class _Future:
    """When each sequence is next needed: the first later request that reuses at least
    half of it (keeping it pays again then), and how much it reuses; ``len(seqs)`` when
    none does. Sooner first, then more."""

    def __init__(self, seqs: Sequence[Sequence[int]]) -> None:
        self._seqs = seqs
        self._by_head: dict[int, list[int]] = defaultdict(list)
        for i, s in enumerate(seqs):
            if s:
                self._by_head[s[0]].append(i)

    def next_use(self, blocks: Sequence[int], after: int) -> tuple[int, int]:
        later = self._by_head.get(blocks[0], []) if blocks else []
        need = max(1, len(blocks) // 2)
        for u in later[bisect_right(later, after):]:
            if (m := _common(blocks, self._seqs[u])) >= need:
                return u, -m
        return len(self._seqs), 0


def capacity_estimate(seqs: Sequence[Sequence[int]], *, unit_tokens: float, slots: int,
                      ram_tokens: float) -> float:
    """Reused / prompt tokens when each request goes where its longest cached prefix is
    and the fleet keeps, with foresight, what is reused soonest: ``slots`` sequences whole
    (a slot holds one, whatever its length) and more while they fit in ``ram_tokens`` of
    host RAM. Each block counts ``unit_tokens``.

    Generous in its setting (one pool, no concurrency, free moves between slots and
    RAM), greedy in its choices: see the module's note on why it bounds nothing.
    """
    future = _Future(seqs)

    def evict(held: dict[int, Sequence[int]], used: dict[int, int], t: int) -> None:
        while _ram_blocks(held, slots) * unit_tokens > ram_tokens:
            del held[max(held, key=lambda k: future.next_use(held[k], t))]

    return _replay(seqs, unit_tokens, evict)


def lru_estimate(seqs: Sequence[Sequence[int]], *, unit_tokens: float, slots: int,
                 ram_tokens: float) -> float:
    """As `capacity_estimate`, but keeping what the servers keep: the ``slots``
    sequences used last in the slots, then in RAM those used before, the least recently
    used dropped first while they do not fit. What perfect routing reuses where the
    servers' eviction decides what stays."""

    def evict(held: dict[int, Sequence[int]], used: dict[int, int], t: int) -> None:
        by_use = sorted(held, key=used.__getitem__)
        in_ram = by_use[:max(0, len(by_use) - slots)]
        size = sum(len(held[k]) for k in in_ram) * unit_tokens
        for k in in_ram:
            if size <= ram_tokens:
                break
            size -= len(held.pop(k)) * unit_tokens

    return _replay(seqs, unit_tokens, evict)


Evict = Callable[[dict[int, Sequence[int]], dict[int, int], int], None]


def _replay(seqs: Sequence[Sequence[int]], unit_tokens: float, evict: Evict) -> float:
    """Each request reuses its longest prefix held (a sequence it extends whole is
    replaced by it), then ``evict`` trims what is held (request index -> its blocks;
    ``used``: when each was last used)."""
    held: dict[int, Sequence[int]] = {}
    used: dict[int, int] = {}
    reused = total = 0.0
    for t, s in enumerate(seqs):
        best, src = 0, -1
        for k, c in held.items():
            m = _common(c, s)
            if m > best:
                best, src = m, k
        n_tokens = len(s) * unit_tokens
        reused += min(best * unit_tokens, n_tokens - 1)
        total += n_tokens
        if src >= 0:
            used[src] = t
            if best == len(held[src]):
                del held[src]  # the conversation grows in place
        held[t], used[t] = s, t
        evict(held, used, t)
    return reused / total if total else 0.0


def _ram_blocks(held: dict[int, Sequence[int]], slots: int) -> int:
    """Blocks that do not fit in the slots: the longest sequences take the slots."""
    sizes = sorted((len(c) for c in held.values()), reverse=True)
    return sum(sizes[slots:])


class Bounds(NamedTuple):
    """A run's references: what its fleet's memory allows, with foresight and under the
    servers' own eviction."""

    capacity: float
    lru: float


def run_estimate(blocks: dict[str, tuple[int, ...]], sent: Sequence[tuple[str, int | None]], *,
                 slots: int, ram_tokens: float) -> Bounds | None:
    """The estimates of a run: ``blocks`` (request id -> block ids, in arrival order) and
    ``sent`` (request id, prompt tokens the backend counted) give the tokens per block as
    measured; None when nothing was measured."""
    counted = [(blocks[i], n) for i, n in sent if i in blocks and n]
    n_blocks = sum(len(b) for b, _ in counted)
    if not n_blocks:
        return None
    seqs, unit = list(blocks.values()), sum(n for _, n in counted) / n_blocks
    return Bounds(
        capacity_estimate(seqs, slots=slots, ram_tokens=ram_tokens, unit_tokens=unit),
        lru_estimate(seqs, slots=slots, ram_tokens=ram_tokens, unit_tokens=unit))
