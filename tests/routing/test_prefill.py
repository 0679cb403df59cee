"""The prefill time model: a range's cost, its fit to reported timings (against a direct
weighted least squares), and how backends share it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.routing.backend_state import BackendState, share_rate
from proxy.routing.cache.model import BackendCache
from proxy.routing.cache.values import BackendCapacity, Placement
from proxy.routing.decision import Report
from proxy.routing.options import redo_s
from proxy.routing.prefill import PrefillCost
from proxy.routing.routed import Routed
from proxy.routing.router import Router
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


def _reference(samples: list[tuple[float, int, int]], alpha: float) -> tuple[float, float]:
    """The terms after each sample, as the module doc says, with numpy's least squares:
    over the samples so far, the newest weighing 1 and each older one (1 - alpha) times
    the next; both terms when the weighted mean positions spread enough and both are
    non-negative, else the position term kept and the per-token one fitted under it,
    else one rate."""
    per_token, per_position = 1 / 1500.0, 0.0
    for k in range(1, len(samples) + 1):
        first = 0 if alpha < 1 else k - 1  # (alpha 1: the newest sample alone)
        w = np.sqrt([(1 - alpha) ** (k - 1 - i) for i in range(first, k)])
        x = np.array([[n - r, (n * n - r * r) / 2] for _, r, n in samples[first:k]])
        x, y = x * w[:, None], np.array([t for t, _, _ in samples[first:k]]) * w
        m, u = x[:, 1] / x[:, 0], x[:, 0] ** 2  # mean positions, as the fit weighs them
        spread = np.average((m - np.average(m, weights=u)) ** 2, weights=u) / np.average(
            m**2, weights=u)
        both = np.linalg.lstsq(x, y, rcond=None)[0]
        if spread >= 0.05 and both[0] > 0 and both[1] >= 0:
            per_token, per_position = float(both[0]), float(both[1])
        elif (t0 := float((x[:, 0] @ (y - per_position * x[:, 1])) / (x[:, 0] @ x[:, 0]))) > 0:
            per_token = t0
        else:
            per_token, per_position = float((x[:, 0] @ y) / (x[:, 0] @ x[:, 0])), 0.0
    return per_token, per_position


@settings(max_examples=200, deadline=None)
@given(per_token=st.floats(1e-5, 1e-2), per_position=st.floats(0.0, 1e-5),
       ranges=st.lists(st.tuples(st.integers(0, 8000), st.integers(32, 8000)), min_size=1,
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
    want = _reference(samples, alpha)
    assert (cost.per_token, cost.per_position) == pytest.approx(want, rel=1e-6, abs=1e-13)
    assert cost.per_token > 0 and cost.per_position >= 0  # never a free or negative term


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(900, 1100), min_size=2, max_size=20),
       noise=st.lists(st.floats(0.8, 1.25), min_size=20, max_size=20))
def test_noise_over_similar_lengths_teaches_no_position_term(
        lengths: list[int], noise: list[float]) -> None:
    # a backend at one rate, timed with the jitter of a batch shared with another slot:
    # a 10,000-token prompt is priced within that jitter of its 10 s
    cost = PrefillCost.at_rate(1500.0)
    for n, k in zip(lengths, noise, strict=False):
        cost.learn(n / 1000.0 * k, 0, n, 0.2)
    assert cost.per_position == 0.0
    assert 0.8 * 10.0 - 1e-9 <= cost.seconds(0, 10_000) <= 1.25 * 10.0 + 1e-9


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
    a.learn(s, 2.0, truth.seconds(0, 1000) * 1000, 1000, 0)
    a.learn(s, 4.0, truth.seconds(3000, 4000) * 1000, 1000, 3000)  # after 3,000 reused
    assert (a.prefill.per_token, a.prefill.per_position) == pytest.approx((0.001, 1e-6))
    assert a.prefill_s(3000, 4000) == pytest.approx(4.5)
    a.learn(s, 1.0, 1000.0, 10, 0)  # too few tokens to time: not learned from
    a.learn(s, 1.0, 1000.0, 1000, None)  # where its tokens start is not known: nor this
    assert (a.prefill.per_token, a.prefill.per_position) == pytest.approx((0.001, 1e-6))
    share_rate([a, b], s.default_prefill_tps)
    assert not b.prefill.learned
    assert b.prefill_s(3000, 4000) == pytest.approx(4.5)  # a's terms, until b reports


def test_a_backends_backlog_and_expected_ttft_are_its_prefills_by_position() -> None:
    # a backend that timed 3,000 tokens from the start and 3,000 after 6,000 reused: the
    # next request's expected TTFT there is its own prefill by position, then the one's
    # behind the first's
    truth = PrefillCost(0.0008, 5e-7)
    r = Router()
    r.add_backend(BackendCapacity("a", 2, 16384, 0, 8192))
    for k, reused in enumerate((0, 6000)):
        d = r.decide(list(range(10_000 * (k + 1), 10_000 * (k + 1) + reused + 3000)))
        assert isinstance(d, Routed)
        r.complete(d, Report(reported_cached=reused, prompt_n=3000, prompt_ms=1000
                             * truth.seconds(reused, reused + 3000)), now=1.0)
    first = r.decide(list(range(50_000, 54_000)), now=2.0)
    assert isinstance(first, Routed)
    assert first.prediction.reasons["ttft_s"]["a"] == pytest.approx(
        truth.seconds(0, 4000), abs=1e-3)
    second = r.decide(list(range(60_000, 61_000)), now=2.0)
    assert isinstance(second, Routed)  # behind the first's 4,000 positions (11.2 s)
    assert second.prediction.reasons["ttft_s"]["a"] == pytest.approx(
        truth.seconds(0, 4000) + truth.seconds(0, 1000), abs=1e-3)


@pytest.mark.parametrize(("held", "reuse", "tokens", "want"), [
    (6000, 6000, 500, (5500, 6000)),   # a tail truncated after the prompt's prefix
    (6000, 8000, 500, (5500, 6000)),   # the slot's tail, not positions after the reuse
    (6000, 0, 6000, (0, 6000)),        # all it held
    (0, 300, 200, (0, 200)),           # nothing held recorded: from the start
])
def test_what_a_placement_takes_is_priced_at_the_positions_it_held(
        held: int, reuse: int, tokens: int, want: tuple[int, int]) -> None:
    cost = PrefillCost(0.001, 1e-6)
    p = Placement(0, reuse, "slot", None, tokens, True, 0, held=held)
    assert redo_s(p, cost, tokens) == pytest.approx(cost.seconds(*want))
