"""`pip install .` outside the repo: the wheel carries what the code reads from beside
itself (the built-in config, the default trace, the chat templates)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_carries_the_package_data(tmp_path: Path) -> None:
    # this venv's build tools when it has them (no download), else pip's isolated ones
    have = all(importlib.util.find_spec(m) for m in ("setuptools", "wheel"))
    isolation = ["--no-build-isolation"] if have else []
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation,
                    "-w", str(tmp_path), str(ROOT)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("kvroute-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        # the built-in config is the shipped config.yaml itself (a link in the tree)
        assert z.read("proxy/config/default.yaml") == (ROOT / "config.yaml").read_bytes()
    assert "loadtest/traces/mooncake_synthetic_trace.jsonl" in names
    assert {n for n in names if n.startswith("backends/templates/")}
    assert not {n for n in names if n.startswith("tests/")}
