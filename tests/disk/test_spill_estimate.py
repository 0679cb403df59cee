"""When a spill pays: the request handed a slot waits for its save, which must be short
next to the prefill it spares (or short outright)."""

from __future__ import annotations

import pytest

from proxy.disk.save import SPILL_MAX_S, SPILL_SHARE, spill_estimate

MB = 1 << 20
KV = 8192  # bytes of KV per token (the demo model's order)


@pytest.mark.parametrize("held,spared,write_bps,prefill_tps,pays", [
    (1_000, 1_000, 200 * MB, None, True),  # 39 ms: short outright
    (8_000, 8_000, 200 * MB, None, False),  # 0.31 s, and no rate to weigh it against
    (8_000, 8_000, 200 * MB, 1_000.0, True),  # 0.31 s to spare 8 s of prefill
    (8_000, 500, 200 * MB, 1_000.0, False),  # ... but only 0.5 s of it spared
    (8_000, 8_000, 200 * MB, 50_000.0, False),  # a GPU recomputes it in 0.16 s
    (64_000, 64_000, 200 * MB, 1_000.0, True),  # 2.5 s to spare 64 s
    (64_000, 64_000, 20 * MB, 1_000.0, False),  # a slow disk: 25 s
])
def test_a_spill_pays_when_short_next_to_the_prefill_it_spares(
        held: int, spared: int, write_bps: float, prefill_tps: float | None,
        pays: bool) -> None:
    got = spill_estimate(held, spared, KV, write_bps, prefill_tps)
    took = held * KV / write_bps
    assert (got is not None) == pays
    if got is not None:
        assert got == pytest.approx(took)
        assert took <= SPILL_MAX_S or took <= SPILL_SHARE * spared / (prefill_tps or 1)
