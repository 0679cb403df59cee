"""Pure radix tree over token ids, recording which *holders* hold which prefixes.

A holder is any small hashable value naming a place where KV lives (a backend slot, one
entry of a backend's RAM prompt cache, ...). Each holder holds at most one token sequence
at a time, and holding a sequence means holding every prefix of it, so for every node the
set of holders is a superset of each child's set. One walk of a query therefore yields,
for every holder, how many leading tokens of the query it holds.

Representation (for speed and memory, see BENCHMARKS.md):
- Token sequences are handled as ``bytes`` of native 32-bit ints, compared in place by
  ``memcmp`` (see token_bytes.py beside this module: the hot path never loops over tokens
  in Python).
- Edges are compressed: a node's ``key`` is the run of tokens on the edge into it, and a
  node boundary exists wherever two held sequences diverge or one ends.
- ``max_resident`` caps the tokens stored; least recently used leaves are evicted first,
  which truncates the sequences of the holders that ended there (the tree then
  under-reports, never over-reports, what a holder has).
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Sequence
from typing import NamedTuple

from proxy.routing.tree.holders import HolderQueries
from proxy.routing.tree.node import Holder, Node
from proxy.routing.tree.token_bytes import WIDTH as _W
from proxy.routing.tree.token_bytes import common_len as _common_len
from proxy.routing.tree.token_bytes import to_token_bytes


class Match(NamedTuple):  # not a frozen dataclass: its __init__ is ~4x slower
    """Result of one walk."""

    held: dict[Holder, int]  # holder -> leading tokens of the query it holds (>0 only)
    matched: int  # longest prefix of the query held by anyone


class RadixTree(HolderQueries):
    """Radix tree of token sequences with per-holder prefix lengths. No I/O."""

    def __init__(self, max_resident: int | None = None) -> None:
        super().__init__()
        self._resident = 0
        self._nodes = 0
        self._tick = 0
        self.max_resident = max_resident
        self.evicted_tokens = 0
        self._last_common: tuple[bytes, bytes, int, int] = (b"", b"", 0, 0)

    # ------------------------------------------------------------------ queries
    @property
    def resident_tokens(self) -> int:
        return self._resident

    @property
    def node_count(self) -> int:
        return self._nodes

    def holders(self) -> list[Holder]:
        return list(self._end)

    def held_len(self, holder: Holder) -> int:
        node = self._end.get(holder)
        return 0 if node is None else node.depth

    def match(self, tokens: Sequence[int] | bytes | array) -> Match:
        """For every holder, the number of leading tokens of ``tokens`` it holds."""
        q = to_token_bytes(tokens)
        self._tick += 1
        tick = self._tick
        held: dict[Holder, int] = {}
        node = self._root
        off = 0
        n = len(q)
        matched = 0
        while off < n:
            child = node.children.get(q[off : off + _W])
            if child is None:
                break
            key = child.key
            end = off + len(key)
            child.tick = tick
            got = end if q.startswith(key, off) else off + self._common_len(key, q, off) * _W
            depth = got // _W
            for h in child.holders:
                held[h] = depth
            matched = depth
            if got < end:
                break
            off = got
            node = child
        return Match(held, matched)

    # ---------------------------------------------------------------- mutations
    def assign(self, holder: Holder, tokens: Sequence[int] | bytes | array) -> int:
        """Make ``holder`` hold exactly ``tokens`` (replacing what it held).

        Returns the tokens the holder held before that are shared with the new sequence.
        """
        q = to_token_bytes(tokens)
        if not q:
            self.drop(holder)
            return 0
        on_path: set[int] = set()
        node = self._descend(holder, q, self._root, on_path)
        old = self._end.get(holder)
        self._end[holder] = node
        if old is None:
            shared = 0
        elif id(old) in on_path:
            shared = old.depth
        else:
            shared = self._release(holder, old, stop=on_path)
        # NOTE: a holder extending its own sequence leaves a chain of equal holder sets:
        # at the new end, and at the old one when another holder's path continued it
        end = self._end[holder]
        if end.parent is not None:
            self._maybe_merge_down(end.parent)
        self._maybe_merge_down(self._end[holder])
        if old is not None and id(old) in on_path and old.parent is not None:
            self._maybe_merge_down(old)
        self._evict_if_needed()
        return shared

    def extend(self, holder: Holder, tokens: Sequence[int] | bytes | array) -> None:
        """Append ``tokens`` to what ``holder`` holds: ``assign(holder, held + tokens)``
        without walking the part it holds already (a slot's prompt + generated tokens)."""
        q = to_token_bytes(tokens)
        old = self._end.get(holder)
        if old is None:
            self.assign(holder, q)
            return
        if not q:
            return
        if not old.children and len(old.holders) == 1:
            # NOTE: the common case (a slot's prompt ends in a leaf only it holds), done
            # as _descend + _maybe_merge_down would do it, without the leaf in between
            self._tick += 1
            old.tick = self._tick
            old.key += q
            old.depth += len(q) // _W
            self._resident += len(q) // _W
            self._evict_if_needed()
            return
        end = self._descend(holder, q, old, set())
        self._end[holder] = end
        # NOTE: only ``old`` gained nothing while its child on the path gained ``holder``,
        # and a new leaf may equal its parent: the two places compression can break
        if end.parent is not None and end.parent is not old:
            self._maybe_merge_down(end.parent)
        self._maybe_merge_down(old)
        self._evict_if_needed()

    def _descend(self, holder: Holder, q: bytes, node: Node, on_path: set[int]) -> Node:
        """Add ``holder`` along ``q`` below ``node`` (splitting and adding nodes as
        needed); returns the node where ``q`` ends. Records the nodes in ``on_path``."""
        self._tick += 1
        tick = self._tick
        off = 0
        n = len(q)
        while off < n:
            first = q[off : off + _W]
            child = node.children.get(first)
            if child is None:
                leaf = Node(q[off:], node, node.depth + (n - off) // _W, tick)
                node.children[first] = leaf
                self._resident += (n - off) // _W
                self._nodes += 1
                leaf.holders.add(holder)
                on_path.add(id(leaf))
                return leaf
            key = child.key
            end = off + len(key)
            if not q.startswith(key, off):
                k = self._common_len(key, q, off)
                assert k >= 1, "a child is keyed by its first token"
                child = self._split(child, k)
                end = off + k * _W
            child.tick = tick
            child.holders.add(holder)
            on_path.add(id(child))
            node = child
            off = end
        return node

    def drop(self, holder: Holder) -> None:
        """Forget what ``holder`` holds."""
        node = self._end.pop(holder, None)
        if node is not None:
            self._release(holder, node, stop=set())

    def move(self, src: Holder, dst: Holder) -> None:
        """Relabel ``src``'s sequence as ``dst``'s (dst's previous sequence is dropped)."""
        if src == dst:
            return
        self.drop(dst)
        node = self._end.pop(src, None)
        if node is None:
            return
        self._end[dst] = node
        x: Node | None = node
        while x is not None and x is not self._root:
            x.holders.discard(src)
            x.holders.add(dst)
            x = x.parent

    def copy(self, src: Holder, dst: Holder) -> None:
        """Make ``dst`` hold the same sequence as ``src`` (dst's previous one is dropped)."""
        if src == dst:
            return
        self.drop(dst)
        node = self._end.get(src)
        if node is None:
            return
        self._end[dst] = node
        x: Node | None = node
        while x is not None and x is not self._root:
            x.holders.add(dst)
            x = x.parent

    def evict(self, limit: int) -> int:
        """Evict least recently used leaves until at most ``limit`` tokens are resident."""
        if self._resident <= limit:
            return 0
        before = self._resident
        heap: list[tuple[int, int, Node]] = []
        stack = [self._root]
        while stack:
            x = stack.pop()
            if x.children:
                stack.extend(x.children.values())
            elif x is not self._root:
                heap.append((x.tick, id(x), x))
        heapq.heapify(heap)
        while self._resident > limit and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None and not leaf.children, "only leaves are evicted"
            for h in leaf.holders:
                if self._end.get(h) is leaf:
                    if parent is self._root:
                        del self._end[h]
                    else:
                        self._end[h] = parent
            self._unlink(leaf)
            if parent is not self._root and not parent.children:
                heapq.heappush(heap, (parent.tick, id(parent), parent))
        freed = before - self._resident
        self.evicted_tokens += freed
        return freed

    # ---------------------------------------------------------------- internals
    def _common_len(self, key: bytes, q: bytes, off: int) -> int:
        """``_common_len`` remembering its last answer: a router walks the same prompt
        twice, ``match`` then ``assign``, and both bisect the edge where it diverges.
        Keys and prompts are immutable, so the same objects give the same answer."""
        k, p, o, got = self._last_common
        if k is key and p is q and o == off:
            return got
        got = _common_len(key, q, off)
        self._last_common = (key, q, off, got)
        return got

    def _evict_if_needed(self) -> None:
        if self.max_resident is not None and self._resident > self.max_resident:
            self.evict(self.max_resident)

    def _split(self, child: Node, k: int) -> Node:
        """Cut ``child``'s edge after ``k`` tokens; returns the new upper node."""
        parent = child.parent
        assert parent is not None and 0 < k * _W < len(child.key), "split inside the edge"
        mid = Node(child.key[: k * _W], parent, parent.depth + k, child.tick)
        mid.holders = set(child.holders)
        child.key = child.key[k * _W :]
        child.parent = mid
        mid.children[child.key[:_W]] = child
        parent.children[mid.key[:_W]] = mid
        self._nodes += 1
        return mid

    def _unlink(self, node: Node) -> None:
        parent = node.parent
        assert parent is not None, "root is never unlinked"
        del parent.children[node.key[:_W]]
        node.parent = None
        self._resident -= len(node.key) // _W
        self._nodes -= 1

    def _release(self, holder: Holder, node: Node, stop: set[int]) -> int:
        """Remove ``holder`` from ``node`` up to (excluding) the first node in ``stop``.

        Prunes nodes nobody holds any more and re-compresses edges. Returns the depth of
        the first kept node, i.e. what the holder still holds there.
        """
        x: Node | None = node
        while x is not None and x is not self._root and id(x) not in stop:
            x.holders.discard(holder)
            parent = x.parent
            if not x.holders:
                # children hold subsets of x's holders, so x has none left either
                assert not x.children, "an unheld node has no held children"
                self._unlink(x)
            else:
                self._maybe_merge_down(x)
            x = parent
        if x is None:
            return 0
        kept = x.depth
        if x is not self._root:
            self._maybe_merge_down(x)
        return kept

    def _maybe_merge_down(self, node: Node) -> None:
        """Merge ``node`` with its only child when both have the same holders."""
        if node is self._root or len(node.children) != 1:
            return
        (child,) = node.children.values()
        if child.holders != node.holders:
            return
        for h in child.holders:
            if self._end.get(h) is child:
                self._end[h] = node
        node.key = node.key + child.key
        node.depth = child.depth
        node.tick = max(node.tick, child.tick)
        node.children = child.children
        for gc in node.children.values():
            gc.parent = node
        child.parent = None
        self._nodes -= 1

    def check(self, compressed: bool = True) -> None:
        """Verify the invariants (tests): holder closure, compression, counters."""
        resident = 0
        nodes = 0
        stack = [self._root]
        while stack:
            x = stack.pop()
            for first, c in x.children.items():
                assert c.parent is x, "parent pointer"
                assert c.key[:_W] == first and c.key, "child keyed by first token"
                assert c.depth == x.depth + len(c.key) // _W, "depth"
                assert c.holders, "every node is held"
                assert x is self._root or c.holders <= x.holders, "holder closure"
                if compressed and len(c.children) == 1:
                    (gc,) = c.children.values()
                    assert gc.holders != c.holders, "edges are compressed"
                resident += len(c.key) // _W
                nodes += 1
                stack.append(c)
        assert resident == self._resident, "resident counter"
        assert nodes == self._nodes, "node counter"
        for h, node in self._end.items():
            assert h in node.holders, "end node holds its holder"
            assert all(h not in c.holders for c in node.children.values()), "end is deepest"
