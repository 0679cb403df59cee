"""Simulator: oracle, policies side by side, capacity planner and the CLI."""

from __future__ import annotations

import dataclasses
import json
import random
from array import array
from pathlib import Path

import pytest

from loadtest.__main__ import DEFAULT_TRACE, main
from loadtest.bounds import oracle_hit_ratio
from loadtest.capacity import plan_capacity
from loadtest.simulate import SimBackend, SimResult, simulate
from loadtest.trace import (
    BlockPrompts,
    TraceRequest,
    block_tokens,
    load_mooncake,
    request_tokens,
)
from proxy.routing.cache.checkpoints import Memory


def conversations(n_conv: int = 12, turns: int = 6) -> list[TraceRequest]:
    """Multi-turn sessions: each turn re-sends the history plus one new block."""
    out = []
    next_id = 0
    hist: list[list[int]] = [[] for _ in range(n_conv)]
    rng = random.Random(1)
    for t in range(turns):
        order = list(range(n_conv))
        rng.shuffle(order)  # conversations interleave differently every turn
        for k, c in enumerate(order):
            for _ in range(4 if t == 0 else 1):
                hist[c].append(next_id)
                next_id += 1
            ts = (t * n_conv + k) * 400.0
            out.append(TraceRequest(ts, len(hist[c]) * 512 - 10, 20, tuple(hist[c])))
    return out


def test_oracle_by_hand() -> None:
    trace = [
        TraceRequest(0, 1024, 1, (1, 2)),
        TraceRequest(1, 1500, 1, (1, 2, 3)),  # reuses 1024
        TraceRequest(2, 600, 1, (1, 9)),  # reuses 512
    ]
    assert oracle_hit_ratio(trace) == pytest.approx((1024 + 512) / (1024 + 1500 + 600))


def test_block_tokens_deterministic_and_distinct() -> None:
    assert block_tokens(5) == block_tokens(5)
    assert block_tokens(5)[0] != block_tokens(6)[0]
    r = TraceRequest(0, 700, 1, (5, 6))
    assert request_tokens(r) == (block_tokens(5) + block_tokens(6))[:700]


@pytest.mark.parametrize(("length", "ids"), [
    (1, 1), (512, 1), (700, 2), (1536, 3),  # one id per block, as in a Mooncake trace
    (1, 3), (512, 2), (700, 3),  # more ids than the length needs: the first ones count
])
def test_block_prompts_are_the_requests_tokens_as_bytes(length: int, ids: int) -> None:
    # block 301 wraps past the vocabulary's end
    r = TraceRequest(0, length, 1, (301, 5, 6)[:ids])
    assert BlockPrompts().prompt(r) == array("i", request_tokens(r)).tobytes()


def test_prefix_beats_round_robin_and_stays_below_oracle() -> None:
    trace = conversations()
    be = SimBackend(n_slots=2, ram_cache_tokens=20_000, prefill_tps=5_000.0)
    pre = simulate(trace, "prefix", 3, be)
    rr = simulate(trace, "round_robin", 3, be)
    oracle = oracle_hit_ratio(trace)
    assert pre.requests == rr.requests == len(trace)
    assert rr.hit_ratio < pre.hit_ratio <= oracle
    assert pre.hit_ratio >= 1.5 * rr.hit_ratio
    assert pre.ttft_mean < rr.ttft_mean
    assert pre.imbalance >= 1.0


def test_capacity_planner_finds_smallest_count() -> None:
    trace = conversations()
    be = SimBackend(n_slots=2, ram_cache_tokens=20_000, prefill_tps=5_000.0)
    n, runs = plan_capacity(trace, 1.0, be, max_backends=16)
    assert n is not None
    by_n = {r.n_backends: r for r in runs}
    assert by_n[n].ttft_p90 <= 1.0
    assert n == 1 or by_n[max(k for k in by_n if k < n)].ttft_p90 > 1.0


def test_cli_simulate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    rows = [
        {
            "timestamp": r.timestamp_ms,
            "input_length": r.input_length,
            "output_length": r.output_length,
            "hash_ids": list(r.hash_ids),
        }
        for r in conversations(4, 3)
    ]
    path.write_text("\n".join(json.dumps(x) for x in rows))
    assert len(load_mooncake(path)) == 12
    assert main(["simulate", "--trace", str(path), "--backends", "2"]) == 0
    out = capsys.readouterr().out
    for word in ("prefix", "round_robin", "least_loaded", "random", "oracle hit ratio"):
        assert word in out


