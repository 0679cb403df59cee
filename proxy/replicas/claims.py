"""Who keeps a slot that two replicas chose at once, settled without a round trip.

Two replicas starting new conversations at the same moment, neither having heard of the
other's yet, may pin both to one slot (`Router.spread` makes it rare, not impossible):
the server runs one and queues the other there, which then cuts the first one's
history while an empty slot was left. So a request that claims its slot
(`Decision.claims`: an empty one, or another conversation's) is told to the others at
once, as a start carrying the time it was told, and held for the window before it is
sent. A peer's start for that slot heard meanwhile settles it, the same way in both
replicas: a start that is no claim (its request is sent already) wins, and of two
claims the earlier (time, then replica name) does. The loser moves: the forwarder
withdraws it (its peers hear ``moved``) and decides it again, and the winner's request,
in that slot in its model now, sends it elsewhere.

The window must exceed the broker's one-way latency plus the replicas' clock skew: then
each hears the other's claim before its own window ends, and the loser always moves.
A claim not told yet (its prompt's rest is being tokenized) loses to any start heard
first: its own time, taken when it is told, would be the later.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from proxy.replicas.events import Event
from proxy.routing.cache.lora import Lora
from proxy.routing.routed import Routed

# (backend, slot, request id, prompt, when told): the claim as a start, to the others
Tell = Callable[[str, int, int, bytes, float, Lora | None], None]


@dataclass
class _Claim:
    backend: str
    slot: int
    at: float  # when it was told (inf until then)
    lost: asyncio.Future[None]


class Claims:
    """This replica's requests held while their claims are contested, in one pool."""

    def __init__(self, replica: str, window_s: float,
                 others: Callable[[], bool] = lambda: True,
                 clock: Callable[[], float] = time.time) -> None:
        self.replica, self.window_s, self.others, self.clock = replica, window_s, others, clock
        self.tell: Tell | None = None  # (the teller, made once the bus is)
        self._held: dict[int, _Claim] = {}

    async def hold(self, routed: Routed, prompt: Callable[[], Awaitable[bytes]]) -> bool:
        """Tell ``routed``'s claim and hold it for the window: False when a peer's
        request won its slot meanwhile (it must move). ``prompt``: its prompt as the
        others are told it (a prompt decided on its head: once its rest is tokenized).
        A request that claims nothing, a window of 0, or no peer to hear: True at once;
        one whose whole prompt shows it claims nothing after all (decided on a head that
        ends inside the slot's sequence): True once that prompt is known."""
        d = routed.prediction
        if not d.claims or d.slot is None or self.window_s <= 0 or self.tell is None \
                or not self.others():
            return True
        claim = _Claim(d.backend, d.slot, math.inf,
                       asyncio.get_running_loop().create_future())
        self._held[d.request_id] = claim  # (before any await: a start heard now counts)
        try:
            whole = await prompt()
            if not routed.prediction.claims:
                return True  # its whole prompt goes on from the slot's sequence
            if not claim.lost.done():
                claim.at = self.clock()
                self.tell(d.backend, d.slot, d.request_id, whole, claim.at,
                          routed.entry.lora)
                await asyncio.wait({claim.lost}, timeout=self.window_s)
            return not claim.lost.done()
        finally:
            del self._held[d.request_id]

    def heard(self, e: Event) -> None:
        """A peer's start: a claim held here for its slot that it beats loses."""
        for c in self._held.values():
            if (c.backend, c.slot) == (e.backend, e.slot) and not c.lost.done() \
                    and (not e.at or (e.at, e.replica) < (c.at, self.replica)):
                c.lost.set_result(None)
