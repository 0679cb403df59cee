"""Requests held until the request whose start creates the RAM entry they load is known
posted (`SlotWaits.after`)."""

from __future__ import annotations

import asyncio

from proxy.forwarding.waits import SlotWaits
from proxy.observability.logging import get_logger
from proxy.observability.metrics import ProxyMetrics
from proxy.reporting.recorder import Recorder
from proxy.routing.cache.values import BackendCapacity
from proxy.routing.decision import Report
from proxy.routing.routed import Routed
from proxy.routing.router import Router


def routed(r: Router, tokens: list[int], now: float) -> Routed:
    d = r.decide(tokens, now=now, defer=True)
    assert isinstance(d, Routed)
    return d


def loads_what_a_start_saves() -> tuple[Router, Routed, Routed]:
    """X and Y run at once in two of three slots, then end; L (new) takes the empty
    one, and its start saves the idle X and Y to RAM; M (new) then takes X's slot.
    X's next turn loads X from RAM in Y's slot: it is sent after L."""
    r = Router("prefix")
    r.add_backend(BackendCapacity("a", 3, 8192, 1 << 30, 8192))
    x = [*range(1000, 1600)]
    ran = [r.place(routed(r, prompt, 0.0)) for prompt in (x, [*range(5000, 6500)])]
    for d in ran:  # (both busy while the other started: neither saved to RAM yet)
        r.complete(d, Report(output_tokens=[7]), now=1.0)
    long = routed(r, [*range(9000, 9800)], 3.0)
    r.place(long)
    r.place(routed(r, [*range(12_000, 12_100)], 3.05))
    turn = routed(r, [*x, 7, *range(20, 25)], 3.1)
    return r, long, turn


def waits(r: Router, timeout: float) -> SlotWaits:
    return SlotWaits(r, {}, Recorder(ProxyMetrics(), get_logger()), timeout, None)


async def test_requests_held_for_a_start_go_once_it_is_posted() -> None:
    r, long, turn = loads_what_a_start_saves()
    w = waits(r, 5.0)
    assert r.held_for(turn) == long.request_id
    held = [asyncio.create_task(w.after(turn)) for _ in range(2)]  # (two holders)
    await asyncio.sleep(0.05)
    assert not any(t.done() for t in held)
    w.posted(long)
    await asyncio.wait_for(asyncio.gather(*held), 1.0)
    assert w._posting == {}


async def test_a_wait_that_times_out_leaves_nothing_behind() -> None:
    """Held past its limit, then its creator withdrawn (no `posted`): no future is kept
    for a request that will never be posted."""
    r, long, turn = loads_what_a_start_saves()
    w = waits(r, 0.05)
    await asyncio.gather(w.after(turn), w.after(turn))
    long.withdraw(now=4.0)
    assert w._posting == {}
    assert r.held_for(turn) is None
