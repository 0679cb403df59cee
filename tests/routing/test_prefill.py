"""The prefill time model: a range's cost, its fit to reported timings (against a direct
weighted least squares), and how backends share it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.routing.backend_state import BackendState, share_rate
from proxy.routing.cache.model import BackendCache
from proxy.routing.cache.values import BackendCapacity
from proxy.routing.prefill import PrefillCost
from proxy.routing.settings import RouterSettings
from proxy.routing.tree.radix import RadixTree


@pytest.mark.parametrize(("per_token", "per_position", "reuse", "n", "want"), [
    (0.001, 0.0, 0, 1000, 1.0),             # one rate
    (0.001, 0.0, 400, 1000, 0.6),
    (0.001, 1e-6, 0, 1000, 1.0 + 0.5),      # + 1e-6 x (1000^2) / 2
    (0.001, 1e-6, 1000, 2000, 1.0 + 1.5),   # the same count after a 1,000-token prefix
    (0.001, 1e-6, 500, 500, 0.0),           # nothing to prefill
    (0.001, 1e-6, 600, 500, 0.0),
])
def test_a_ranges_prefill_time(per_token: float, per_position: float, reuse: int, n: int,
                               want: float) -> None:
    assert PrefillCost(per_token, per_position).seconds(reuse, n) == pytest.approx(want)


def _direct_fit(samples: list[tuple[float, int, int]], alpha: float) -> tuple[float, float]:
    """Weighted least squares over the samples, the newest weighing 1 and each older one
    (1 - alpha) times the next (numpy's solver on the rows scaled by sqrt(weight))."""
    k = len(samples)
    w = np.array([(1 - alpha) ** (k - 1 - i) for i in range(k)])
    x = np.array([[n - r, (n * n - r * r) / 2] for _, r, n in samples], dtype=float)
    y = np.array([t for t, _, _ in samples])
    got, *_ = np.linalg.lstsq(x * np.sqrt(w)[:, None], y * np.sqrt(w), rcond=None)
    return float(got[0]), float(got[1])


@settings(max_examples=200, deadline=None)
@given(per_token=st.floats(1e-5, 1e-2), per_position=st.floats(0.0, 1e-5),
       ranges=st.lists(st.tuples(st.integers(0, 8000), st.integers(32, 8000)), min_size=2,
                       max_size=30),
       noise=st.lists(st.floats(0.7, 1.5), min_size=30, max_size=30),
       alpha=st.sampled_from([0.05, 0.2, 1.0]))
def test_the_fit_is_the_weighted_least_squares_of_the_timings(
        per_token: float, per_position: float, ranges: list[tuple[int, int]],
        noise: list[float], alpha: float) -> None:
    truth = PrefillCost(per_token, per_position)
    samples = [(truth.seconds(r, r + m) * noise[i], r, r + m) for i, (r, m) in enumerate(ranges)]
    cost = PrefillCost.at_rate(1500.0)
    for t, r, n in samples:
        cost.learn(t, r, n, alpha)
    a, b = _direct_fit(samples, alpha)
    if alpha < 1.0 and a > 0 and b >= 0 and len({(r, n) for _, r, n in samples}) > 1:
        x = np.array([[n - r, (n * n - r * r) / 2] for _, r, n in samples], dtype=float)
        if np.linalg.cond(x / np.linalg.norm(x, axis=0)) < 100:  # lengths tell them apart
            assert (cost.per_token, cost.per_position) == pytest.approx((a, b), rel=1e-6,
                                                                        abs=1e-12)
    assert cost.per_token > 0 and cost.per_position >= 0  # never a free or negative term


def test_exact_timings_are_recovered_and_one_length_gives_one_rate() -> None:
    cost = PrefillCost.at_rate(1500.0)
    truth = PrefillCost(0.00075, 5e-7)
    for r, n in [(0, 300), (0, 4000), (2000, 2600), (35, 1200)]:
        cost.learn(truth.seconds(r, n), r, n, 0.2)
    assert (cost.per_token, cost.per_position) == pytest.approx((0.00075, 5e-7))
    flat = PrefillCost.at_rate(1500.0)
    for _ in range(3):
        flat.learn(1.0, 0, 1000, 0.2)  # nothing tells the terms apart: one rate
    assert (flat.per_token, flat.per_position) == pytest.approx((0.001, 0.0))
    faster = PrefillCost.at_rate(1500.0)
    faster.learn(1.0, 0, 1000, 0.2)
    faster.learn(1.0, 0, 4000, 0.2)  # longer prompts faster per token: no negative term
    assert faster.per_position == 0.0
    # (one rate: the older sample weighing 1 - alpha)
    assert faster.per_token == pytest.approx((0.8 * 1000 + 4000) / (0.8 * 1000**2 + 4000**2))
    assert not PrefillCost.at_rate(1500.0).learned
    assert PrefillCost.at_rate(1500.0).seconds(0, 3000) == pytest.approx(2.0)


def _state(name: str) -> BackendState:
    cache = BackendCache(BackendCapacity(name, 2, 16384, 0, 8192), RadixTree())
    return BackendState(cache, rate=1500.0)


def test_a_backend_learns_from_the_range_it_reported_and_peers_share_the_terms() -> None:
    s = RouterSettings()
    a, b = _state("a"), _state("b")
    truth = PrefillCost(0.001, 1e-6)
    a.learn(s, 2.0, truth.seconds(0, 1000) * 1000, 1000, None)
    a.learn(s, 4.0, truth.seconds(3000, 4000) * 1000, 1000, 3000)  # after 3,000 reused
    assert (a.prefill.per_token, a.prefill.per_position) == pytest.approx((0.001, 1e-6))
    assert a.prefill_s(3000, 4000) == pytest.approx(4.5)
    a.learn(s, 1.0, 10.0, 10, 0)  # too few tokens to time: not learned from
    assert a.prefill.per_position == pytest.approx(1e-6)
    share_rate([a, b], s.default_prefill_tps)
    assert not b.prefill.learned
    assert b.prefill_s(3000, 4000) == pytest.approx(4.5)  # a's terms, until b reports
