"""bench/gpu_check.sh without a GPU: what it says is missing, the commands it would run
(parsed by the tools they call), and the report it prints from runs."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.__main__ import parser

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu_check.sh"
SMI_OK = "9.0\n9.0\n"


def fake_bin(tmp_path: Path, smi: str | None, nvcc: bool) -> dict[str, str]:
    """An environment whose PATH has a fake nvidia-smi (answering ``smi``; exit 1 when
    it starts with "!") and nvcc, and the basic tools; nothing of CUDA otherwise."""
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    for tool in ("bash", "seq", "head", "tr", "grep", "dirname", "env"):
        (d / tool).symlink_to(subprocess.run(["which", tool], capture_output=True,
                                             text=True, check=True).stdout.strip())
    if smi is not None:
        code = 1 if smi.startswith("!") else 0
        (d / "nvidia-smi").write_text(f"#!/bin/sh\nprintf '{smi.lstrip('!')}'\nexit {code}\n")
        (d / "nvidia-smi").chmod(0o755)
    if nvcc:
        (d / "nvcc").write_text("#!/bin/sh\nexit 0\n")
        (d / "nvcc").chmod(0o755)
    return {"PATH": str(d), "HOME": os.environ.get("HOME", "/root"), "CUDA_HOME": "/nowhere",
            "GPU_CHECK_DRY": "1"}


@pytest.mark.parametrize(("smi", "nvcc", "says"), [
    (None, True, "nvidia-smi not found (fix: install the NVIDIA driver"),
    ("!NVIDIA-SMI has failed", True, "nvidia-smi failed: NVIDIA-SMI has failed"),
    ("[N/A]\n", True, "no compute capability"),
    (SMI_OK, False, "nvcc not found (fix: install the CUDA Toolkit"),
])
def test_what_is_missing_is_named_with_its_fix(tmp_path: Path, smi: str | None, nvcc: bool,
                                               says: str) -> None:
    if not nvcc and Path("/usr/local/cuda/bin/nvcc").exists():
        pytest.skip("this machine has /usr/local/cuda/bin/nvcc, where the script looks")
    r = subprocess.run(["bash", str(SCRIPT)], env=fake_bin(tmp_path, smi, nvcc),
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and says in r.stderr, r.stderr


def test_the_commands_it_runs_build_for_this_gpu_and_parse(tmp_path: Path) -> None:
    if (REPO / ".venv" / "bin" / "python").exists() is False:
        pytest.skip("no .venv in this checkout: the script needs it")
    r = subprocess.run(["bash", str(SCRIPT)], env=fake_bin(tmp_path, SMI_OK, True),
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert "2 GPU(s), compute capability 90: building for CUDAARCHS=90" in r.stderr
    cmds = [shlex.split(line[2:]) for line in r.stdout.splitlines() if line.startswith("+ ")]
    assert [c[1:3] for c in cmds] == [
        ["-m", "backends"], ["-m", "loadtest"], ["-m", "loadtest"],
        ["bench/gpu_report.py", "bench-out/gpu-check"]]
    assert cmds[0][3:] == ["prepare", "--gpu", "cuda"]
    for c in cmds[1:3]:
        args = parser().parse_args(c[3:])
        assert (args.devices, args.backends) == ("0,1", 2)
        assert args.policies == "prefix,round_robin"


def report(path: Path, ttft: tuple[float, float], reused: tuple[float, float]) -> None:
    path.mkdir(parents=True)
    runs = [{"policy": p, "ttft_mean": t, "reused_ratio": u, "prediction_exact": 1.0}
            for p, t, u in zip(("prefix", "round_robin"), ttft, reused, strict=True)]
    (path / "report.json").write_text(json.dumps({"runs": runs}))


def test_the_report_gives_the_ratios_and_the_prefill_rate(tmp_path: Path) -> None:
    report(tmp_path / "agentic", (0.5, 2.0), (0.8, 0.2))
    report(tmp_path / "chat", (0.9, 1.0), (0.3, 0.25))
    logs = tmp_path / "chat" / "runs" / "logs" / "prefix"
    logs.mkdir(parents=True)
    (logs / "a.log").write_text(
        "slot print_timing: id  0 | task 3 | prompt eval time =     100.00 ms /  4000 tokens\n"
        "slot print_timing: id  0 | task 4 | prompt eval time =      10.00 ms /    40 tokens\n"
        "slot print_timing: id  1 | task 5 | prompt eval time =     200.00 ms / 10000 tokens\n")
    r = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_report.py"), str(tmp_path)],
                       capture_output=True, text=True, timeout=30, check=True)
    out = r.stdout.splitlines()
    assert out[0].startswith("agentic: mean TTFT prefix / round_robin = 0.25x")
    assert "reused 0.800 / 0.200 = 4.00x" in out[0]
    assert out[1].startswith("chat: mean TTFT prefix / round_robin = 0.90x")
    assert out[2] == "prefill: median 45,000 tokens/s over 2 prompts of 1024+ new tokens"
