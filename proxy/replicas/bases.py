"""A `start` sent as what its prompt adds to one the peers have already.

A conversation's next turn resends its whole history: most of its prompt is a prompt
the same slot was told before (its previous turn's, or a side call's). Every replica
keeps the last few prompts the starts told each slot of its model (its own, as sent,
and the peers', as read); a start whose prompt begins with one of them goes out as the
length of that common prefix, its digest, and the rest. The receiver takes the one of its
own that has that digest; one it does not have (it missed that start, or joined since)
makes the start unreadable there, as a missed one is.

A prompt this replica holds is a base for its own starts only while every peer is sure
to have it: anything held before a replica said hello (a joiner, one back after losing
the broker, this one reconnecting) is not, and the next start of each slot goes whole.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from dataclasses import dataclass, replace

from proxy.replicas.events import DIGEST, Event, Kind
from proxy.routing.tree.token_bytes import common_len

PER_SLOT = 3  # prompts kept per slot (a turn, its side calls)
MIN_BASE = 16  # tokens in common below which a start goes whole
_BYTES = 256 << 20  # prompts kept, in all

_Slot = tuple[str, str, int]  # (pool, backend, slot)


@dataclass(frozen=True)
class _Base:
    prompt: bytes
    epoch: int  # `Bases.epoch` when it was told


def digest(prompt: bytes, n: int) -> bytes:
    """The digest of ``prompt``'s first ``n`` tokens."""
    return hashlib.blake2b(memoryview(prompt)[:4 * n], digest_size=DIGEST).digest()


class Bases:
    def __init__(self, max_bytes: int = _BYTES) -> None:
        self.max_bytes = max_bytes
        self.epoch = 0
        # slots, least recently told first
        self._slots: OrderedDict[_Slot, deque[_Base]] = OrderedDict()
        self._bytes = 0

    def unsure(self) -> None:
        """A replica said hello (or this one reconnected): what is held so far may not
        be every peer's."""
        self.epoch += 1

    def told(self, e: Event, everyone: bool = True) -> None:
        """``e`` (a whole start) went out, or was read: its slot was told its prompt;
        ``everyone``: every peer was (not only this replica, joining)."""
        key = e.pool, e.backend, e.slot
        bases = self._slots.pop(key, None) or deque()
        self._slots[key] = bases
        base = _Base(e.tokens, self.epoch if everyone else -1)
        if bases and bases[-1].prompt == e.tokens:
            bases[-1] = base
            return
        bases.append(base)
        self._bytes += len(e.tokens)
        if len(bases) > PER_SLOT:
            self._bytes -= len(bases.popleft().prompt)
        while self._bytes > self.max_bytes:
            _, oldest = self._slots.popitem(last=False)
            self._bytes -= sum(len(b.prompt) for b in oldest)

    def shorten(self, e: Event) -> Event:
        """``e`` as sent: a whole start as what it adds to the longest prefix of its
        prompt the peers surely hold for that slot (unchanged if none is long enough)."""
        if e.kind != Kind.START:
            return e
        bases = self._slots.get((e.pool, e.backend, e.slot), ())
        n = max((common_len(b.prompt, e.tokens, 0) for b in bases if b.epoch == self.epoch),
                default=0)
        if n < MIN_BASE:
            return e
        return replace(e, tokens=e.tokens[4 * n:], keep=n, base=digest(e.tokens, n))

    def whole(self, e: Event) -> Event | None:
        """A start as read: its whole prompt (None: its base is none this replica holds)."""
        if e.kind != Kind.START or not e.keep:
            return e
        for b in self._slots.get((e.pool, e.backend, e.slot), ()):
            if len(b.prompt) >= 4 * e.keep and digest(b.prompt, e.keep) == e.base:
                return replace(e, tokens=b.prompt[:4 * e.keep] + e.tokens, keep=0, base=b"")
        return None
