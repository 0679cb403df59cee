"""Crash loops, against a real process that segfaults on demand: tests/fake_backend.py run
as the llama-server binary (a real SIGSEGV while a marker file exists). A backend that dies
twice within the window is in a crash loop: the status, backends.json, the log and the
proxy's 503 say what died and the fix; it is routed again once a restart outlasts the
window. And the likely fix for each way a backend dies, table-driven."""

from __future__ import annotations

import asyncio
import io
import json
import re
import shlex
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from faults import chat_body, until
from proxy_client import proxy

from backends.binary import cache_dir
from backends.config import ManagedBackendConfig, SupervisionConfig
from backends.crash_loop import CrashLoop, Death, likely_fix, signal_name
from backends.process import free_port
from backends.supervisor import Supervisor
from proxy.config.load import Config, ProxyConfig, RoutingConfig
from proxy.doctor import backend_health
from proxy.observability.logging import configure_logging

pytestmark = pytest.mark.timeout(120)

FAKE = Path(__file__).resolve().parents[1] / "fake_backend.py"
SEGV_LINE = "fake_backend: SIGSEGV on demand"
WINDOW = 6.0  # crash_loop_window_s: two deaths within it make a loop; a restart must last it
SUPERVISION = SupervisionConfig(
    startup_timeout_s=30, health_interval_s=0.5, restart_backoff_s=0.1,
    restart_backoff_max_s=0.2, crash_loop_deaths=2, crash_loop_window_s=WINDOW,
    crash_loop_backoff_max_s=1.0)


def crashing_config(tmp_path: Path, demo_model: Path, names: tuple[str, ...]) -> Config:
    """Managed backends whose "llama-server" is the fake; backend n dies by SIGSEGV while
    tmp_path/segv-<n> exists."""
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} "
                      f"{shlex.quote(str(FAKE))} \"$@\"\n")
    binary.chmod(0o755)
    return Config(
        proxy=ProxyConfig(port=free_port()), routing=RoutingConfig(),
        backends=tuple(ManagedBackendConfig(
            name=n, model=demo_model, slots=1, ctx_per_slot=4096, alias="kvroute-demo",
            env={"KVROUTE_FAKE_SEGV_FILE": str(tmp_path / f"segv-{n}"),
                 "KVROUTE_FAKE_SEGV_AFTER_S": "0.3"}) for n in names),
        llama_server=str(binary), cache_dir=cache_dir(), log_dir=tmp_path / "logs",
        supervision=SUPERVISION)


def status(sup: Supervisor, name: str) -> dict[str, Any]:
    return next(s for s in sup.statuses() if s["name"] == name)


def looping(sup: Supervisor, name: str) -> dict[str, Any] | None:
    st = status(sup, name)
    return st if st["crash_loop"] is not None else None


@pytest.fixture
def log_lines() -> Iterator[io.StringIO]:
    out = io.StringIO()
    saved = structlog.get_config()
    configure_logging("info", stream=out)
    try:
        yield out
    finally:
        structlog.configure(**saved)


def events(out: io.StringIO, event: str) -> list[dict[str, Any]]:
    lines = (json.loads(line) for line in out.getvalue().splitlines() if line.startswith("{"))
    return [e for e in lines if e["event"] == event]


