"""When a spill pays: the request handed a slot waits for its save, which must be short
next to the prefill it spares (or short outright)."""

from __future__ import annotations

import pytest

from proxy.disk.save import SPILL_MAX_S, SPILL_SHARE, spill_estimate

MB = 1 << 20
KV = 8192  # bytes of KV per token (the demo model's order)


@pytest.mark.parametrize("held,spared_s,write_bps,pays", [
    (1_000, 1.0, 200 * MB, True),  # 39 ms: short outright
    (8_000, None, 200 * MB, False),  # 0.31 s, and no prefill time to weigh it against
    (8_000, 8.0, 200 * MB, True),  # 0.31 s to spare 8 s of prefill
    (8_000, 0.5, 200 * MB, False),  # ... but only 0.5 s of it spared
    (8_000, 0.16, 200 * MB, False),  # a GPU recomputes it in 0.16 s
    (64_000, 64.0, 200 * MB, True),  # 2.5 s to spare 64 s
    (64_000, 64.0, 20 * MB, False),  # a slow disk: 25 s
])
def test_a_spill_pays_when_short_next_to_the_prefill_it_spares(
        held: int, spared_s: float | None, write_bps: float, pays: bool) -> None:
    got = spill_estimate(held, KV, write_bps, spared_s)
    took = held * KV / write_bps
    assert (got is not None) == pays
    if got is not None:
        assert got == pytest.approx(took)
        assert took <= SPILL_MAX_S or took <= SPILL_SHARE * (spared_s or 0.0)
