"""``python -m loadtest sweep``: the smg matrix in the simulator, over many seeds.

The live matrix (bench/bench_vs_smg.py) runs 12 cells in ~50 minutes, and smg's own
reuse moves by several points between runs of one seed, so it cannot choose between two
routing settings. The simulator replays the same cells (2 backends x 2 slots of 16k, the
demo model's KV, both chat replays at their arrival rates) with the real router, beside
``smg_like`` (loadtest/smg_like.py), in seconds each, over tens of seeds. The simulated
servers prefill as the live ones do on a 2-core machine: 1,300 tokens/s at a context's
start, each token 5.2e-7 s slower per token before it (fitted to the servers' logs of a
live matrix; with these, the simulated mean TTFT of the 12 live cells is within 12% of
the live one for smg, rms, and 17% for kvroute, with exact times), and 1,150 for a
slower machine. Each request's prefill takes that time times a log-normal factor of
sigma 0.25 (on those logs, the logarithm of time over fit has an interquartile range of
0.25, as a normal of sigma 0.19 has, and heavier tails: its sd is 0.37), so a setting that
only works with exact timings shows. Each cell is judged on the live matrix's targets,
so a setting is chosen by how many cells it meets.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from loadtest.fleet import split_policies

# (reuse vs the reference at least, mean TTFT vs it at most) per RAM tier in MiB: the
# targets the live matrix is judged on
TARGETS = {128: (1.0, 0.9), 32: (1.2, 0.8)}
RATES = {"synthetic": 2.0, "conversation": 3.0}  # arrivals/s: near these servers' knee
SLOTS, SLOT_CTX, DECODE_TPS = 2, 16384, 30.0  # per backend, tokens, tokens/s per slot


@dataclass(frozen=True)
class Cell:
    """One simulated run: a workload on one fleet at one prefill rate."""

    trace: str
    ram_mib: int
    seed: int
    prefill_tps: float  # at a context's start
    per_position: float = 0.0  # a token's extra prefill seconds per token before it
    noise: float = 0.0  # sigma of the log-normal factor on each prefill's time


@dataclass(frozen=True)
class Row:
    """What one policy got in one cell."""

    cell: Cell
    policy: str
    reuse: float
    ttft_mean: float


@dataclass(frozen=True)
class Verdict:
    """One policy's cells against the reference's, on the targets."""

    policy: str
    cells: tuple[Cell, ...]
    reuse_ratios: tuple[float, ...]  # in cell order
    ttft_ratios: tuple[float, ...]

    @property
    def missed(self) -> list[tuple[Cell, float, float]]:
        return [(c, r, t) for c, r, t in zip(self.cells, self.reuse_ratios, self.ttft_ratios,
                                             strict=True) if not meets(c.ram_mib, r, t)]

    def lines(self) -> list[str]:
        r, t, n = self.reuse_ratios, self.ttft_ratios, len(self.cells)
        return [f"{self.policy}: met {n - len(self.missed)} of {n}; reuse vs reference mean "
                f"{statistics.fmean(r):.3f}, lowest {min(r):.3f}; mean TTFT vs reference "
                f"mean {statistics.fmean(t):.3f}, highest {max(t):.3f}",
                *(f"  missed {c.trace} {c.ram_mib} MiB seed {c.seed} at {c.prefill_tps:.0f} "
                  f"tok/s: reuse {r:.2f}x, mean TTFT {t:.2f}x" for c, r, t in self.missed)]


def meets(ram_mib: int, reuse_ratio: float, ttft_ratio: float) -> bool:
    """A cell meets its RAM tier's targets (a tier without any: reuse and TTFT no worse)."""
    want_reuse, want_ttft = TARGETS.get(ram_mib, (1.0, 1.0))
    return reuse_ratio >= want_reuse and ttft_ratio <= want_ttft


def judge(rows: Iterable[Row], reference: str) -> list[Verdict]:
    """Each policy but ``reference``, over the cells both ran, in the rows' order."""
    by_cell: dict[Cell, dict[str, Row]] = {}
    for row in rows:
        by_cell.setdefault(row.cell, {})[row.policy] = row
    policies = dict.fromkeys(r.policy for c in by_cell.values() for r in c.values())
    out = []
    for policy in (p for p in policies if p != reference):
        pairs = [(c[policy], c[reference]) for c in by_cell.values()
                 if policy in c and reference in c and c[reference].reuse > 0]
        if pairs:
            out.append(Verdict(policy, tuple(a.cell for a, _ in pairs),
                               tuple(a.reuse / b.reuse for a, b in pairs),
                               tuple(a.ttft_mean / b.ttft_mean for a, b in pairs)))
    return out


