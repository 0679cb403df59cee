"""Radix tree: table-driven cases and a property test against a brute-force reference."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from proxy.routing.tree.radix import RadixTree
from proxy.routing.tree.token_bytes import from_token_bytes, to_token_bytes


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def build(seqs: dict[str, list[int]]) -> RadixTree:
    t = RadixTree()
    for h, s in seqs.items():
        t.assign(h, s)
    t.check()
    return t


@pytest.mark.parametrize(
    ("seqs", "query", "want", "nodes"),
    [
        # empty tree
        ({}, [1, 2, 3], {}, 0),
        # one holder, exact, longer and shorter queries
        ({"a": [1, 2, 3]}, [1, 2, 3], {"a": 3}, 1),
        ({"a": [1, 2, 3]}, [1, 2, 3, 4], {"a": 3}, 1),
        ({"a": [1, 2, 3]}, [1, 2], {"a": 2}, 1),
        ({"a": [1, 2, 3]}, [2, 2], {}, 1),
        # divergence splits the edge: [1,2] + {[3], [9]}
        ({"a": [1, 2, 3], "b": [1, 2, 9]}, [1, 2, 3], {"a": 3, "b": 2}, 3),
        # one sequence a prefix of the other: split where the shorter ends
        ({"a": [1, 2, 3, 4], "b": [1, 2]}, [1, 2, 3, 4], {"a": 4, "b": 2}, 2),
        ({"a": [1, 2, 3, 4], "b": [1, 2]}, [1, 2, 7], {"a": 2, "b": 2}, 2),
        # same sequence, two holders: one node
        ({"a": [5, 6], "b": [5, 6]}, [5, 6, 7], {"a": 2, "b": 2}, 1),
        # negative and large token ids
        ({"a": [-1, 2**31 - 1]}, [-1, 2**31 - 1], {"a": 2}, 1),
    ],
)
def test_match_table(
    seqs: dict[str, list[int]], query: list[int], want: dict[str, int], nodes: int
) -> None:
    t = build(seqs)
    m = t.match(query)
    assert m.held == want
    assert m.matched == max(want.values(), default=0)
    assert t.node_count == nodes


def test_reassign_extends_and_recompresses() -> None:
    t = build({"a": [1, 2, 3], "b": [1, 2, 9]})
    assert t.node_count == 3
    t.drop("b")  # [1,2] and [3] are held by a alone: merged back into one edge
    t.check()
    assert t.node_count == 1
    assert t.assign("a", [1, 2, 3, 4, 5]) == 3  # extension keeps the old 3 tokens
    t.check()
    assert t.node_count == 1
    assert t.assign("a", [1, 7]) == 1
    t.check()
    assert from_token_bytes(t.tokens_of("a")) == [1, 7]
    assert t.resident_tokens == 2


def test_move_relabels_and_replaces_destination() -> None:
    t = build({"slot0": [1, 2, 3], "ram1": [4, 5]})
    t.move("slot0", "ram1")
    t.check()
    assert t.match([1, 2, 3]).held == {"ram1": 3}
    assert t.match([4, 5]).held == {}
    assert t.held_len("slot0") == 0
    assert t.resident_tokens == 3


@pytest.mark.parametrize(
    ("seqs", "src", "dst", "want_src", "want_dst", "nodes"),
    [
        # copy to a new holder: same path, no new nodes
        ({"slot0": [1, 2, 3]}, "slot0", "ram0", 3, 3, 1),
        # copy over a holder with other content: its old branch is pruned
        ({"slot0": [1, 2, 3], "ram0": [1, 9, 9]}, "slot0", "ram0", 3, 3, 1),
        # copy over a longer holder sharing the path: the edge is re-compressed
        ({"slot0": [1, 2], "ram0": [1, 2, 3, 4]}, "slot0", "ram0", 2, 2, 1),
        # copying from a holder that holds nothing drops the destination
        ({"ram0": [5, 6]}, "slot0", "ram0", 0, 0, 0),
        # copying onto itself is a no-op
        ({"slot0": [1, 2, 3]}, "slot0", "slot0", 3, 3, 1),
    ],
)
def test_copy_table(
    seqs: dict[str, list[int]], src: str, dst: str, want_src: int, want_dst: int, nodes: int
) -> None:
    t = build(seqs)
    before = seqs.get(src, [])
    t.copy(src, dst)
    t.check()
    assert (t.held_len(src), t.held_len(dst), t.node_count) == (want_src, want_dst, nodes)
    if want_dst:
        assert from_token_bytes(t.tokens_of(dst)) == before
    if src != dst:
        t.assign(src, [7])  # the copy is independent of its source afterwards
        t.check()
        assert t.held_len(dst) == want_dst


def test_common_prefix() -> None:
    t = build({"a": [1, 2, 3, 4], "b": [1, 2, 9], "c": [7]})
    assert t.common_prefix("a", "b") == 2
    assert t.common_prefix("a", "a") == 4
    assert t.common_prefix("a", "c") == 0
    assert t.common_prefix("a", "zz") == 0


@pytest.mark.parametrize(
    ("seqs", "holder", "ignore", "want"),
    [
        ({"a": [1, 2, 3, 4]}, "a", (), 0),  # alone: nothing of it is held elsewhere
        ({"a": [1, 2, 3, 4], "b": [1, 2, 9]}, "a", (), 2),  # shared stem
        ({"a": [1, 2, 3, 4], "b": [1, 2, 3, 4, 5]}, "a", (), 4),  # b contains a
        ({"a": [1, 2, 3, 4], "b": [1, 2, 3, 4]}, "a", (), 4),  # equal copies
        ({"a": [1, 2, 3, 4], "b": [1, 2]}, "a", (), 2),  # b is a prefix of a
        ({"a": [1, 2, 3, 4], "b": [1, 2, 3], "c": [1]}, "a", ("b",), 1),  # b ignored
        ({"a": [1, 2, 3, 4], "b": [1, 2, 3]}, "a", ("b",), 0),
        ({"a": [1, 2]}, "zz", (), 0),  # unknown holder
    ],
)
def test_shared_len_table(
    seqs: dict[str, list[int]], holder: str, ignore: tuple[str, ...], want: int
) -> None:
    t = build(seqs)
    got = t.shared_len(holder, (lambda h: h in ignore) if ignore else None)
    assert got == want


def test_lru_eviction_truncates_least_recent_leaf() -> None:
    t = RadixTree(max_resident=9)
    t.assign("a", [1, 2, 3, 4])  # shared stem [1,2] after b
    t.assign("b", [1, 2, 5, 6])
    t.match([1, 2, 3, 4])  # a's leaf is now more recent than b's
    t.assign("c", [9, 9, 9, 9])  # 2 + 2 + 2 + 4 = 10 > 9: b's leaf goes
    t.check(compressed=False)
    assert t.resident_tokens <= 9
    assert t.held_len("b") == 2  # truncated to the shared stem, never over-reported
    assert t.held_len("a") == 4
    assert t.held_len("c") == 4
    assert t.evicted_tokens == 2


def test_evict_drops_holder_whose_path_is_gone() -> None:
    t = build({"a": [1, 2], "b": [3, 4]})
    t.match([3, 4])
    t.evict(2)
    assert t.holders() == ["b"]
    assert t.held_len("a") == 0


def test_token_bytes_roundtrip() -> None:
    assert from_token_bytes(to_token_bytes([0, -5, 151935])) == [0, -5, 151935]


# ---------------------------------------------------------------- property test
tokens = st.lists(st.integers(0, 3), min_size=0, max_size=12)
op = st.one_of(
    st.tuples(st.just("assign"), st.integers(0, 4), tokens),
    st.tuples(st.just("drop"), st.integers(0, 4), tokens),
    st.tuples(st.just("move"), st.integers(0, 4), st.integers(0, 4)),
    st.tuples(st.just("copy"), st.integers(0, 4), st.integers(0, 4)),
    st.tuples(st.just("extend"), st.integers(0, 4), tokens),
    st.tuples(st.just("match"), st.integers(0, 4), tokens),
)


@settings(max_examples=500, deadline=None)
@given(st.lists(op, max_size=40), st.lists(tokens, min_size=1, max_size=5))
# a holder re-assigned past where another holder's path continued its old end
@example([("assign", 0, [0]), ("assign", 1, [0, 0]), ("assign", 0, [0, 0, 0])], [[0]])
def test_against_brute_force(ops: list[tuple[object, ...]], queries: list[list[int]]) -> None:
    t = RadixTree()
    ref: dict[int, list[int]] = {}
    for kind, a, b in ops:
        if kind == "assign":
            assert isinstance(a, int) and isinstance(b, list)
            shared = t.assign(a, b)
            if b:
                assert shared == (lcp(ref[a], b) if a in ref else 0)
                ref[a] = list(b)
            else:
                ref.pop(a, None)
        elif kind == "drop":
            assert isinstance(a, int)
            t.drop(a)
            ref.pop(a, None)
        elif kind == "move":
            assert isinstance(a, int) and isinstance(b, int)
            t.move(a, b)
            if a != b:
                ref.pop(b, None)
                if a in ref:
                    ref[b] = ref.pop(a)
        elif kind == "extend":
            assert isinstance(a, int) and isinstance(b, list)
            t.extend(a, b)
            if a in ref or b:
                ref[a] = ref.get(a, []) + b
        elif kind == "copy":
            assert isinstance(a, int) and isinstance(b, int)
            t.copy(a, b)
            if a != b:
                ref.pop(b, None)
                if a in ref:
                    ref[b] = list(ref[a])
        else:
            assert isinstance(b, list)
            queries.append(b)
        t.check()
    for q in queries:
        want = {h: lcp(s, q) for h, s in ref.items() if lcp(s, q) > 0}
        assert t.match(q).held == want
    for h, s in ref.items():
        assert from_token_bytes(t.tokens_of(h)) == s
        for h2, s2 in ref.items():
            assert t.common_prefix(h, h2) == lcp(s, s2)
        others = [lcp(s, s2) for h2, s2 in ref.items() if h2 != h]
        assert t.shared_len(h) == max(others, default=0)
    assert t.resident_tokens <= sum(len(s) for s in ref.values())


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), tokens), max_size=30), st.integers(0, 20))
def test_eviction_never_over_reports(assigns: list[tuple[int, list[int]]], cap: int) -> None:
    t = RadixTree(max_resident=cap)
    ref: dict[int, list[int]] = {}
    for h, s in assigns:
        t.assign(h, s)
        if s:
            ref[h] = s
        else:
            ref.pop(h, None)
        t.check(compressed=False)
        assert t.resident_tokens <= cap
        for holder in t.holders():
            got = from_token_bytes(t.tokens_of(holder))
            assert isinstance(holder, int) and ref[holder][: len(got)] == got
