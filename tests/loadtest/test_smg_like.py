"""The ``smg_like`` simulation baseline (loadtest/smg_like.py): runs, follows its rules,
and stays out of the proxy's policies."""

from __future__ import annotations

import pytest

from loadtest.simulate import SimBackend, simulate
from loadtest.smg_like import SmgLike, _PromptSet
from proxy.routing.backend_state import BackendState
from proxy.routing.cache.model import BackendCache
from proxy.routing.cache.values import BackendCapacity, ServerRules
from proxy.routing.options import Candidate
from proxy.routing.policies import POLICIES
from proxy.routing.settings import RouterSettings
from proxy.routing.tree.radix import RadixTree
from proxy.routing.tree.token_bytes import to_token_bytes
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


def _cands(inflight: list[int], prompt: list[int]) -> list[Candidate]:
    out = []
    for i, n in enumerate(inflight):
        cache = BackendCache(BackendCapacity(f"b{i}", 2, 4096, 0, 1024), RadixTree(),
                             ServerRules())
        out.append(Candidate(f"b{i}", BackendState(cache, rate=1000.0, inflight=n), {}, {},
                             to_token_bytes(prompt)))
    return out


HISTORY = list(range(100, 140))  # 40 tokens sent to b0 first


@pytest.mark.parametrize("prompt, inflight, want, why", [
    ([*HISTORY, *range(500, 550)], [9, 1, 5], "b0", "match"),  # 40/90 > 0.3: its holder
    ([*HISTORY, *range(500, 600)], [9, 1, 5], "b1", "miss"),  # 40/140 <= 0.3: fewest
    ([*HISTORY, *range(500, 550)], [30, 1, 2], "b1", "spill"),  # its holder spills
])
def test_smg_like_follows_smgs_rules(prompt: list[int], inflight: list[int], want: str,
                                     why: str) -> None:
    """smg 1.13.0 cache_aware as `smg launch` runs it: a match ratio over 0.3 goes to the
    worker holding it unless that one spills (over 1.5x the mean load and the mean plus a
    margin), else the fewest requests in flight."""
    smg = SmgLike(RouterSettings(), seed=0)
    smg.trees["b0"] = _PromptSet()
    smg.trees["b0"].insert(to_token_bytes(HISTORY))
    smg._q = to_token_bytes(prompt)  # (what `choose` keeps for `pick`)
    got = smg.pick(_cands(inflight, prompt))
    assert (got.name, smg.last_why) == (want, why)
