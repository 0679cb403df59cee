"""Summaries of policy runs, written as report.md, report.json and PNG plots.

Reused-token ratio = backend-reported reused tokens / prompt tokens, summed over the
requests that reported both. Per-backend load over time is the number of the client's
requests in flight on each backend (from kvroute's X-Kvroute-Backend header), so it needs
no polling and means the same for every policy.
"""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loadtest.bounds import Bounds
from loadtest.client import Result, RunOutcome

if TYPE_CHECKING:
    from loadtest.workloads import Workload



@dataclass
class PolicyRun:
    policy: str  # prefix | round_robin | ... | direct | target
    rate: float | None
    outcome: RunOutcome
    metrics: dict[str, Any] = field(default_factory=dict)  # scraped from kvroute /metrics
    startup_s: float = 0.0
    servers: dict[str, float] = field(default_factory=dict)  # the fresh servers' prefill


def pct(xs: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))]


def label(run: PolicyRun) -> str:
    return run.policy + (f" @{run.rate:g}/s" if run.rate is not None else "")


def reuse(results: Sequence[Result]) -> float | None:
    pairs = [(r.cached_tokens, r.prompt_tokens) for r in results
             if r.ok and r.cached_tokens is not None and r.prompt_tokens]
    total = sum(p for _, p in pairs)
    return sum(c for c, _ in pairs) / total if total else None


def mispredicted(r: Result) -> bool | None:
    """Was the router's prediction off by more than max(16 tokens, 2% of the prompt)?
    None: nothing to compare (no prediction, or no report)."""
    if r.predicted_cached is None or r.cached_tokens is None or not r.ok:
        return None
    return abs(r.predicted_cached - r.cached_tokens) > max(16, 0.02 * (r.prompt_tokens or 0))


def fidelity(results: Sequence[Result]) -> tuple[float | None, dict[str, int]]:
    """Share of predicted requests within the tolerance, and the others by class:
    the tier predicted, and whether the server reused more (under) or less (over)."""
    flags = [(r, m) for r in results if (m := mispredicted(r)) is not None]
    classes: dict[str, int] = defaultdict(int)
    for r, m in flags:
        if m:
            side = "under" if (r.cached_tokens or 0) > (r.predicted_cached or 0) else "over"
            classes[f"{r.predicted_tier or '?'}/{side}"] += 1
    exact = sum(not m for _, m in flags) / len(flags) if flags else None
    return exact, dict(sorted(classes.items()))


def summarize(run: PolicyRun) -> dict[str, Any]:
    res = run.outcome.results
    ok = [r for r in res if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s for r in ok]
    wall = run.outcome.wall_s
    per_backend: dict[str, int] = defaultdict(int)
    for r in ok:
        per_backend[r.backend or "?"] += 1
    errs = [abs(r.predicted_cached - r.cached_tokens) for r in ok
            if r.predicted_cached is not None and r.cached_tokens is not None]
    exact, classes = fidelity(ok)
    by_turn: dict[int, list[Result]] = defaultdict(list)
    for r in ok:
        by_turn[r.turn].append(r)
    return {
        "label": label(run), "policy": run.policy, "rate": run.rate,
        "requests": len(res), "ok": len(ok), "errors": len(res) - len(ok),
        "cut": run.outcome.cut, "skipped": run.outcome.skipped,
        "first_errors": sorted({r.error or "" for r in res if not r.ok})[:3],
        "ttft_mean": sum(ttft) / len(ttft) if ttft else None,
        "ttft_p50": pct(ttft, 50), "ttft_p90": pct(ttft, 90), "ttft_p99": pct(ttft, 99),
        "e2e_p50": pct(e2e, 50), "e2e_p90": pct(e2e, 90), "e2e_p99": pct(e2e, 99),
        "throughput_rps": len(ok) / wall if wall else None,
        "prompt_tps": sum(r.prompt_tokens or 0 for r in ok) / wall if wall else None,
        "reused_ratio": reuse(ok),
        "reused_ratio_per_turn": {t: reuse(rs) for t, rs in sorted(by_turn.items())},
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "reused_tokens": sum(r.cached_tokens or 0 for r in ok),
        "requests_per_backend": dict(sorted(per_backend.items())),
        "prediction_error_mean": sum(errs) / len(errs) if errs else None,
        "prediction_exact": exact, "mispredicted": classes,
        "kvroute_metrics": run.metrics, "servers": run.servers,
        "wall_s": wall, "startup_s": run.startup_s,
    }


