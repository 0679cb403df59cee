"""When a request the router holds gets its slot: the order the queue serves waiters in,
and the start that order gives a request queued now.

The queue hands a freed slot to the waiter of shortest expected prefill, aged (see
``SlotQueue.drain``), not to the oldest. A request with little left to prefill (a turn
whose history the backend holds) then starts as soon as a slot frees, however many
long prompts wait there; one with much to prefill waits for every shorter one. Its
price says so: the backend's whole backlog would keep the first kind from its history
and promise the second a start it does not get.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from proxy.routing.settings import RouterSettings


def priority(prefill_s: float, waited_s: float, followers: int, s: RouterSettings) -> float:
    """A waiter's place in the queue's order, lowest first: its expected prefill, divided
    by 1 + ``wait_ageing`` x the seconds it has waited and by 1 + its followers (their
    shared prefix is prefilled once, by it); -1 once it has waited ``wait_starve_s``.
    The shortest first lowers the mean wait near saturation, as in any queue; the ageing
    and the bound keep a long prompt from waiting without end behind short ones."""
    if waited_s >= s.wait_starve_s:
        return -1.0
    return prefill_s / (1.0 + s.wait_ageing * waited_s) / (1 + followers)


def start_after(now: float, compute_free: float, slots_free: Iterable[float],
                ahead: Iterable[tuple[float, float]]) -> float:
    """When a request next in line after ``ahead`` starts to prefill: each of those, in
    order, (prefill seconds, seconds it keeps its slot after), takes the slot that frees
    first and prefills once the server's compute is free (``compute_free``: the prefills
    already sent end then); so does this one. Prefills share the server's compute
    (a batch holds them all); a slot frees once its request has also decoded."""
    free = [max(now, t) for t in slots_free]
    if not free:
        return max(now, compute_free)
    heapq.heapify(free)
    compute = max(now, compute_free)
    for prefill, after in ahead:
        start = max(heapq.heappop(free), compute)
        compute = start + prefill
        heapq.heappush(free, compute + after)
    return max(free[0], compute)
