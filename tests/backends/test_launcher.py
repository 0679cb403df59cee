"""One managed backend's processes (Launcher, backends/managed.py), against real processes:
tests/fake_backend.py run as the llama-server binary (quick to start; a real SIGSEGV while
a marker file exists). Each start is a new process with a new key, kept out of its
command line; `end()` says how the process died, as the crash loop counts deaths."""

from __future__ import annotations

import asyncio
import os
import shlex
import signal
import sys
import time
from pathlib import Path

import pytest
from procs import gone, healthy

from backends.config import ManagedBackendConfig
from backends.managed import Launcher

pytestmark = pytest.mark.timeout(60)

FAKE = Path(__file__).resolve().parents[1] / "fake_backend.py"


def fake_binary(tmp_path: Path) -> Path:
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} "
                      f"{shlex.quote(str(FAKE))} \"$@\"\n")
    binary.chmod(0o755)
    return binary


def launcher(tmp_path: Path, save: Path | None = None) -> Launcher:
    cfg = ManagedBackendConfig(
        name="a", model=tmp_path / "m.gguf", slots=1, ctx_per_slot=4096, alias="kvroute-demo",
        extra_args=("--no-warmup",),
        env={"KVROUTE_FAKE_SEGV_FILE": str(tmp_path / "segv"), "KVROUTE_FAKE_SEGV_AFTER_S": "0"})
    return Launcher(cfg, "127.0.0.1", tmp_path / "a.log", save)


async def up(url: str) -> None:
    deadline = time.monotonic() + 20
    while not await asyncio.to_thread(healthy, url):
        assert time.monotonic() < deadline, f"{url} not up"
        await asyncio.sleep(0.05)


async def test_each_start_is_a_new_process_with_a_new_key_out_of_its_argv(
        tmp_path: Path) -> None:
    binary = fake_binary(tmp_path)
    la = launcher(tmp_path, save=tmp_path / "slots")
    assert la.pid() is None
    keys = []
    for _ in range(2):
        proc = la.next(binary)
        spec = proc.spec
        assert spec.api_key and spec.api_key not in keys
        keys.append(spec.api_key)
        argv = spec.argv()
        assert argv[0] == str(binary) and argv[argv.index("--port") + 1] == str(spec.port)
        assert "--no-warmup" in argv and argv[argv.index("--slot-save-path") + 1] == str(
            tmp_path / "slots")
        proc.spawn()
        await up(spec.url)
        pid = la.pid()
        assert pid == proc.pid
        with open(f"/proc/{pid}/environ", "rb") as fh:
            assert f"LLAMA_API_KEY={spec.api_key}".encode() in fh.read().split(b"\0")
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            assert spec.api_key.encode() not in fh.read()
        await la.end("stopped", grace=5)
        assert la.pid() is None and gone(pid)
    assert (tmp_path / "a.log").read_text().count("=== kvroute:") == 2  # one log for both


@pytest.mark.parametrize(("how", "by_itself", "sig", "what"), [
    ("segv", True, "SIGSEGV", "killed by SIGSEGV"),
    ("kill", True, "SIGKILL", "killed by SIGKILL"),
    ("ours", False, None, "/health failed 5 times in a row"),  # (the supervisor's reason)
])
async def test_end_says_how_the_process_died(tmp_path: Path, how: str, by_itself: bool,
                                             sig: str | None, what: str) -> None:
    la = launcher(tmp_path)
    proc = la.next(fake_binary(tmp_path))
    proc.spawn()
    await up(proc.spec.url)
    if how == "segv":
        (tmp_path / "segv").touch()
    elif how == "kill":
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGKILL)
    if by_itself:
        while not proc.exited():
            await asyncio.sleep(0.05)
    death = await la.end("/health failed 5 times in a row", grace=5)
    assert (death.by_itself, death.signal, death.what()) == (by_itself, sig, what)
    assert death.log == str(tmp_path / "a.log") and death.model == str(tmp_path / "m.gguf")
    assert death.argv == tuple(proc.spec.argv())
    assert any("server is listening" in line for line in death.log_tail), death.log_tail
    if how == "segv":
        assert "SIGSEGV on demand" in death.log_tail[-1]


async def test_stop_ends_the_current_process_if_any(tmp_path: Path) -> None:
    la = launcher(tmp_path)
    await la.stop(grace=1)  # none yet: nothing to do
    proc = la.next(fake_binary(tmp_path))
    proc.spawn()
    await up(proc.spec.url)
    pid = proc.pid
    await la.stop(grace=5)
    assert pid is not None and gone(pid) and la.pid() is None