def _f(v: object, fmt: str = "{:.3f}") -> str:
    return "-" if v is None else fmt.format(v)


def _pc(v: object) -> str:
    return "-" if v is None else f"{100 * float(v):.1f}%"  # type: ignore[arg-type]


_COLUMNS = ("run", "ok/sent", "TTFT mean", "p50", "p90", "p99", "e2e p50", "p90", "req/s",
            "reused", "pred. err (tok)", "pred. exact", "requests per backend")


def _rows(summaries: Sequence[dict[str, Any]]) -> list[list[str]]:
    return [[s["label"], f"{s['ok']}/{s['requests']}", _f(s["ttft_mean"]), _f(s["ttft_p50"]),
             _f(s["ttft_p90"]), _f(s["ttft_p99"]), _f(s["e2e_p50"]), _f(s["e2e_p90"]),
             _f(s["throughput_rps"], "{:.2f}"), _pc(s["reused_ratio"]),
             _f(s["prediction_error_mean"], "{:.0f}"), _pc(s["prediction_exact"]),
             " ".join(f"{k}:{v}" for k, v in s["requests_per_backend"].items())]
            for s in summaries]


def _md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


_BOUND = "capacity estimate (these servers' slots and RAM, clairvoyant, one pool)"
_LRU = "LRU estimate (the same memory, least recently used dropped first, as the servers do)"


def console_table(runs: Sequence[PolicyRun], oracle: float | None,
                  bounds: Bounds | None = None) -> str:
    rows = [list(_COLUMNS), *_rows([summarize(r) for r in runs])]
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    if oracle is not None:
        lines.append(f"oracle reused ratio (unbounded cache, perfect routing): {_pc(oracle)}")
    if bounds is not None:
        lines += [f"{_BOUND}: {_pc(bounds.capacity)}", f"{_LRU}: {_pc(bounds.lru)}"]
    return "\n".join(lines)


def _markdown(summaries: list[dict[str, Any]], workload: Workload, args: dict[str, Any],
              plots: list[str], bounds: Bounds | None) -> str:
    md = [f"# Load test: {workload.name}", "",
          f"workload fingerprint `{workload.fingerprint()}`, "
          f"{len(workload.requests())} requests in {len(workload.sessions)} sessions; "
          f"TTFT and latency in seconds, client-measured; reused = backend-reported "
          f"reused / prompt tokens.", ""]
    if workload.oracle_reuse is not None:
        md += [f"Trace oracle reused ratio (unbounded cache, perfect routing): "
               f"**{_pc(workload.oracle_reuse)}**", ""]
    if bounds is not None:
        md += [f"Trace {_BOUND}: **{_pc(bounds.capacity)}**", "",
               f"Trace {_LRU}: **{_pc(bounds.lru)}**", ""]
    md += [_md_table(_COLUMNS, _rows(summaries)), ""]
    turns = sorted({t for s in summaries for t in s["reused_ratio_per_turn"]})
    if 1 < len(turns) <= 40:
        md += ["## Reused-token ratio per turn", "",
               _md_table(["run", *map(str, turns)],
                         [[s["label"], *(_pc(s["reused_ratio_per_turn"].get(t)) for t in turns)]
                          for s in summaries]), ""]
    rates = sorted({s["rate"] for s in summaries if s["rate"] is not None})
    if len(rates) > 1:
        pols = list(dict.fromkeys(s["policy"] for s in summaries))
        cell = {(s["policy"], s["rate"]): s for s in summaries}
        md += ["## Sweep: TTFT p50 / p90 (s) by arrival rate", "",
               _md_table(["rate /s", *pols],
                         [[f"{r:g}", *(f"{_f(cell[p, r]['ttft_p50'])} / "
                                       f"{_f(cell[p, r]['ttft_p90'])}" if (p, r) in cell
                                       else "-" for p in pols)] for r in rates]), ""]
    off = [(s["label"], c, n) for s in summaries for c, n in s["mispredicted"].items()]
    if off:
        md += ["## Mispredicted (off by more than max(16, 2%)): predicted tier / side", "",
               *(f"- {lb}: {c}: {n}" for lb, c, n in off), ""]
    errs = [(s["label"], e) for s in summaries for e in s["first_errors"]]
    if errs:
        md += ["## Errors (first of each run)", "", *(f"- {lb}: `{e}`" for lb, e in errs), ""]
    md += ["## Plots", "", *(f"![{p}]({p})" for p in plots)] if plots else [
        "No plots: written when every run has finished, and only with matplotlib "
        "(`pip install 'kvroute[plots]'`)."]
    md += ["", "## Arguments", "", "```", json.dumps(args, indent=1, default=str), "```", ""]
    return "\n".join(md)


