"""kvroute beside smg on real servers: both chat replays, RAM 32 and 128 MiB, N runs each.

Each cell is one `python -m loadtest run` (fresh external llama-servers per router, the
same seeded requests to both, the router run first alternating with the seed), repeated
``--runs`` times with a new seed per run, so a claim holds on more than one sample of
the trace. The synthetic trace is the one the
routing was developed on; the conversation trace (real chat sessions) is the held-out
check. ``--disk`` adds a managed run with the disk tier per trace (smg has none): its
reuse against the workload's oracle.

Prints one line per run with the ratios, each router's servers' prefill throughput
(their /metrics: lower on a slowed machine, and after longer reused prefixes), and
whether each target holds:
RAM 128 MiB reuse >= smg and mean TTFT <= 0.9x; RAM 32 MiB reuse >= 1.2x smg and mean
TTFT <= 0.8x; disk reuse >= 0.9x the oracle. A run already in ``--out`` is read, not
repeated (an interrupted matrix resumes).

Run: ``python bench/bench_vs_smg.py --smg /path/to/smg [--runs 3] [--disk]``
(smg: ``pip install smg`` in a venv of its own; never a dependency of kvroute).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loadtest.sweep import RATES, TARGETS, meets  # noqa: E402  (the simulated matrix's too)

DISK_TARGET = 0.9  # reuse / oracle


def _run(out: Path, trace: str, ram: int, seed: int, args: argparse.Namespace,
         disk: bool) -> dict[str, Any]:
    report = out / "report.json"
    if not report.is_file():
        cmd = [sys.executable, "-m", "loadtest", "run", "--workload", "chat-trace",
               "--trace", trace, "--requests", str(args.requests),
               "--rate", str(RATES.get(trace, 2.0)), "--seed", str(seed),
               "--cache-ram-mib", str(ram), "--ctx", "16384", "--max-tokens", "8",
               "--out", str(out)]
        # which router runs first alternates with the seed: over an even number of
        # runs, a machine that slows down or speeds up over a cell favours neither
        order = "prefix,smg:cache_aware" if seed % 2 == 0 else "smg:cache_aware,prefix"
        cmd += (["--kv-disk", "--policies", "prefix"] if disk else
                ["--external", "--policies", order, "--smg", args.smg])
        subprocess.run(cmd, cwd=ROOT, check=True)
    return json.loads(report.read_text())


def _by_policy(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["policy"]: r for r in doc["runs"]}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _tps(run: dict[str, Any]) -> str:
    """The prefill throughput of that run's servers (loadtest/launch.py)."""
    tps = run.get("servers", {}).get("prefill_tps")
    return f"{tps:.0f}" if tps else "-"


def _line(trace: str, ram: int, seed: int, doc: dict[str, Any]) -> tuple[str, bool]:
    runs = _by_policy(doc)
    k, s = runs["prefix"], runs["smg:cache_aware"]
    reuse = _ratio(k["reused_ratio"], s["reused_ratio"])
    ttft = _ratio(k["ttft_mean"], s["ttft_mean"])
    want_reuse, want_ttft = TARGETS.get(ram, (1.0, 1.0))
    ok = (reuse is not None and ttft is not None and meets(ram, reuse, ttft)
          and k["ok"] == k["requests"])
    lru = doc["workload"].get("lru_estimate")  # (what the servers' eviction allows)
    return (f"{trace:12s} {ram:4d} MiB seed {seed}: reused {k['reused_ratio']:.3f} / "
            f"{s['reused_ratio']:.3f} = {reuse:.2f}x (>= {want_reuse})"
            f"{f', LRU estimate {lru:.3f}' if lru is not None else ''}, mean TTFT "
            f"{k['ttft_mean']:.2f} / {s['ttft_mean']:.2f} s = {ttft:.2f}x (<= {want_ttft}), "
            f"p90 {k['ttft_p90']:.2f} / {s['ttft_p90']:.2f} s, exact "
            f"{k['prediction_exact']:.3f}, ok {k['ok']}/{k['requests']}, servers' prefill "
            f"{_tps(k)} / {_tps(s)} tok/s: "
            f"{'met' if ok else 'MISSED'}"), ok


def _disk_line(trace: str, ram: int, seed: int, doc: dict[str, Any]) -> tuple[str, bool]:
    k = _by_policy(doc)["prefix"]
    oracle = doc["workload"]["oracle_reuse"]
    got = _ratio(k["reused_ratio"], oracle)
    ok = got is not None and got >= DISK_TARGET
    return (f"{trace:12s} {ram:4d} MiB + disk seed {seed}: reused {k['reused_ratio']:.3f}, "
            f"oracle {oracle:.3f} = {got:.2f}x (>= {DISK_TARGET}), mean TTFT "
            f"{k['ttft_mean']:.2f} s: {'met' if ok else 'MISSED'}"), ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smg", required=True, help="smg binary (its own venv)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--traces", default="synthetic,conversation")
    p.add_argument("--ram", default="32,128", help="MiB of --cache-ram per server")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--disk", action="store_true", help="also a disk-tier run per trace")
    p.add_argument("--out", default="bench-out/vs-smg")
    args = p.parse_args()
    lines, met = [], True
    for i in range(args.runs):
        for trace in args.traces.split(","):
            for ram in (int(x) for x in args.ram.split(",")):
                doc = _run(Path(args.out) / f"{trace}-{ram}-{i}", trace, ram, i, args, False)
                line, ok = _line(trace, ram, i, doc)
                print(line, flush=True)
                lines.append(line)
                met &= ok
            if args.disk:
                doc = _run(Path(args.out) / f"{trace}-32-disk-{i}", trace, 32, i, args, True)
                line, ok = _disk_line(trace, 32, i, doc)
                print(line, flush=True)
                lines.append(line)
                met &= ok
    print("\n".join(["", *lines, f"every run met its targets: {'yes' if met else 'NO'}"]))
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
