"""Read-only queries relating one holder's sequence to the others' in a RadixTree.

What the backend cache model asks before it moves KV around: which holders contain or
are prefixes of a sequence, what two holders share, what nobody else keeps. Each is one
walk up the parent pointers from a holder's end node (holder sets only grow towards the
root). The base class of :class:`~proxy.routing.tree.radix.RadixTree`, not a wrapper:
these run for every prediction and an extra call level would cost on the router's hot
path.
"""

from __future__ import annotations

from collections.abc import Callable

from proxy.routing.tree.node import Holder, Node


class HolderQueries:
    """Holder relations over ``_end`` (holder -> deepest node it holds) and ``_root``,
    which it owns; the tree (its subclass) grows and prunes them."""

    def __init__(self) -> None:
        self._root = Node(b"", None, 0, 0)
        self._end: dict[Holder, Node] = {}  # holder -> deepest node it holds

    def common_prefix(self, a: Holder, b: Holder) -> int:
        """Length of the common prefix of two holders' sequences (depth of their LCA)."""
        x, y = self._end.get(a), self._end.get(b)
        if x is None or y is None:
            return 0
        # Depth grows strictly down a path (every edge has a token), so the deeper of two
        # distinct nodes is not an ancestor of the other: step it up until they meet.
        while x is not y:
            if x.depth >= y.depth:
                x = x.parent  # type: ignore[assignment]
            else:
                y = y.parent  # type: ignore[assignment]
        return x.depth

    def relations(self, holder: Holder) -> tuple[set[Holder], list[Holder]]:
        """Holders whose sequence contains ``holder``'s, and holders whose sequence is a
        prefix of it (a holder with an equal sequence is in both). One walk to the root."""
        node = self._end.get(holder)
        if node is None:
            return set(), []
        containing = set(node.holders)
        prefixes: list[Holder] = []
        end = self._end
        x: Node | None = node
        root = self._root
        while x is not None and x is not root:
            for h in x.holders:
                if end.get(h) is x:
                    prefixes.append(h)
            x = x.parent
        return containing, prefixes

    def shared_len(self, holder: Holder, ignore: Callable[[Holder], bool] | None = None) -> int:
        """Leading tokens of ``holder``'s sequence that some other holder holds too (not
        counting holders for which ``ignore`` is true). One walk up from its end node.

        Holder sets only grow towards the root, so the first node on the way up with
        another (counted) holder is the deepest such node: its depth is the answer."""
        x = self._end.get(holder)
        root = self._root
        while x is not None and x is not root:
            hs = x.holders
            if len(hs) > 1:
                if ignore is None:
                    return x.depth
                for h in hs:
                    if h != holder and not ignore(h):
                        return x.depth
            x = x.parent
        return 0

    def tokens_of(self, holder: Holder) -> bytes:
        """The sequence a holder holds, as int32 bytes."""
        parts: list[bytes] = []
        node = self._end.get(holder)
        while node is not None:
            parts.append(node.key)
            node = node.parent
        return b"".join(reversed(parts))
