"""What bench/gpu_check.sh prints from its runs: prefix against round_robin on each
workload (mean TTFT and reuse, as ratios), and the prefill rate the servers logged.

    python bench/gpu_report.py bench-out/gpu-check

The prefill rate is the median of the servers' own "prompt eval" lines for tasks of at
least `MIN_TOKENS` new tokens (shorter ones are dominated by fixed costs).
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

MIN_TOKENS = 1024
_EVAL = re.compile(r"prompt eval time =\s+([\d.]+) ms /\s+(\d+) tokens")


def runs(report: Path) -> dict[str, dict[str, Any]]:
    """A loadtest report's runs by policy."""
    return {r["policy"]: r for r in json.loads(report.read_text())["runs"]}


def prefill_rates(logs: Path) -> list[float]:
    """Tokens/s of each logged prefill of at least MIN_TOKENS new tokens."""
    out = []
    for log in logs.rglob("*.log"):
        for m in _EVAL.finditer(log.read_text(errors="replace")):
            ms, n = float(m[1]), int(m[2])
            if n >= MIN_TOKENS and ms > 0:
                out.append(n / ms * 1000)
    return out


def lines(out: Path) -> list[str]:
    got = []
    for name in ("agentic", "chat"):
        report = out / name / "report.json"
        if not report.is_file():
            got.append(f"{name}: no report at {report} (fix: run bench/gpu_check.sh)")
            continue
        r = runs(report)
        p, rr = r.get("prefix"), r.get("round_robin")
        if p is None or rr is None or not rr["ttft_mean"] or not rr["reused_ratio"]:
            got.append(f"{name}: prefix and round_robin runs with answers needed in {report}")
            continue
        got.append(f"{name}: mean TTFT prefix / round_robin = "
                   f"{p['ttft_mean'] / rr['ttft_mean']:.2f}x ({p['ttft_mean']:.3f} / "
                   f"{rr['ttft_mean']:.3f} s), reused {p['reused_ratio']:.3f} / "
                   f"{rr['reused_ratio']:.3f} = {p['reused_ratio'] / rr['reused_ratio']:.2f}x, "
                   f"predictions exact {p['prediction_exact']:.1%}")
    rates = prefill_rates(out)
    got.append(f"prefill: median {statistics.median(rates):,.0f} tokens/s over {len(rates)} "
               f"prompts of {MIN_TOKENS}+ new tokens" if rates
               else f"prefill: no prompt of {MIN_TOKENS}+ new tokens in the servers' logs")
    return got


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    for line in lines(Path(argv[0])):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