def plots(out: Path, runs: Sequence[PolicyRun]) -> list[str]:
    """Write the PNGs; [] (and a note on stderr) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("loadtest: matplotlib not installed, skipping plots "
              "(pip install 'kvroute[plots]')", file=sys.stderr)
        return []
    names: list[str] = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        xs = sorted(r.ttft_s for r in run.outcome.results if r.ok and r.ttft_s is not None)
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post",
                    label=label(run))
    ax.set(xscale="log", xlabel="TTFT (s)", ylabel="fraction of requests", title="TTFT CDF")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "ttft_cdf.png", dpi=100)
    names.append("ttft_cdf.png")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        per = summarize(run)["reused_ratio_per_turn"]
        pts = [(t, v) for t, v in per.items() if v is not None]
        if pts:
            ax.plot([t for t, _ in pts], [100 * v for _, v in pts], marker="o", label=label(run))
    ax.set(xlabel="turn (trace: request index within its prefix group)",
           ylabel="reused tokens (%)", ylim=(0, 100), title="Reused-token ratio per turn")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "reuse_per_turn.png", dpi=100)
    names.append("reuse_per_turn.png")
    plt.close(fig)

    fig, axes = plt.subplots(len(runs), 1, figsize=(7, 1.8 * len(runs) + 0.6), sharex=True,
                             squeeze=False)
    for ax, run in zip(axes[:, 0], runs, strict=True):
        for backend, (ts, ys) in sorted(_in_flight(run.outcome.results).items()):
            ax.step(ts, ys, where="post", label=backend)
        ax.set_ylabel("in flight", fontsize=8)
        ax.set_title(label(run), fontsize=9)
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("time since start (s)")
    fig.tight_layout()
    fig.savefig(out / "backend_load.png", dpi=100)
    names.append("backend_load.png")
    plt.close(fig)

    rates = sorted({r.rate for r in runs if r.rate is not None})
    if len(rates) > 1:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for pol in dict.fromkeys(r.policy for r in runs):
            pts = [(r.rate, summarize(r)) for r in runs if r.policy == pol]
            for q, style in (("ttft_p50", "-o"), ("ttft_p90", "--x")):
                ax.plot([x for x, _ in pts], [s[q] or math.nan for _, s in pts], style,
                        label=f"{pol} {q[-3:]}")
        ax.set(yscale="log", xlabel="arrival rate (/s)", ylabel="TTFT (s)",
               title="TTFT vs arrival rate")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "sweep_ttft.png", dpi=100)
        names.append("sweep_ttft.png")
        plt.close(fig)
    return names


def _in_flight(results: Sequence[Result]) -> dict[str, tuple[list[float], list[int]]]:
    events: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for r in results:
        b = r.backend or "?"
        events[b] += [(r.sent_s, 1), (r.sent_s + r.e2e_s, -1)]
    out = {}
    for b, ev in events.items():
        ev.sort()
        ts, ys, n = [0.0], [0], 0
        for t, d in ev:
            n += d
            ts.append(t)
            ys.append(n)
        out[b] = (ts, ys)
    return out


def write(out: Path, runs: Sequence[PolicyRun], workload: Workload,
          args: dict[str, Any], with_plots: bool = True,
          bounds: Bounds | None = None) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    summaries = [summarize(r) for r in runs]
    images = plots(out, runs) if with_plots else []
    doc = {"workload": {"name": workload.name, "fingerprint": workload.fingerprint(),
                        "requests": len(workload.requests()),
                        "sessions": len(workload.sessions), "params": workload.params,
                        "oracle_reuse": workload.oracle_reuse,
                        "capacity_estimate": bounds and bounds.capacity,
                        "lru_estimate": bounds and bounds.lru},
           "args": args, "runs": summaries,
           "requests": {s["label"]: [r.to_dict() for r in run.outcome.results]
                        for s, run in zip(summaries, runs, strict=True)}}
    (out / "report.json").write_text(json.dumps(doc, indent=1, default=str))
    (out / "report.md").write_text(_markdown(summaries, workload, args, images, bounds))
    return [out / "report.md", out / "report.json", *(out / p for p in images)]
