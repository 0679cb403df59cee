"""The prompts of the requests queued on one backend, indexed by prefix, and the search
for the one that reuses the most of what an idle slot or a RAM entry holds.

Queued prompts are no KV: they live apart from the cache's RadixTree, so that its walks
(every decision's match, every prediction's look at what else holds a sequence) cost the
same however long the queue is. Here a freed slot asks the opposite question: of the
waiters, which share the most with a given sequence? :class:`WaiterTree` answers it
lazily, most shared first and oldest first among equals, without visiting the waiters
that share less; :func:`most_reuse` merges those answers over every sequence a waiter
could reuse and stops as soon as no waiter left can beat the best one found.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator

from sortedcontainers import SortedList

from proxy.routing.tree.token_bytes import WIDTH as _W
from proxy.routing.tree.token_bytes import common_len


class _Node:
    """One edge; ``rids``: the waiters whose prompt runs through its end, oldest first."""

    __slots__ = ("children", "depth", "key", "parent", "rids")

    def __init__(self, key: bytes, parent: _Node | None, depth: int,
                 rids: SortedList[int] | None = None) -> None:
        self.key = key  # tokens on the edge into this node (int32 bytes)
        self.children: dict[bytes, _Node] = {}  # first token (4 bytes) -> child
        self.parent = parent
        self.depth = depth  # tokens from the root to the end of this edge
        self.rids: SortedList[int] = rids if rids is not None else SortedList()


class WaiterTree:
    """Radix tree of queued prompts, each node knowing the waiters below it in id order
    (ids grow with arrival, so the first is the oldest). No I/O."""

    def __init__(self) -> None:
        self._root = _Node(b"", None, 0)
        self._prompt: dict[int, bytes] = {}
        self._rids: SortedList[int] = SortedList()

    def __len__(self) -> int:
        return len(self._prompt)

    def __contains__(self, rid: object) -> bool:
        return rid in self._prompt

    def oldest(self) -> int | None:
        return self._rids[0] if self._rids else None

    def prompt(self, rid: int) -> bytes:
        return self._prompt[rid]

    def add(self, rid: int, prompt: bytes) -> None:
        """Queue ``rid`` with ``prompt`` (int32 token bytes), replacing its old one."""
        if rid in self._prompt:
            self.remove(rid)
        self._prompt[rid] = prompt
        self._rids.add(rid)
        node, off, n = self._root, 0, len(prompt)
        while off < n:
            child = node.children.get(prompt[off:off + _W])
            if child is None:
                child = _Node(prompt[off:], node, node.depth + (n - off) // _W)
                node.children[prompt[off:off + _W]] = child
            elif not prompt.startswith(child.key, off):
                child = self._split(child, common_len(child.key, prompt, off))
            child.rids.add(rid)
            off += len(child.key)
            node = child

    def remove(self, rid: int) -> None:
        prompt = self._prompt.pop(rid, None)
        if prompt is None:
            return
        self._rids.remove(rid)
        path = [node for node, _ in self.walk(prompt)]
        for node in path:
            node.rids.remove(rid)
        for node in reversed(path):  # deepest first: a node's children go before it
            if not node.rids:
                assert node.parent is not None and not node.children, "an empty leaf"
                del node.parent.children[node.key[:_W]]
                node.parent = None
            else:
                self._merge_down(node)

    def walk(self, seq: bytes) -> list[tuple[_Node, int]]:
        """The nodes along ``seq``'s path, each with the tokens of ``seq`` its waiters
        share at least (all of its edge, or where ``seq`` leaves it)."""
        path: list[tuple[_Node, int]] = []
        node, off, n = self._root, 0, len(seq)
        while off < n:
            child = node.children.get(seq[off:off + _W])
            if child is None:
                break
            if not seq.startswith(child.key, off):
                path.append((child, node.depth + common_len(child.key, seq, off)))
                break
            path.append((child, child.depth))
            off += len(child.key)
            node = child
        return path

    def sharing(self, seq: bytes) -> Iterator[tuple[int, int]]:
        """(tokens shared with ``seq``, waiter) of every waiter sharing any, most shared
        first, then oldest first. Lazy: the waiters of a node are listed only once the
        ones sharing more are, and each of those is skipped over once at most."""
        below: SortedList[int] | None = None
        for node, shared in reversed(self.walk(seq)):
            for rid in node.rids:
                if below is None or rid not in below:
                    yield shared, rid
            below = node.rids

    def _split(self, child: _Node, k: int) -> _Node:
        """Cut ``child``'s edge after ``k`` tokens; returns the new upper node."""
        parent = child.parent
        assert parent is not None and 0 < k * _W < len(child.key), "split inside the edge"
        mid = _Node(child.key[:k * _W], parent, parent.depth + k, child.rids.copy())
        child.key = child.key[k * _W:]
        child.parent = mid
        mid.children[child.key[:_W]] = child
        parent.children[mid.key[:_W]] = mid
        return mid

    @staticmethod
    def _merge_down(node: _Node) -> None:
        """Merge ``node`` with its only child when no waiter's prompt ends at ``node``
        (the child then has all of its waiters)."""
        if len(node.children) != 1:
            return
        (child,) = node.children.values()
        if len(child.rids) != len(node.rids):
            return
        node.key += child.key
        node.depth = child.depth
        node.children = child.children
        for gc in node.children.values():
            gc.parent = node
        child.parent = None

    def check(self) -> None:
        """Verify the invariants (tests): each prompt's path, id sets, compression."""
        for rid, prompt in self._prompt.items():
            path = self.walk(prompt)
            assert not prompt or path[-1][1] == len(prompt) // _W, "a prompt's whole path"
            assert all(rid in node.rids for node, _ in path), "on every node of its path"
        stack = [self._root]
        while stack:
            x = stack.pop()
            for first, c in x.children.items():
                assert c.parent is x and c.key[:_W] == first, "linked by first token"
                assert c.depth == x.depth + len(c.key) // _W, "depth"
                assert c.rids and (x is self._root or set(c.rids) <= set(x.rids)), "closure"
                ends = set(c.rids) - {r for g in c.children.values() for r in g.rids}
                assert ends or len(c.children) != 1, "edges are compressed"
                stack.append(c)


