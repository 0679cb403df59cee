"""One managed backend's lifecycle (backends/managed.py) over its components, without a
Supervisor: a server that cannot start fails and says the fix; one that dies is taken
down, counted and restarted as a new process with a new key. Real processes:
tests/fake_backend.py run as the llama-server binary."""

from __future__ import annotations

import asyncio
import os
import shlex
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from faults import until
from procs import gone

from backends.config import ManagedBackendConfig, SupervisionConfig
from backends.info import BackendInfo
from backends.managed import Launcher, ManagedBackend
from backends.standing import Listeners

pytestmark = pytest.mark.timeout(60)

FAKE = Path(__file__).resolve().parents[1] / "fake_backend.py"
SUP = SupervisionConfig(startup_timeout_s=20, health_interval_s=0.1, restart_backoff_s=0.1,
                        stop_grace_s=2)


def managed(tmp_path: Path, model: Path
            ) -> tuple[ManagedBackend, list[tuple[str, BackendInfo | None]]]:
    cfg = ManagedBackendConfig(name="a", model=model, slots=1, ctx_per_slot=4096,
                               alias="kvroute-demo")
    b: ManagedBackend | None = None

    def statuses() -> list[dict[str, object]]:
        return [b.status()] if b is not None else []

    heard: list[tuple[str, BackendInfo | None]] = []
    listeners = Listeners(tmp_path / "backends.json", statuses)
    listeners.subscribe(lambda name, info: heard.append((name, info)))
    b = ManagedBackend(cfg, listeners, Launcher(cfg, "127.0.0.1", tmp_path / "a.log"), SUP)
    return b, heard


@pytest.mark.parametrize(("binary", "error"), [
    (None, "llama-server not found (fix: run `python -m backends prepare`"),
    (lambda tmp: tmp / "missing", "cannot start "),
])
async def test_a_server_that_cannot_start_fails_and_says_so(
        tmp_path: Path, demo_model: Path, binary: Callable[[Path], Path] | None,
        error: str) -> None:
    b, heard = managed(tmp_path, demo_model)
    async with aiohttp.ClientSession() as session:
        b.start(session, binary(tmp_path) if binary else None)
        await asyncio.wait_for(b.standing.settled(), 10)
        await b.stop()
    st: dict[str, Any] = b.status()
    assert st["state"] == "failed" and str(st["last_error"]).startswith(error), st
    assert (st["pid"], st["restarts"], st["log"], heard) == (None, 0, str(tmp_path / "a.log"),
                                                             [])


async def test_a_server_that_dies_is_restarted_anew(tmp_path: Path, demo_model: Path) -> None:
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} "
                      f"{shlex.quote(str(FAKE))} \"$@\"\n")
    binary.chmod(0o755)
    b, heard = managed(tmp_path, demo_model)
    async with aiohttp.ClientSession() as session:
        b.start(session, binary)
        try:
            await asyncio.wait_for(b.standing.settled(), 20)
            first, pid = b.standing.info, b.pid()
            assert first is not None and pid is not None and b.status()["state"] == "ready"
            os.kill(pid, signal.SIGKILL)
            await until(lambda: len(heard) == 3, 20)
            assert [info is None for _, info in heard] == [False, True, False]
            again = heard[-1][1]
            assert again is not None and again.api_key != first.api_key
            st = b.status()
            assert (st["state"], st["restarts"], st["crash_loop"]) == ("ready", 1, None)
            assert "killed by SIGKILL" in str(st["last_error"])
            assert b.pid() not in (None, pid) and gone(pid)
        finally:
            last = b.pid()
            await b.stop()
    assert last is not None and gone(last) and b.pid() is None
