"""Supervisor and process management against real llama-server processes."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from fake_backend import FakeBackend
from procs import gone

from backends.client import BackendClient, BackendDown, Health, Props
from backends.config import ExternalBackendConfig
from backends.info import BackendInfo
from backends.process import free_port
from backends.supervisor import Supervisor
from proxy.config.load import Config, RoutingConfig

PoolFactory = Callable[..., Awaitable[Supervisor]]  # the backend_pool fixture (conftest.py)
CHAT = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}




def group_members(pgid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(entry))
    return out


async def chat(session: aiohttp.ClientSession, info: BackendInfo) -> dict[str, object]:
    headers = {"Authorization": f"Bearer {info.api_key}"}
    async with session.post(info.url + "/v1/chat/completions", json=CHAT, headers=headers) as r:
        assert r.status == 200, await r.text()
        body: dict[str, object] = await r.json()
        return body


async def test_two_managed_backends_answer(backend_pool: PoolFactory, demo_model: Path) -> None:
    sup = await backend_pool()
    infos = sorted(sup.ready(), key=lambda i: i.name)
    assert [i.name for i in infos] == ["a", "b"]
    async with aiohttp.ClientSession() as session:
        for info in infos:
            assert info.managed and info.url.startswith("http://127.0.0.1:")
            assert (info.n_slots, info.slot_ctx) == (2, 8192)
            assert info.kv_bytes_per_token == 8 * 4 * 64 * 2 * 2  # read from the GGUF
            assert info.ram_cache_bytes == 1024 << 20
            assert info.model == "kvroute-demo"
            body = await chat(session, info)
            assert body["choices"]
            # the random per-backend key keeps clients from bypassing the proxy
            async with session.post(info.url + "/v1/chat/completions", json=CHAT) as r:
                assert r.status == 401
            props = await BackendClient(session, info.url, info.api_key).props()
            assert isinstance(props, Props) and props.model_path == str(demo_model)
    statuses = {s["name"]: s for s in sup.statuses()}
    assert statuses["a"]["state"] == "ready" and statuses["a"]["healthy"] is True
    assert isinstance(statuses["a"]["pid"], int)
    assert Path(str(statuses["a"]["log"])).is_file()


async def test_kill_9_restarts_within_15s(backend_pool: PoolFactory) -> None:
    sup = await backend_pool(n=1, fresh=True)
    events: list[tuple[str, BackendInfo | None]] = []
    sup.subscribe(lambda name, info: events.append((name, info)))
    old_pid = sup.pid("a")
    old = sup.get("a")
    assert old_pid is not None and old is not None
    t0 = time.monotonic()
    os.kill(old_pid, signal.SIGKILL)
    async with aiohttp.ClientSession() as session:
        while True:
            assert time.monotonic() - t0 < 15, f"not back within 15 s: {sup.statuses()}"
            info = sup.get("a")
            if info is not None and sup.pid("a") not in (None, old_pid):
                await chat(session, info)
                break
            await asyncio.sleep(0.1)
    elapsed = time.monotonic() - t0
    assert elapsed < 15
    assert [e[1] is None for e in events] == [True, False]  # down, then ready again
    assert events[1][1] is not None and events[1][1].api_key != old.api_key
    assert sup.statuses()[0]["restarts"] == 1
    assert gone(old_pid)
    new_pid = sup.pid("a")
    assert new_pid is not None
    await sup.stop()
    assert gone(new_pid) and not group_members(new_pid)
    assert sup.ready() == [] and events[-1] == ("a", None)


async def test_stop_kills_every_process_group(backend_pool: PoolFactory) -> None:
    sup = await backend_pool(n=2, slots=1, fresh=True)
    pids = [sup.pid(n) for n in ("a", "b")]
    assert all(pids)
    await sup.stop()
    for pid in pids:
        assert pid is not None and gone(pid) and not group_members(pid)
    assert sup.statuses()[0]["state"] == "stopped"
    await sup.stop()  # idempotent


@pytest.mark.parametrize("n_ctx", [0, -5, 10**12])
async def test_external_backend_with_nonsense_props_is_not_routed(
        pool_config: Callable[..., Config], n_ctx: int) -> None:
    # one claiming 10^12 tokens per slot lifted the proxy's context check for every
    # backend (it takes the largest); 0 rejected every request
    fake = FakeBackend(n_ctx=n_ctx)
    await fake.start()
    base = pool_config(n=1)
    cfg = Config(proxy=base.proxy, routing=RoutingConfig(), llama_server=base.llama_server,
                 cache_dir=base.cache_dir, log_dir=base.log_dir, supervision=base.supervision,
                 backends=(ExternalBackendConfig(name="odd", url=fake.url),))
    sup = Supervisor(cfg)
    try:
        await sup.start()
        st = sup.statuses()[0]
        assert sup.ready() == [] and st["healthy"] is False, st
        assert "out of range" in str(st["last_error"]), st
    finally:
        await sup.stop()
        await fake.stop()


async def test_external_backend_down_is_not_fatal(
    backend_pool: PoolFactory, pool_config: Callable[..., Config], demo_model: Path
) -> None:
    live = (await backend_pool()).ready()[0]
    dead_url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    base = pool_config(n=1)
    cfg = Config(
        proxy=dataclasses.replace(base.proxy, settings=dataclasses.replace(
            base.proxy.settings, tokenizer=demo_model)),
        routing=RoutingConfig(), llama_server=base.llama_server,
        cache_dir=base.cache_dir, log_dir=base.log_dir, supervision=base.supervision,
        backends=(
            ExternalBackendConfig(name="dead", url=dead_url),
            ExternalBackendConfig(name="live", url=live.url, api_key=live.api_key,
                                  kv_bytes_per_token=4096),
            ExternalBackendConfig(name="nokey", url=live.url),
            # no size given: that of proxy.tokenizer's model
            ExternalBackendConfig(name="sized", url=live.url, api_key=live.api_key),
        ),
    )
    sup = Supervisor(cfg)
    t0 = time.monotonic()
    await sup.start()
    try:
        assert time.monotonic() - t0 < 10
        st = {s["name"]: s for s in sup.statuses()}
        assert st["dead"]["healthy"] is False and st["dead"]["state"] == "down"
        assert "/health" in str(st["dead"]["last_error"])
        assert st["nokey"]["healthy"] is False and "api_key" in str(st["nokey"]["last_error"])
        info, sized = sup.ready()
        assert (info.name, info.managed, info.n_slots, info.kv_bytes_per_token) == (
            "live", False, 2, 4096)
        assert (sized.name, sized.kv_bytes_per_token) == ("sized", 8 * 4 * 64 * 2 * 2)
        assert sup.pid("live") is None
    finally:
        await sup.stop()


async def test_client_reports_down_backend_as_a_value() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    async with aiohttp.ClientSession() as session:
        client = BackendClient(session, url, timeout=2)
        for result in [await client.health(), await client.props(), await client.slots(),
                       await client.tokenize("hi"), await client.metrics(),
                       await client.apply_template({"messages": []})]:
            assert isinstance(result, BackendDown) and result.url == url


async def test_client_calls(backend_pool: PoolFactory) -> None:
    info = (await backend_pool()).ready()[0]
    async with aiohttp.ClientSession() as session:
        c = BackendClient(session, info.url, info.api_key)
        assert await c.health() == Health(ok=True, status=200)
        slots = await c.slots()
        assert isinstance(slots, list) and [s.id for s in slots] == [0, 1]
        toks = await c.tokenize("<|im_start|>user", with_pieces=True)
        assert not isinstance(toks, BackendDown)
        assert toks.ids[0] == 151644 and toks.pieces is not None  # parse_special
        prompt = await c.apply_template({"messages": CHAT["messages"]})
        assert prompt == "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
        metrics = await c.metrics()
        assert isinstance(metrics, str) and "llamacpp:prompt_tokens_total" in metrics


def test_server_dies_with_its_parent_even_on_sigkill(
    llama_server_bin: Path, demo_model: Path, tmp_path: Path
) -> None:
    """PR_SET_PDEATHSIG: a SIGKILLed parent cannot clean up, the kernel must."""
    script = f"""