async def test_segfaults_make_a_crash_loop_that_explains_itself_and_ends(
        tmp_path: Path, demo_model: Path, log_lines: io.StringIO) -> None:
    cfg = crashing_config(tmp_path, demo_model, ("a",))
    marker = tmp_path / "segv-a"
    marker.touch()
    sup = Supervisor(cfg)
    try:
        await sup.start()
        st = await until(lambda: looping(sup, "a"), 40)
        loop = st["crash_loop"]
        assert (loop["died"], loop["signal"], loop["exit_code"]) == (
            "killed by SIGSEGV", "SIGSEGV", None)
        assert loop["deaths"] >= 2 and loop["window_s"] == WINDOW
        assert "--no-repack" in loop["fix"] and "report it upstream" in loop["fix"]
        assert any(SEGV_LINE in line for line in loop["log_tail"]), loop["log_tail"]
        assert loop["log"] == st["log"] and loop["model"] == str(demo_model)
        assert loop["argv"][0] == cfg.llama_server and "--port" in loop["argv"]
        assert "--api-key" not in loop["argv"]  # (the key is in its environment)
        assert sup.ready() == [] and st["healthy"] is False
        doc = json.loads(sup.state_file.read_text())["backends"][0]
        assert doc["crash_loop"]["signal"] == "SIGSEGV"
        why = sup.why_down(["a"])
        assert why is not None and why.retry_after >= 1
        assert why.reason.startswith("backend a is in a crash loop (")
        assert "killed by SIGSEGV" in why.reason and "--no-repack" in why.reason
        doctor = (await asyncio.to_thread(backend_health, cfg))[0]
        assert doctor["crash_loop"]["died"] == "killed by SIGSEGV" and not doctor["healthy"]

        restarts = st["restarts"]
        await until(lambda: status(sup, "a")["restarts"] > restarts, 20)  # dies in the loop
        marker.unlink()
        await until(lambda: status(sup, "a")["state"] == "held", 20)
        held = time.monotonic()
        assert sup.ready() == []  # up, but not routed until it outlasts the window
        await until(lambda: sup.ready(), WINDOW + 20)
        assert time.monotonic() - held >= WINDOW - 1
        st = status(sup, "a")
        assert st["state"] == "ready" and st["crash_loop"] is None
        assert sup.why_down(["a"]) is None
        assert json.loads(sup.state_file.read_text())["backends"][0]["crash_loop"] is None
    finally:
        await sup.stop()
    entered = events(log_lines, "backend.crash_loop")
    assert len(entered) == 1, entered
    assert entered[0]["backend"] == "a" and entered[0]["died"] == "killed by SIGSEGV"
    assert "--no-repack" in entered[0]["fix"] and entered[0]["command"].startswith(
        cfg.llama_server or "")
    assert [e["backend"] for e in events(log_lines, "backend.crash_loop_over")] == ["a"]
    # the loop's restarts waited longer than restart_backoff_max_s allows outside one
    waits = [float(m) for e in events(log_lines, "backend.state") if e["state"] == "down"
             for m in re.findall(r"restarting in ([0-9.]+) s", e["error"])]
    assert max(waits) > SUPERVISION.restart_backoff_max_s, waits


async def test_clients_get_one_clear_error_naming_the_crash_loop(
        tmp_path: Path, demo_model: Path) -> None:
    cfg = crashing_config(tmp_path, demo_model, ("a", "b"))
    (tmp_path / "segv-a").touch()
    sup = Supervisor(cfg)
    try:
        await sup.start()
        async with proxy(sup) as client:
            await until(lambda: looping(sup, "a") and [i.name for i in sup.ready()] == ["b"],
                        40)
            for seed in range(3):  # the pool's healthy backend serves
                async with client.post("/v1/chat/completions", json=chat_body(seed)) as r:
                    assert r.status == 200, await r.text()
                    assert r.headers["X-Kvroute-Backend"] == "b"

            (tmp_path / "segv-b").touch()
            await until(lambda: looping(sup, "b"), 40)
            async with client.post("/v1/chat/completions", json=chat_body(9)) as r:
                assert r.status == 503 and int(r.headers["Retry-After"]) >= 1
                err = (await r.json())["error"]
            assert err["code"] == "no_backend"
            for name in ("a", "b"):
                assert f"backend {name} is in a crash loop" in err["message"], err
            assert "killed by SIGSEGV" in err["message"] and "--no-repack" in err["message"]

            anthropic = {"model": "kvroute-demo", "max_tokens": 8,
                         "messages": [{"role": "user", "content": "hi"}]}
            async with client.post("/v1/messages", json=anthropic) as r:
                assert r.status == 503
                body = await r.json()
            assert body["type"] == "error" and body["error"]["type"] == "overloaded_error"
            assert "backend a is in a crash loop" in body["error"]["message"]

            async with client.post("/tokenize", json={"content": "hi"}) as r:  # (unrouted)
                assert r.status == 503
                assert "backend b is in a crash loop" in (await r.json())["error"]["message"]

            async with client.get("/kvroute/status") as r:
                shown = {b["name"]: b for b in (await r.json())["backends"]}
            assert shown["a"]["crash_loop"]["signal"] == "SIGSEGV"
            assert shown["a"]["routed"] is False and shown["a"]["pool"] == "kvroute-demo"
    finally:
        await sup.stop()


