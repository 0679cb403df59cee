"""What any router could reuse on a trace: with an unbounded cache (the oracle) and with
the memory the servers really have (a clairvoyant estimate).

Both read each request as its sequence of block ids (the trace's hash ids) in arrival
order. The oracle says how much of the prompts was ever seen before: no router can reuse
more. The capacity estimate says how much of that a fleet with these slots and this much
host RAM keeps when it evicts, knowing the future, what is needed furthest ahead: a
reference for what memory allows, not a bound either way (it pools the backends and
ignores concurrency, which flatters it; evicting whole sequences by Belady's rule can keep
one that another already covers, which does not: two single-slot servers can reuse 6
tokens of `(1,2) (3,4,5) (1,6) (1,6,7) (3,4,5,8,9) (10,11,12)` where it finds 3).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from collections.abc import Sequence

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
    held: dict[int, Sequence[int]] = {}  # request index -> its blocks
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
        if src >= 0 and best == len(held[src]):
            del held[src]  # the conversation grows in place
        held[t] = s
        while _ram_blocks(held, slots) * unit_tokens > ram_tokens:
            del held[max(held, key=lambda k: future.next_use(held[k], t))]
    return reused / total if total else 0.0


def _ram_blocks(held: dict[int, Sequence[int]], slots: int) -> int:
    """Blocks that do not fit in the slots: the longest sequences take the slots."""
    sizes = sorted((len(c) for c in held.values()), reverse=True)
    return sum(sizes[slots:])


def run_estimate(blocks: dict[str, tuple[int, ...]], sent: Sequence[tuple[str, int | None]], *,
              slots: int, ram_tokens: float) -> float | None:
    """The capacity estimate of a run: ``blocks`` (request id -> block ids, in arrival order)
    and ``sent`` (request id, prompt tokens the backend counted) give the tokens per block
    as measured; None when nothing was measured."""
    counted = [(blocks[i], n) for i, n in sent if i in blocks and n]
    n_blocks = sum(len(b) for b, _ in counted)
    if not n_blocks:
        return None
    return capacity_estimate(list(blocks.values()), slots=slots, ram_tokens=ram_tokens,
                          unit_tokens=sum(n for _, n in counted) / n_blocks)