import asyncio, sys
from pathlib import Path
from backends.process import LlamaServerProcess, ServerSpec, free_port
async def main():
    spec = ServerSpec(binary=Path({str(llama_server_bin)!r}), model=Path({str(demo_model)!r}),
                      port=free_port(), slots=1, ctx_per_slot=512)
    p = LlamaServerProcess(spec, Path({str(tmp_path / "srv.log")!r}))
    p.spawn()
    print("PID", p.pid, flush=True)
    await asyncio.sleep(600)
asyncio.run(main())
"""
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[2])
    try:
        assert parent.stdout is not None
        line = ""
        while not line.startswith("PID "):  # structlog may print to stdout first
            line = parent.stdout.readline()
            assert line, "the parent exited before spawning"
        child = int(line.split()[1])
        assert not gone(child)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 5
        while not gone(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(child), "llama-server outlived its SIGKILLed parent"
    finally:
        parent.kill()
        parent.wait()
        if "child" in locals() and not gone(child):
            os.kill(child, signal.SIGKILL)


@pytest.mark.parametrize("bad", ["--no-such-flag"])
async def test_crash_loop_is_reported_not_raised(backend_pool: PoolFactory, bad: str,
                                                 pool_config: Callable[..., Config]) -> None:
    from dataclasses import replace

    base = pool_config(n=1, extra_args=(bad,))
    cfg = replace(base, supervision=replace(base.supervision, startup_timeout_s=10))
    sup = Supervisor(cfg)
    await sup.start()
    try:
        st = sup.statuses()[0]
        assert st["healthy"] is False and st["state"] in ("down", "starting")
        assert "exited" in str(st["last_error"]) and bad in str(st["last_error"])
        assert sup.ready() == []
    finally:
        await sup.stop()


async def test_log_tail_is_the_failed_process_own(llama_server_bin: Path, demo_model: Path,
                                                  tmp_path: Path) -> None:
    """The log is appended to across restarts: a failed start-up's "last log lines"
    showed the previous process's (a crash's cause hidden behind an old run's lines)."""
    from backends.process import LlamaServerProcess, ServerSpec, free_port

    log_path = tmp_path / "a.log"
    log_path.write_text("".join(f"an earlier run's line {i}\n" for i in range(30)))
    spec = ServerSpec(binary=llama_server_bin, model=demo_model, port=free_port(),
                      slots=1, ctx_per_slot=512, extra_args=("--no-such-flag",))
    p = LlamaServerProcess(spec, log_path)
    p.spawn()
    try:
        deadline = time.monotonic() + 10
        while not p.exited() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        tail = p.log_tail()
        assert "--no-such-flag" in tail and "an earlier run" not in tail, tail
    finally:
        await p.stop()
