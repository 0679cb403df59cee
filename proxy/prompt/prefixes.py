"""Recent prompts with their token ids, cut at special tokens, for FragmentTokenizer.

A conversation's next turn starts with its previous prompt, and a cut just after a
special token is a fragment boundary (see proxy/prompt/tokenizer.py), so the ids of a shared
head are reused without even splitting that text again: with the fragment cache warm,
splitting and looking up a 200 KB prompt costs ~0.3 ms, resuming from a remembered
head a memcpy.
"""

from __future__ import annotations

import bisect
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass

# Remembered prompts (most recent first) searched for a head shared with a new prompt
# when none is wholly its head (each costs at most ~2 copies of the prompt's text), and
# only for prompts of at least PARTIAL_MIN_CHARS: splitting a shorter one afresh costs
# less than the search (~1 us per remembered prompt).
PARTIAL_SEARCH = 8
PARTIAL_MIN_CHARS = 8192
# Prompts shorter than this are neither looked up nor remembered: splitting one afresh
# costs less than a pass over the list (~20 us), and a stream of short requests would
# otherwise push the long conversations, the ones worth resuming, out of the LRU.
MIN_CHARS = 2048


@dataclass(frozen=True)
class Prefix:
    core: str            # a prompt up to (and including) its last special token
    ends: list[int]      # offsets in `core` just after each special token
    counts: list[int]    # number of ids of core[:ends[i]]
    tokens: array        # ids ('i') of the whole prompt (first counts[-1] are core's)


def shared_cuts(p: Prefix, text: str) -> int:
    """The largest k such that `text` starts with p.core[:p.ends[k - 1]] (0: none)."""
    ends, core = p.ends, p.core
    lo, hi, done = 0, len(ends), 0  # the first lo cuts are shared (done chars), hi+1 not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        # compares in place from `done`: only the slice not yet verified is copied
        if text.startswith(core[done:ends[mid - 1]], done):
            lo, done = mid, ends[mid - 1]
        else:
            hi = mid - 1
    return lo


def _may_pass(p: Prefix, text: str, done: int) -> bool:
    """Whether `p` can share more than `done` chars of `text` (a head ending at one of
    its cuts), by comparing only its first cut past `done`: most recent prompts share
    the same history with `text` and then differ, and bisecting each one copies ~the
    whole prompt a few times."""
    if not done:
        return True
    j = bisect.bisect_right(p.ends, done)
    return j < len(p.ends) and text.startswith(p.core[done:p.ends[j]], done)


class PrefixMemory:
    """A bounded LRU of `Prefix`es (thread-safe: the proxy tokenizes on two threads)."""

    def __init__(self, max_prefixes: int) -> None:
        self._lock = threading.Lock()
        self._items: OrderedDict[int, Prefix] = OrderedDict()  # keyed by identity:
        self._max = max_prefixes                                 # hashing 100 KB costs

    def find(self, text: str) -> tuple[Prefix, int] | None:
        """The remembered prompt sharing the longest head with `text`, cut at one of its
        special tokens, and how many of its cuts (`ends`) that head spans.

        A whole remembered prompt is the next turn of its conversation (cheap to test:
        one `startswith`). Otherwise the most recent few are searched for a shared head
        (a regenerated or edited turn, or a request sharing a long history with the
        previous one), by bisecting their cuts.
        """
        if len(text) < MIN_CHARS:
            return None
        best: Prefix | None = None
        best_k = best_len = 0
        with self._lock:
            recent = list(reversed(self._items.values()))
        partial = PARTIAL_SEARCH if len(text) >= PARTIAL_MIN_CHARS else 0
        for i, p in enumerate(recent):
            if len(p.core) <= best_len:
                continue
            if text.startswith(p.core):
                k = len(p.ends)
            elif i < partial and _may_pass(p, text, best_len):
                k = shared_cuts(p, text)
            else:
                continue
            if k and p.ends[k - 1] > best_len:
                best, best_k, best_len = p, k, p.ends[k - 1]
        if best is None:
            return None
        with self._lock:
            if best_k == len(best.ends):
                # The prompt being built extends `best` and will supersede it: dropping it
                # keeps the list to about one entry per live conversation.
                self._items.pop(id(best), None)
            elif id(best) in self._items:
                self._items.move_to_end(id(best))
        return best, best_k

    def remember(self, p: Prefix) -> None:
        if len(p.core) < MIN_CHARS:
            return
        with self._lock:
            self._items[id(p)] = p
            while len(self._items) > self._max:
                self._items.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
