"""`pip install .` outside the repo: the wheel carries what the code reads from beside
itself (the built-in config, the default trace, the chat templates), declares matplotlib
and the dev tools as extras only, and runs from a fresh venv in a directory that is not
the repo."""

from __future__ import annotations

import email
import importlib.util
import json
import os
import re
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # this venv's build tools when it has them (no download), else pip's isolated ones
    have = all(importlib.util.find_spec(m) for m in ("setuptools", "wheel"))
    isolation = ["--no-build-isolation"] if have else []
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation,
                    "-w", str(out), str(ROOT)],
                   check=True, capture_output=True, timeout=300)
    (built,) = out.glob("kvroute-*.whl")
    return built


def test_wheel_carries_the_package_data(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        # the built-in config is the shipped config.yaml itself (a link in the tree)
        assert z.read("proxy/config/default.yaml") == (ROOT / "config.yaml").read_bytes()
        (meta,) = (n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = email.message_from_bytes(z.read(meta))
    assert "loadtest/traces/mooncake_synthetic_trace.jsonl" in names
    assert "backends/templates/chatml-tools.jinja" in names
    assert {"proxy/server/static/status.html", "proxy/server/static/status.js",
            "proxy/server/static/status.css"} <= names  # the status page (status_page.py)
    assert not {n for n in names if n.startswith("tests/")}

    # a plain install pulls neither matplotlib nor any dev tool: they are extras
    requires = metadata.get_all("Requires-Dist") or []
    unconditional = {re.match(r"[A-Za-z0-9_.-]+", r)[0].lower()  # type: ignore[index]
                     for r in requires if "extra ==" not in r}
    assert {"aiohttp", "llama-cpp-python", "pyyaml"} <= unconditional
    for tool in ("matplotlib", "pytest", "ruff", "hypothesis", "openai", "anthropic"):
        assert tool not in unconditional, f"{tool} is a run-time dependency"
    assert any(r.startswith("matplotlib") and 'extra == "plots"' in r for r in requires)
    assert set(metadata.get_all("Provides-Extra") or []) >= {"plots", "dev"}


def _fresh_venv(where: Path, wheel: Path) -> Path:
    """A venv holding the wheel only; the run-time dependencies come from this venv's
    site-packages through a .pth line (compiling llama-cpp-python again takes minutes).
    Python does not read the .pth files of a directory a .pth line adds, so this venv's
    editable kvroute stays out and the wheel's modules are the ones imported."""
    venv = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)],
                   check=True, timeout=60)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                    "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True, timeout=120)
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; "
                                "print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "zz_runtime_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


def test_wheel_runs_outside_the_repo(wheel: Path, tmp_path: Path) -> None:
    venv = _fresh_venv(tmp_path, wheel)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "KVROUTE_CONFIG")}

    def run(*cmd: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(cmd, cwd=elsewhere, env=env, capture_output=True, text=True,
                              timeout=120, check=False)

    python, kvroute = str(venv / "bin" / "python"), str(venv / "bin" / "kvroute")
    where = run(python, "-c", "import backends, loadtest, proxy; "
                "print(proxy.__file__, backends.__file__, loadtest.__file__)")
    assert where.returncode == 0, where.stderr
    assert all(p.startswith(str(venv)) for p in where.stdout.split()), where.stdout

    helped = run(kvroute, "--help")
    assert helped.returncode == 0 and "serve" in helped.stdout and "doctor" in helped.stdout

    # no ./config.yaml here: the built-in default (package data) is checked; the exit
    # code is left alone (the default port may be taken on this machine)
    doctor = run(kvroute, "doctor", "--json")
    report = json.loads(doctor.stdout)
    assert report["config"]["ok"], report["config"]
    assert report["config"]["path"] is None
    assert report["kvroute_version"] == "0.1.0"

    # the default trace is package data
    sim = run(python, "-m", "loadtest", "simulate", "--limit", "40", "--backends", "2",
              "--policies", "prefix")
    assert sim.returncode == 0, sim.stderr
    assert "40 requests, 2 backends" in sim.stdout

    # without matplotlib (the `plots` extra) a report says how to get plots, and works
    no_plots = run(python, "-c", "import sys; sys.modules['matplotlib'] = None\n"
                   "from pathlib import Path\nfrom loadtest.report import plots\n"
                   "print(plots(Path('.'), []))")
    assert no_plots.returncode == 0, no_plots.stderr
    assert no_plots.stdout.strip() == "[]"
    assert "pip install 'kvroute[plots]'" in no_plots.stderr