SIGSEGV, SIGILL, SIGKILL = -11, -4, -9


@pytest.mark.parametrize(("returncode", "tail", "expect", "reason"), [
    # (None: stopped by the supervisor, which says why)
    (None, "llama_model_loader: loaded", "startup_timeout_s", "not healthy after 60 s"),
    (None, "", "read the log at /logs/a.log", "/health failed 5 times in a row"),
    (SIGSEGV, "ggml_backend_amx_mul_mat", "--no-repack", ""),
    (-7, "", "--no-repack", ""),  # SIGBUS
    (-6, "GGML_ASSERT(x) failed", "report it upstream", ""),  # SIGABRT
    (SIGILL, "", "`make artifacts`", ""),
    (SIGKILL, "", "OOM killer", ""),
    (1, "llama_model_load: error loading model: tensor 'x' has wrong shape", "the model file", ""),
    (1, "gguf_init_from_file_impl: invalid magic characters", "the model file", ""),
    (1, "ggml_backend_cpu_buffer_type_alloc_buffer: failed to allocate buffer", "memory", ""),
    (-6, "terminate called after throwing an instance of 'std::bad_alloc'", "memory", ""),
    (1, "error: invalid argument: --no-such-flag", "extra_args", ""),
    (1, "couldn't bind HTTP server socket", "another restart", ""),
    (1, "main: exiting", "read the log at /logs/a.log", ""),
    (0, "", "read the log at /logs/a.log", ""),
])
def test_likely_fix(returncode: int | None, tail: str, expect: str, reason: str) -> None:
    sig = signal_name(returncode)
    code = None if sig else returncode
    assert expect in likely_fix(sig, code, tail, "/logs/a.log", reason)


def test_signal_names() -> None:
    assert [signal_name(rc) for rc in (SIGSEGV, SIGILL, 0, 1, None)] == [
        "SIGSEGV", "SIGILL", None, None, None]


def _death(at: float) -> Death:
    return Death(at=at, reason="llama-server exited", returncode=-11, by_itself=True,
                 log_tail=(), model="m.gguf", argv=("llama-server",), log="a.log")


@pytest.mark.parametrize("deaths, held_at, loops", [
    # (times of deaths, when a held restart ended the loop, which deaths start a loop)
    ((0, 1, 2), None, [False, False, True]),  # 3 within the window
    ((0, 20, 40), None, [False, False, False]),  # spread out: never 3 within 10 s
    ((0, 1, 2, 3), None, [False, False, True, False]),  # in one already
    # after a loop ends, one death on probation (within the window) starts it again
    ((0, 1, 2, 15), 14, [False, False, True, True]),
    ((0, 1, 2, 30), 14, [False, False, True, False]),  # probation over: counted anew
])
def test_crash_loop_counts_deaths_and_probation(deaths: tuple[float, ...],
                                                held_at: float | None,
                                                loops: list[bool]) -> None:
    c = CrashLoop(deaths_needed=3, window_s=10.0)
    got = []
    for at in deaths:
        if held_at is not None and c.looping and at > held_at:
            c.held(held_at)
        got.append(c.died(_death(at)))
    assert got == loops
