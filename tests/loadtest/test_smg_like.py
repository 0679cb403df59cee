"""The ``smg_like`` simulation baseline (loadtest/smg_like.py): runs, follows its rules,
and stays out of the proxy's policies."""

from __future__ import annotations

from loadtest.simulate import SimBackend, simulate
from loadtest.smg_like import _PromptSet
from proxy.routing.policies import POLICIES
from tests.loadtest.test_simulate import conversations


def test_prompt_set_matches_and_sizes_like_a_radix_tree() -> None:
    t = _PromptSet()
    a = bytes(range(40))  # 10 tokens
    t.insert(a)
    assert t.size == 10 and t.match(a[:24] + b"\xff" * 16) == 6
    t.insert(a[:24] + b"\xff" * 16)  # shares 6: adds 4
    assert t.size == 14
    t.insert(a[:20])  # held already
    assert t.size == 14 and t.match(a) == 10


def test_smg_like_runs_unpinned_and_queues_in_the_server() -> None:
    trace = conversations()
    be = SimBackend(n_slots=2, ram_cache_tokens=20_000, prefill_tps=5_000.0)
    got = simulate(trace, "smg_like", 3, be)
    assert got.requests == len(trace) and got.rejected == 0
    assert 0 < got.hit_ratio < 1
    assert "smg_like" not in POLICIES  # a simulation baseline, not a proxy policy
