"""A `start` sent as what its prompt adds to one the peers have already.

A conversation's next turn resends its whole history: most of its prompt is a prompt
the same slot was told before (its previous turn's, or a side call's). Every replica
keeps the last few prompts the starts told each slot of its model (its own, as sent,
and the peers', as read: only slots its router for that pool routes; the bound counts
each base's and each slot's records, not only their prompts); a start whose prompt
begins with one of them (in its slot, or in another the start then names: a turn often
goes where its history is not) goes out as the length of that common prefix, its
digest, and the rest. The receiver takes the one of that slot's that has that digest;
one it does not have (it missed that start, or joined since) makes the start unreadable
there: that replica asks to resync (bus.py), and the peers send it their requests in
flight whole, then their next starts. A request's end makes what its slot then holds
(its prompt, then its answer) a base in its start's stead: the next turn, which begins
with both, sends neither again.

A prompt this replica holds is a base for its own starts only while every peer is sure
to have it: anything held before a replica said hello or asked to resync (a joiner, one
back after losing the broker, this one reconnecting, one that missed a start) is not,
and the next start of each slot goes whole.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from dataclasses import dataclass, replace
from itertools import islice

from proxy.replicas.events import DIGEST, MAX_TOKENS, Event, Kind
from proxy.routing.tree.token_bytes import common_len

PER_SLOT = 4  # prompts kept per slot (turns, side calls)
MIN_BASE = 16  # tokens in common below which a start goes whole
SEARCHED = 64  # slots a start's base is looked for in (the most recently told)
_BYTES = 256 << 20  # memory kept, in all: the prompts, and OVERHEAD per base and per slot
# what a base or a slot costs beyond its prompt's bytes (its entry, deque, record and
# names): a flood of tiny starts is bounded by this, not by its few prompt bytes
OVERHEAD = 1 << 10
MAX_SLOTS = 1 << 16  # slots kept

_Slot = tuple[str, str, int]  # (pool, backend, slot)


@dataclass(frozen=True)
class _Base:
    prompt: bytes
    epoch: int  # `Bases.epoch` when it was told
    request: tuple[str, int] | None = None  # (its replica, its id): a start's, until it ends


def _cost(b: _Base) -> int:
    return len(b.prompt) + OVERHEAD


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
        """A replica said hello or asked to resync (or this one reconnected): what is
        held so far may not be every peer's."""
        self.epoch += 1

    def told(self, e: Event, everyone: bool = True, epoch: int | None = None) -> None:
        """``e`` (a whole start) went out, or was read: its slot was told its prompt;
        ``everyone``: every peer was (not only this replica, joining), as of ``epoch``
        (the current one if None; a start sent: the one it was made in). The caller
        keeps only slots its replica routes (a peer cannot make it hold others). A claim
        (a start with its time, claims.py) is none: a replica of a version that knows no
        claims drops it, and reads the start told again once it is sent."""
        if e.at:
            return
        key = e.pool, e.backend, e.slot
        base = _Base(e.tokens, self._epoch(everyone, epoch), (e.replica, e.request))
        bases = self._slots.get(key)
        if bases and bases[-1].prompt == e.tokens:
            # (told again, maybe to a joiner only: every peer that held it still does)
            bases[-1] = max(bases[-1], base, key=lambda b: b.epoch)
            self._slots.move_to_end(key)
            return
        self._add(key, base)

    def ended(self, e: Event, everyone: bool = True, epoch: int | None = None) -> None:
        """``e`` (an end) went out, or was read (as ``told``): its slot holds the first
        ``keep`` tokens of its start's prompt, then ``tokens``, a base in that start's
        stead (as sure as the start was: both are needed to make it)."""
        key = e.pool, e.backend, e.slot
        bases = self._slots.get(key) or deque()
        # (its newest start of that id: a peer back from a restart numbers its requests
        # anew, and one its previous run left unended may still be here)
        i = next((i for i in reversed(range(len(bases)))
                  if bases[i].request == (e.replica, e.request)), -1)
        if i < 0 or not e.tokens or 4 * e.keep > len(bases[i].prompt) \
                or 4 * e.keep + len(e.tokens) > 4 * MAX_TOKENS:
            return
        start = bases[i]
        held = _Base(start.prompt[:4 * e.keep] + e.tokens,
                     min(start.epoch, self._epoch(everyone, epoch)))
        if held.prompt.startswith(start.prompt):  # (it holds the whole prompt: one base)
            del bases[i]
            self._bytes -= _cost(start)
        self._add(key, held)

    def _epoch(self, everyone: bool, epoch: int | None) -> int:
        return -1 if not everyone else self.epoch if epoch is None else epoch

    def _add(self, key: _Slot, base: _Base) -> None:
        bases = self._slots.pop(key, None)
        if bases is None:
            bases = deque()
            self._bytes += OVERHEAD
        self._slots[key] = bases
        bases.append(base)
        self._bytes += _cost(base)
        if len(bases) > PER_SLOT:
            self._bytes -= _cost(bases.popleft())
        while self._bytes > self.max_bytes or len(self._slots) > MAX_SLOTS:
            _, oldest = self._slots.popitem(last=False)
            self._bytes -= OVERHEAD + sum(_cost(b) for b in oldest)

    def shorten(self, e: Event) -> Event:
        """``e`` as sent: a whole start as what it adds to the longest prefix of its
        prompt the peers surely hold for that slot (unchanged if none is long enough)."""
        if e.kind != Kind.START:
            return e
        own = e.pool, e.backend, e.slot
        n, where = self._longest(e.tokens, own, 0), own  # (its own slot first: no name)
        for key in islice(reversed(self._slots), SEARCHED):
            if key != own and key[0] == e.pool \
                    and (got := self._longest(e.tokens, key, n)) > n:
                n, where = got, key
        if n < MIN_BASE:
            return e
        return replace(e, tokens=e.tokens[4 * n:], keep=n, base=digest(e.tokens, n),
                       base_from=None if where == own else where[1:])

    def _longest(self, prompt: bytes, key: _Slot, least: int) -> int:
        """The most tokens ``prompt`` shares with a base of ``key`` the peers surely hold
        (0 if none shares more than ``least``)."""
        best = 0
        for b in self._slots.get(key, ()):
            # (one memcmp rules out a base that shares no more: most, the system prompt)
            if b.epoch == self.epoch and (not least or prompt.startswith(
                    memoryview(b.prompt)[:4 * (least + 1)])):
                best = max(best, common_len(b.prompt, prompt, 0))
        return best if best > least else 0

    def whole(self, e: Event) -> Event | None:
        """A start as read: its whole prompt (None: its base is none this replica holds)."""
        if e.kind != Kind.START or not e.keep:
            return e
        where = e.base_from or (e.backend, e.slot)
        for b in self._slots.get((e.pool, *where), ()):
            if len(b.prompt) >= 4 * e.keep and digest(b.prompt, e.keep) == e.base:
                return replace(e, tokens=b.prompt[:4 * e.keep] + e.tokens, keep=0, base=b"",
                               base_from=None)
        return None