def run_cell(cell: Cell, policies: Sequence[str], requests: int) -> list[Row]:
    """Every policy over one cell's replay (tokenized once)."""
    from backends.demo_model import ensure_demo_model
    from backends.memory import gguf_kv_bytes_per_token
    from loadtest.fleet import policy_variant
    from loadtest.simulate import SimBackend, chat_replay, simulate
    from loadtest.workloads import chat_trace
    from proxy.routing.settings import RouterSettings

    gguf = ensure_demo_model()
    kv = gguf_kv_bytes_per_token(gguf)
    if kv is None:
        raise ValueError(f"{gguf}: its metadata gives no KV size per token")
    w = chat_trace(path=cell.trace, requests=requests, rate=RATES.get(cell.trace, 2.0),
                   block=32, max_tokens=8, seed=cell.seed)
    trace, prompts, starts = chat_replay(w, gguf)
    be = SimBackend(n_slots=SLOTS, slot_ctx=SLOT_CTX, ram_cache_tokens=(cell.ram_mib << 20) // kv,
                    kv_bytes_per_token=kv, prefill_tps=cell.prefill_tps,
                    prefill_s_per_position=cell.per_position, decode_tps=DECODE_TPS,
                    prefill_noise=cell.noise)
    rows = []
    for spec in policies:
        policy, routing = policy_variant(spec)
        settings = RouterSettings(**{"default_prefill_tps": cell.prefill_tps, **routing})
        got = simulate(trace, policy, 2, be, settings=settings, seed=cell.seed,
                       prompts=prompts, user_starts=starts)
        rows.append(Row(cell, spec, got.hit_ratio, got.ttft_mean))
    return rows


def _ints(text: str) -> list[int]:
    """``"0-9"`` or ``"0,3,5"``."""
    lo, dash, hi = text.partition("-")
    return list(range(int(lo), int(hi) + 1)) if dash else [int(x) for x in text.split(",")]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policies", default="prefix",
                   help="comma-separated; one may carry routing settings: prefix[key=value]")
    p.add_argument("--reference", default="smg_like", help="the policy each is judged against")
    p.add_argument("--seeds", default="0-9", help="a range (0-9) or a list (0,3,5)")
    p.add_argument("--prefill-tps", default="1150,1300",
                   help="the servers' prefill rates at a context's start")
    p.add_argument("--prefill-s-per-position", type=float, default=5.2e-7,
                   help="a token's extra prefill seconds per token before it (attention)")
    p.add_argument("--prefill-noise", type=float, default=0.25,
                   help="sigma of a log-normal factor on each prefill's time (0: exact)")
    p.add_argument("--traces", default="conversation,synthetic")
    p.add_argument("--ram", default="128,32", help="MiB of RAM cache per backend")
    p.add_argument("--requests", type=int, default=200, help="whole groups sampled")
    p.add_argument("--jobs", type=int, default=1, help="cells simulated at once (processes)")
    p.add_argument("--out", help="also write every row here (JSON)")


def main_sweep(args: argparse.Namespace) -> int:
    policies = [*split_policies(args.policies), args.reference]
    grid = itertools.product([float(x) for x in args.prefill_tps.split(",")],
                             args.traces.split(","), _ints(args.ram), _ints(args.seeds))
    cells = [Cell(t, ram, seed, tps, args.prefill_s_per_position, args.prefill_noise)
             for tps, t, ram, seed in grid]
    rows: list[Row] = []
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(ProcessPoolExecutor(args.jobs)) if args.jobs > 1 else None
        for got in (pool.map if pool else map)(run_cell, cells, itertools.repeat(policies),
                                               itertools.repeat(args.requests)):
            for r in got:
                print(f"{r.cell.trace:12s} {r.cell.ram_mib:4d} MiB seed {r.cell.seed:3d} "
                      f"{r.cell.prefill_tps:6.0f} tok/s {r.policy}: reuse {r.reuse:.3f}, "
                      f"mean TTFT {r.ttft_mean:.2f} s", flush=True)
            rows += got
    if args.out:
        Path(args.out).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    verdicts = judge(rows, args.reference)
    print("", *(line for v in verdicts for line in v.lines()), sep="\n")
    return 0 if verdicts and not any(v.missed for v in verdicts) else 1
