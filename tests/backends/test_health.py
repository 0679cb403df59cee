"""Whether a managed server is up (backends/health.py): the count of failed probes,
table-driven; liveness against a real server (tests/fake_backend.py, sick on demand); and
readiness against real processes (the fake run as the llama-server binary, and servers
that die or never answer)."""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from fake_backend import FakeBackend

from backends import health
from backends.config import ManagedBackendConfig, SupervisionConfig
from backends.health import UNHEALTHY_PROBES, HealthCheck, Liveness
from backends.info import BackendInfo
from backends.process import LlamaServerProcess, ServerSpec, free_port

pytestmark = pytest.mark.timeout(60)

FAKE = Path(__file__).resolve().parents[1] / "fake_backend.py"
SUP = SupervisionConfig(startup_timeout_s=20, health_interval_s=0.05)


@pytest.mark.parametrize(("probes", "unwell_at"), [
    ([True] * 10, None),
    ([False] * UNHEALTHY_PROBES, UNHEALTHY_PROBES - 1),
    ([False] * (UNHEALTHY_PROBES - 1) + [True] + [False] * (UNHEALTHY_PROBES - 1), None),
    ([True, *[False] * (UNHEALTHY_PROBES + 2)], UNHEALTHY_PROBES),
    ([False, True, *[False] * UNHEALTHY_PROBES], UNHEALTHY_PROBES + 1),  # a good one resets
])
def test_liveness_is_failures_in_a_row(probes: list[bool], unwell_at: int | None) -> None:
    live = Liveness()
    got = [i for i, ok in enumerate(probes) if live.probed(ok)]
    assert got[:1] == ([] if unwell_at is None else [unwell_at])


class Process:
    """A process as watch() sees it, which exits when told."""

    def __init__(self) -> None:
        self.gone = False

    def exited(self) -> bool:
        return self.gone


@pytest.mark.parametrize(("mode", "exits", "for_s", "why"), [
    ("ok", False, 1.0, None),  # it lasted
    ("sick", False, None, f"/health failed {UNHEALTHY_PROBES} times in a row "
                          "(Health(ok=False, status=503))"),
    ("ok", True, None, "llama-server exited"),
    # (no answer: each probe times out, shortened here)
    ("hang", False, None, f"/health failed {UNHEALTHY_PROBES} times in a row (BackendDown("),
])
async def test_watch_says_why_a_server_stopped_being_usable(
        monkeypatch: pytest.MonkeyPatch, mode: str, exits: bool, for_s: float | None,
        why: str | None) -> None:
    monkeypatch.setattr(health, "PROBE_TIMEOUT_S", 0.1)
    fake = FakeBackend()
    url = await fake.start()
    fake.mode = mode
    proc = Process()
    proc.gone = exits
    info = BackendInfo(name="a", url=url, api_key=None, n_slots=2, slot_ctx=8192,
                       ram_cache_bytes=0, kv_bytes_per_token=1, model="m", managed=True)
    t0 = time.monotonic()
    try:
        async with aiohttp.ClientSession() as session:
            got = await HealthCheck(session, SUP).watch(proc, info, for_s=for_s)
    finally:
        await fake.stop()
    if why is None:
        assert got is None and time.monotonic() - t0 >= (for_s or 0)
    else:
        assert got is not None and got.startswith(why), got


def process(tmp_path: Path, script: str, demo_model: Path) -> LlamaServerProcess:
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!/bin/sh\n{script}\n")
    binary.chmod(0o755)
    spec = ServerSpec(binary=binary, model=demo_model, port=free_port(), slots=2,
                      ctx_per_slot=4096, api_key="the-key", alias="kvroute-demo")
    return LlamaServerProcess(spec, tmp_path / "a.log")


FAKE_SERVER = f"exec {shlex.quote(sys.executable)} {shlex.quote(str(FAKE))} \"$@\""


@pytest.mark.parametrize(("script", "timeout", "why"), [
    (FAKE_SERVER, 20, None),
    ("echo 'error: invalid argument: --nope'; exit 1", 20,
     "llama-server exited during start-up; last log lines:\n"),
    ("echo 'loading'; exec sleep 30", 1, "not healthy after 1 s; last log lines:\n"),
])
async def test_ready_is_the_backend_as_the_proxy_needs_it_or_why_not(
        tmp_path: Path, demo_model: Path, script: str, timeout: float,
        why: str | None) -> None:
    proc = process(tmp_path, script, demo_model)
    cfg = ManagedBackendConfig(name="a", model=demo_model, slots=2, ctx_per_slot=4096,
                               cache_ram_mib=16)
    proc.spawn()
    try:
        async with aiohttp.ClientSession() as session:
            sup = SupervisionConfig(startup_timeout_s=timeout, health_interval_s=0.05)
            got = await HealthCheck(session, sup).ready(proc, cfg, kv_bytes_per_token=1)
    finally:
        await proc.stop(grace=1)
    if why is not None:
        assert isinstance(got, str) and got.startswith(why), got
        assert "=== kvroute:" in got  # (this process's log lines)
        return
    assert isinstance(got, BackendInfo), got
    assert (got.name, got.url, got.api_key, got.n_slots, got.slot_ctx, got.model) == (
        "a", proc.spec.url, "the-key", 2, 4096, "kvroute-demo")
    assert got.managed and got.ram_cache_bytes == 16 << 20
    assert got.kv_bytes_per_token == 8 * 4 * 64 * 2 * 2  # the demo GGUF's, not the default
