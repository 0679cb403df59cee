"""Routing-core benchmark: tree speed and memory, simulator speed, Mooncake comparison.

Run: ``python bench/bench_core.py [--trace PATH]``. Prints figures as ``key: value`` and a
markdown block for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loadtest.bounds import oracle_hit_ratio
from loadtest.simulate import SimBackend, simulate
from loadtest.trace import load_mooncake
from proxy.routing.tree.radix import RadixTree

TRACE = str(Path(__file__).resolve().parent.parent / "loadtest" / "traces"
            / "mooncake_synthetic_trace.jsonl")


def _seq(rng: random.Random, n: int) -> bytes:
    return rng.randbytes(4 * n)  # n random int32 tokens


def build_tree(target: int = 1_000_000) -> tuple[RadixTree, list[bytes]]:
    """~target tokens: 32 shared 8k "system prompts", each extended by unique 8k turns."""
    rng = random.Random(0)
    systems = [_seq(rng, 8192) for _ in range(32)]
    tree = RadixTree()
    seqs: list[bytes] = []
    i = 0
    while tree.resident_tokens < target:
        s = systems[i % len(systems)] + _seq(rng, 8192)
        tree.assign(("seq", i), s)
        seqs.append(s)
        i += 1
    return tree, seqs


def bench_tree() -> tuple[float, float, int]:
    tracemalloc.start()
    tree, seqs = build_tree()
    resident = tree.resident_tokens
    del seqs
    current, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    per_token = current / resident
    tree, seqs = build_tree()
    rng = random.Random(1)
    times = []
    for k in range(300):
        base = seqs[k % len(seqs)]
        prompt = base[: 4 * 16384] + _seq(rng, 16384)  # 32k: 16k cached + 16k new
        t0 = time.perf_counter()
        tree.match(prompt)
        tree.assign(("new", 0), prompt)
        times.append(time.perf_counter() - t0)
        tree.drop(("new", 0))
    return statistics.median(times) * 1e6, per_token, resident


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--ram-tokens", type=int, default=4_000_000)
    args = ap.parse_args()
    us, per_token, resident = bench_tree()
    print(f"tree match+insert 32k prompt vs {resident:,}-token tree: median {us:.0f} us")
    print(f"tree bytes per resident token: {per_token:.2f}")
    trace = load_mooncake(args.trace)
    be = SimBackend(ram_cache_tokens=args.ram_tokens)
    oracle = oracle_hit_ratio(trace)
    unique = len({h for r in trace for h in r.hash_ids}) * 512
    res = {p: simulate(trace, p, 4, be) for p in ("prefix", "round_robin")}
    pre, rr = res["prefix"], res["round_robin"]
    print(f"working set ~{unique:,} tokens; per-backend RAM cache {args.ram_tokens:,} tokens")
    for r in res.values():
        print(
            f"{r.policy}: hit {r.hit_ratio:.3f} ttft mean {r.ttft_mean:.3f} s p90 "
            f"{r.ttft_p90:.3f} s imbalance {r.imbalance:.3f} requests/s {r.requests_per_s:,.0f} "
            f"(per CPU-second {r.requests_per_cpu_s:,.0f})"
        )
    print(f"oracle hit: {oracle:.3f}; prefix - oracle: {100 * (pre.hit_ratio - oracle):+.1f} pts")
    print(f"prefix / round_robin hit: {pre.hit_ratio / rr.hit_ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