def test_conversations_come_back_from_a_ram_tier_of_many_large_entries() -> None:
    """300 conversations (2k tokens each), all started before any returns, on 2 backends
    x 2 slots: each return must load its history from the RAM tier, which then holds
    ~150 large entries per backend. The server searches them all (the simulated one
    capped like the router's model, 4e49c21, found 0.3% instead of 44%), and so must the
    router's model to know where each history is (capped at the 64 largest entries of
    any size: half the predictions wrong; on the Mooncake replay, 6.5 points of hit)."""
    trace = []
    for c in range(300):  # first turns
        trace.append(TraceRequest(c * 400.0, 4 * 512 - 10, 20,
                                  tuple(range(1000 * c, 1000 * c + 4))))
    for c in range(300):  # returns: the history plus one block
        trace.append(TraceRequest((300 + c) * 400.0, 5 * 512 - 10, 20,
                                  tuple(range(1000 * c, 1000 * c + 5))))
    be = SimBackend(n_slots=2, ram_cache_tokens=1_000_000, prefill_tps=5_000.0)
    pre = simulate(trace, "prefix", 2, be)
    oracle = oracle_hit_ratio(trace)
    assert pre.hit_ratio >= oracle - 0.02, (pre.hit_ratio, oracle)
    assert pre.mispredicted <= 0.01  # the router knew where each history was


def test_chat_replay_is_simulated_on_its_templated_tokens(demo_model: Path) -> None:
    """The chat form of the trace, tokenized as the server would: each prompt starts with
    the template's tokens, a conversation's later turn shares its first blocks, and the
    router predicts every reuse of the modelled servers."""
    from loadtest.simulate import chat_replay
    from loadtest.workloads import chat_trace

    w = chat_trace(path=DEFAULT_TRACE, requests=30, rate=4.0, block=16)
    trace, prompts, starts = chat_replay(w, demo_model)
    assert len(trace) == len(prompts) == len(w.requests())
    # the conversation so far is one user message, the prompt's first
    assert set(starts) == {(0,)}
    assert [t.input_length for t in trace] == [len(p) // 4 for p in prompts]
    heads = {p[:8] for p in prompts}
    assert len(heads) == 1  # the template's first tokens
    be = SimBackend(n_slots=2, slot_ctx=8192, ram_cache_tokens=4096, kv_bytes_per_token=8192,
                    prefill_tps=1500.0, decode_tps=50.0)
    res = simulate(trace, "prefix", 2, be, prompts=prompts)
    assert res.requests == len(trace) and res.mispredicted == 0.0
    assert res.reused_tokens > 0.2 * res.prompt_tokens
    # a hybrid model reuses a prefix only up to a checkpoint: a later turn continues its
    # conversation's slot whole, but whatever diverges inside one gets less
    hybrid = simulate(trace, "prefix", 2, dataclasses.replace(be, memory=Memory(
        recurrent=True)), prompts=prompts, user_starts=starts)
    assert hybrid.mispredicted == 0.0
    assert 0 < hybrid.reused_tokens < res.reused_tokens


@pytest.mark.parametrize(("n_slots", "ram", "held"), [
    (1, 0, 0),  # B's turn evicts A's history from the only slot: lost to eviction
    (2, 0, 1024),  # both histories stay in slots
    (1, 100_000, 1024),  # A's history waits in RAM
])
def test_held_at_arrival_splits_eviction_from_routing(n_slots: int, ram: int,
                                                      held: int) -> None:
    """Conversation A, then B, then A's second turn on one backend: what the fleet held
    of A's history as it came back (the oracle less this is what eviction lost)."""
    trace = [TraceRequest(0, 1024, 1, (1, 2)), TraceRequest(1000, 1024, 1, (5, 6)),
             TraceRequest(2000, 1536, 1, (1, 2, 3))]
    be = SimBackend(n_slots=n_slots, ram_cache_tokens=ram, prefill_tps=5_000.0)
    r = simulate(trace, "prefix", 1, be)
    assert r.held_tokens == held
    assert r.hit_ratio <= r.held_ratio <= oracle_hit_ratio(trace)


def test_prefill_noise_scatters_each_requests_time() -> None:
    """Noisy prefill times: a replay repeats with its seed, another seed draws other
    times; a policy blind to time (round robin) sends each request where it sent it
    with exact times; the router's predictions stay exact."""
    trace = conversations()
    exact = SimBackend(n_slots=2, ram_cache_tokens=20_000, prefill_tps=5_000.0)
    noisy = dataclasses.replace(exact, prefill_noise=0.3)
    a, b = (simulate(trace, "round_robin", 3, noisy, seed=4) for _ in range(2))
    assert a == dataclasses.replace(b, wall_s=a.wall_s, cpu_s=a.cpu_s)
    base = simulate(trace, "round_robin", 3, exact, seed=4)
    assert sorted(s[:2] for s in a.starts) == sorted(s[:2] for s in base.starts)

    def ttfts(r: SimResult) -> list[float]:
        return [t for *_, t in sorted(r.starts)]

    assert ttfts(a) != pytest.approx(ttfts(base), rel=0.01)
    other = simulate(trace, "round_robin", 3, noisy, seed=5)
    assert ttfts(other) != pytest.approx(ttfts(a), rel=0.01)
    assert simulate(trace, "prefix", 3, noisy, seed=4).mispredicted == 0.0
