"""The simulated smg matrix: its verdicts on the live matrix's targets, and its command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.__main__ import main
from loadtest.sweep import Cell, Row, judge, meets


@pytest.mark.parametrize(("ram", "reuse", "ttft", "ok"), [
    (128, 1.0, 0.9, True),     # on both targets
    (128, 0.99, 0.5, False),   # less reuse than the reference
    (128, 1.5, 0.91, False),   # slower
    (32, 1.2, 0.8, True),
    (32, 1.19, 0.5, False),    # the tight tier asks for a fifth more
    (32, 2.0, 0.81, False),
    (64, 1.0, 1.0, True),      # a tier without targets: no worse
    (64, 1.0, 1.01, False),
])
def test_a_cell_meets_its_tiers_targets(ram: int, reuse: float, ttft: float,
                                        ok: bool) -> None:
    assert meets(ram, reuse, ttft) is ok


def _rows(*spec: tuple[str, int, int, str, float, float]) -> list[Row]:
    return [Row(Cell(trace, ram, seed, 750.0), policy, reuse, ttft)
            for trace, ram, seed, policy, reuse, ttft in spec]


def test_judge_pairs_each_policy_with_the_reference_cell_by_cell() -> None:
    rows = _rows(
        ("conv", 128, 0, "prefix", 0.50, 1.0), ("conv", 128, 0, "ref", 0.50, 2.0),
        ("conv", 32, 0, "prefix", 0.30, 1.0), ("conv", 32, 0, "ref", 0.27, 2.0),
        ("conv", 32, 1, "prefix", 0.30, 1.0),  # no reference here: not judged
        ("conv", 32, 2, "prefix", 0.10, 1.0), ("conv", 32, 2, "ref", 0.0, 2.0),  # nothing
        ("conv", 128, 0, "other", 0.60, 1.9),  # to compare with: not judged
    )
    prefix, other = judge(rows, "ref")
    assert prefix.policy == "prefix" and other.policy == "other"
    assert prefix.cells == (Cell("conv", 128, 0, 750.0), Cell("conv", 32, 0, 750.0))
    assert prefix.reuse_ratios == pytest.approx((1.0, 0.30 / 0.27))
    assert prefix.ttft_ratios == pytest.approx((0.5, 0.5))
    assert [c for c, _, _ in prefix.missed] == [Cell("conv", 32, 0, 750.0)]  # 1.11x < 1.2x
    assert other.missed[0][1:] == pytest.approx((1.2, 0.95))  # more reuse, too slow
    assert prefix.lines()[0].startswith("prefix: met 1 of 2")
    assert "missed conv 32 MiB seed 0 at 750 tok/s: reuse 1.11x" in prefix.lines()[1]
    assert judge(_rows(("conv", 32, 0, "prefix", 0.3, 1.0)), "ref") == []


def test_the_sweep_command_simulates_every_cell_and_judges_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rows.json"
    rc = main(["sweep", "--seeds", "0-1", "--traces", "synthetic", "--ram", "128,32",
               "--requests", "12", "--prefill-tps", "750", "--policies",
               "prefix,round_robin", "--out", str(out)])
    rows = json.loads(out.read_text())
    assert len(rows) == 2 * 2 * 3  # seeds x RAM tiers x (two policies and smg_like)
    assert {r["policy"] for r in rows} == {"prefix", "round_robin", "smg_like"}
    assert all(0.0 <= r["reuse"] <= 1.0 and r["ttft_mean"] > 0 for r in rows)
    text = capsys.readouterr().out
    verdicts = [line for line in text.splitlines() if " of 4; reuse vs reference" in line]
    assert [v.split(":")[0] for v in verdicts] == ["prefix", "round_robin"]
    assert rc == (1 if "  missed " in text else 0)
