"""A radix tree node and what a holder is: shared by the tree and its holder queries."""

from __future__ import annotations

from collections.abc import Hashable

Holder = Hashable


class Node:
    """One edge of the tree and the holders that hold the sequence up to its end."""

    __slots__ = ("children", "depth", "holders", "key", "parent", "tick")

    def __init__(self, key: bytes, parent: Node | None, depth: int, tick: int) -> None:
        self.key = key  # tokens on the edge into this node (int32 bytes)
        self.children: dict[bytes, Node] = {}  # first token (4 bytes) -> child
        self.parent = parent
        self.holders: set[Holder] = set()
        self.depth = depth  # tokens from the root to the end of this edge
        self.tick = tick  # last access, for LRU eviction