def most_reuse(streams: Iterable[tuple[int, Iterator[tuple[int, int]]]],
               cap: Callable[[int, int], int], reuse: Callable[[int], int],
               at_least: int) -> int | None:
    """The waiter of greatest ``reuse`` (the oldest, smallest id, of equals), among
    those reusing at least ``at_least`` (>= 1); None if none does.

    ``streams``: per sequence a waiter could reuse (an idle slot's, a RAM entry's), its
    length and ``WaiterTree.sharing`` of it, longest first; all lazy: a sequence is
    read only if a waiter could share enough with it. A waiter never reuses more than
    it shares with one of them, nor more than ``cap(rid, shared)`` (its prompt less one
    token, say). ``reuse`` is exact and costly: it runs only on waiters that could
    still beat the best one."""
    # entries: (-bound, waiter, stream); the waiter -1 for a stream not opened yet (the
    # next one's entry is pushed as it opens), the stream -1 for a waiter ranked by its cap
    heap: list[tuple[int, int, int]] = []
    sources = iter(streams)
    opened: list[Iterator[tuple[int, int]]] = []

    def queue_next() -> None:
        got = next(sources, None)
        if got is not None:
            opened.append(got[1])
            heapq.heappush(heap, (-got[0], -1, len(opened) - 1))

    def advance(i: int) -> None:
        got = next(opened[i], None)
        if got is not None:
            heapq.heappush(heap, (-got[0], got[1], i))

    queue_next()
    best, most = -1, at_least - 1  # (-1: none yet; ids are >= 0)
    seen: set[int] = set()
    while heap:
        bound, rid, i = heap[0]
        bound = -bound
        if bound < most or (bound == most and rid > best):
            break
        heapq.heappop(heap)
        if i >= 0:
            if rid < 0:
                queue_next()
            advance(i)
            if rid < 0 or rid in seen:
                continue
            seen.add(rid)
            capped = cap(rid, bound)
            if capped < bound:  # ranked again by what it can reuse at most
                heapq.heappush(heap, (-capped, rid, -1))
                continue
        got = reuse(rid)
        if got > most or (got == most and rid < best):
            best, most = rid, got
    return best if best >= 0 else None
