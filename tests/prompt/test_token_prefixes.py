"""PrefixMemory.find (the tokenizer's "resume from a remembered prompt" search) against a
brute-force reference: same prompt, same cut, whatever the pruning shortcuts skip."""

from __future__ import annotations

from array import array

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.prompt.prefixes import (
    MIN_CHARS,
    PARTIAL_MIN_CHARS,
    PARTIAL_SEARCH,
    Prefix,
    PrefixMemory,
)

# Every text starts with the same long head so the partial search applies (it is skipped
# for short prompts); "|" plays the special token that ends a cut.
PAD = "p" * PARTIAL_MIN_CHARS
_SEGMENTS = st.lists(st.sampled_from(["a", "b", "ab", "|", "a|", "b|", "ab|"]), max_size=12)


def _prefix(text: str) -> Prefix:
    core = text[:text.rfind("|") + 1]
    ends = [i + 1 for i, c in enumerate(core) if c == "|"]
    return Prefix(core=core, ends=ends, counts=list(range(1, len(ends) + 1)),
                  tokens=array("i"))


def _reference(remembered: list[Prefix], text: str) -> tuple[int, int] | None:
    """(index in `remembered`, cuts) of the longest head, the most recent on ties; short
    prompts are not remembered."""
    best: tuple[int, int] | None = None
    best_len = 0
    recent = [(j, p) for j, p in reversed(list(enumerate(remembered)))
              if len(p.core) >= MIN_CHARS]
    for i, (j, p) in enumerate(recent):
        if text.startswith(p.core):
            k = len(p.ends)
        elif i < PARTIAL_SEARCH:
            k = max((j for j in range(1, len(p.ends) + 1)
                     if text.startswith(p.core[:p.ends[j - 1]])), default=0)
        else:
            k = 0
        if k and p.ends[k - 1] > best_len:
            best, best_len = (j, k), p.ends[k - 1]
    return best


@settings(max_examples=300, deadline=None)
@given(prompts=st.lists(_SEGMENTS, min_size=1, max_size=PARTIAL_SEARCH + 3),
       text=_SEGMENTS, share=st.integers(0, 20))
def test_find_equals_brute_force(prompts: list[list[str]], text: list[str],
                                 share: int) -> None:
    remembered = [_prefix(PAD + "".join(p)) for p in prompts]
    # the new prompt often shares a head with one of them: take it and go elsewhere
    source = prompts[share % len(prompts)]
    new = PAD + "".join(source[:share % (len(source) + 1)]) + "".join(text)
    memory = PrefixMemory(max_prefixes=64)
    for p in remembered:
        memory.remember(p)
    expected = _reference(remembered, new)
    got = memory.find(new)
    if expected is None:
        assert got is None
        return
    assert got is not None
    best, k = got
    assert (best.ends[k - 1], k) == (remembered[expected[0]].ends[expected[1] - 1],
                                     expected[1])
    assert new.startswith(best.core[:best.ends[k - 1]])
