"""`kvroute agent` (backends/agent.py) with real llama-servers on the demo model, and
routers that take its backends (`agents:`): in process, then as a user runs both."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp.test_utils import TestServer
from procs import gone
from proxy_client import proxy

from backends.agent import advertised, create_agent_app
from backends.binary import cache_dir
from backends.config import (
    AgentConfig,
    AgentLink,
    AgentSettings,
    ManagedBackendConfig,
    SupervisionConfig,
)
from backends.info import BackendInfo
from backends.process import free_port
from backends.supervisor import Supervisor
from proxy.config.load import Config, ProxyConfig, RoutingConfig
from proxy.server.keys import POOLS

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[2]
AGENT_KEY = "agent-key-Qm3xT9vLr2Wc8Yh4"
CHAT = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}


def test_advertised_address_replaces_the_local_one() -> None:
    assert advertised("http://127.0.0.1:41000", "10.0.0.5") == "http://10.0.0.5:41000"
    assert advertised("http://127.0.0.1:41000", "fd00::5") == "http://[fd00::5]:41000"
    assert advertised("http://[::1]:41000", "gpu1.lan") == "http://gpu1.lan:41000"


@asynccontextmanager
async def running_agent(tmp_path: Path, llama_server_bin: Path, demo_model: Path
                        ) -> AsyncIterator[tuple[str, Supervisor[AgentConfig]]]:
    """An agent in this process on a real port, its one backend a real llama-server."""
    cfg = AgentConfig(
        agent=AgentSettings(key=AGENT_KEY, host="127.0.0.1", advertise="127.0.0.1"),
        backends=(ManagedBackendConfig(name="a", model=demo_model, slots=2,
                                       ctx_per_slot=2048, alias="kvroute-demo",
                                       is_demo=True),),
        llama_server=str(llama_server_bin), log_dir=tmp_path / "agent-logs",
        supervision=SupervisionConfig(startup_timeout_s=60, restart_backoff_s=0.2))
    sup = Supervisor(cfg, host=cfg.agent.host)
    server = TestServer(create_agent_app(cfg, sup), host="127.0.0.1", port=free_port())
    try:
        await sup.start()
        await server.start_server()
        yield f"http://127.0.0.1:{server.port}", sup
    finally:
        await server.close()
        await sup.stop()


async def get(session: aiohttp.ClientSession, url: str, key: str | None = None,
              auth: str | None = None) -> tuple[int, Any]:
    headers = {"Authorization": auth or f"Bearer {key}"} if key or auth else {}
    async with session.get(url, headers=headers) as r:
        return r.status, await r.json()


async def test_agent_serves_its_backends_to_its_key_only(
        tmp_path: Path, llama_server_bin: Path, demo_model: Path) -> None:
    async with running_agent(tmp_path, llama_server_bin, demo_model) as (url, _), \
            aiohttp.ClientSession() as s:
        assert await get(s, url + "/health") == (200, {"status": "ok", "backends_ready": 1,
                                                       "backends": 1})
        for key, auth in [(None, None), ("wrong-" + AGENT_KEY, None), (AGENT_KEY + "x", None),
                          (None, f"Basic {AGENT_KEY}"), (None, AGENT_KEY)]:
            status, body = await get(s, url + "/backends", key, auth)
            assert status == 401, (key, auth)
            assert body == {"error": {"message": "missing or invalid agent key",
                                      "type": "authentication_error", "code": 401}}
        status, body = await get(s, url + "/backends", AGENT_KEY)
        assert status == 200
        (b,) = body["backends"]
        assert (b["name"], b["state"], b["restarts"], b["model"]) == (
            "a", "ready", 0, "kvroute-demo")
        assert (b["n_slots"], b["slot_ctx"], b["ram_cache_bytes"]) == (2, 2048, 1024 << 20)
        assert b["kv_bytes_per_token"] == 8 * 4 * 64 * 2 * 2  # the demo GGUF's
        assert b["memory"]["n_swa"] == 0 and b["memory"]["recurrent"] is False
        assert b["modalities"] == []  # no projector
        assert b["url"].startswith("http://127.0.0.1:") and len(b["api_key"]) >= 32
        # the llama-server asks for the key the agent hands out
        chat = b["url"] + "/v1/chat/completions"
        async with s.post(chat, json=CHAT) as r:
            assert r.status == 401
        async with s.post(chat, json=CHAT,
                          headers={"Authorization": f"Bearer {b['api_key']}"}) as r:
            assert r.status == 200


async def wait_for(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.1)


async def test_router_routes_to_an_agents_backend_and_follows_its_restart(
        tmp_path: Path, llama_server_bin: Path, demo_model: Path) -> None:
    async with running_agent(tmp_path, llama_server_bin, demo_model) as (url, agent_sup):
        cfg = Config(proxy=ProxyConfig(port=1), routing=RoutingConfig(), backends=(),
                     llama_server=None, cache_dir=cache_dir(), log_dir=tmp_path / "router",
                     agents=(AgentLink("box1", url, AGENT_KEY, poll_interval_s=0.2),))
        router_sup = Supervisor(cfg)
        events: list[tuple[str, BackendInfo | None]] = []
        router_sup.subscribe(lambda name, info: events.append((name, info)))
        try:
            await router_sup.start()
            (first,) = router_sup.ready()
            assert first.name == "box1/a" and not first.managed
            async with proxy(router_sup) as client:
                # a request without the backend's key would be refused by it (above)
                async with client.post("/v1/chat/completions", json=CHAT) as r:
                    assert r.status == 200, await r.text()
                    assert r.headers["X-Kvroute-Backend"] == "box1/a"
                pid = agent_sup.pid("a")
                assert pid is not None
                os.kill(pid, signal.SIGKILL)
                await wait_for(lambda: len(events) >= 3, 40, f"down, then up again: {events}")
                assert [(n, i is None) for n, i in events] == [
                    ("box1/a", False), ("box1/a", True), ("box1/a", False)]
                second = events[-1][1]
                assert second is not None and second.api_key != first.api_key
                await wait_for(lambda: "box1/a" in client.app[POOLS].first.backends, 10,
                               "routed again")
                async with client.post("/v1/chat/completions", json=CHAT) as r:
                    assert r.status == 200, await r.text()
                    assert r.headers["X-Kvroute-Backend"] == "box1/a"
        finally:
            await router_sup.stop()


# -- as a user runs them: `kvroute agent` and `kvroute serve`, keys kept out of sight --


def http(url: str, body: object = None, key: str | None = None) -> tuple[int, str]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return 0, str(e)


def until(check: Callable[[], bool], timeout: float, what: str,
          procs: tuple[subprocess.Popen[bytes], ...] = ()) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        for p in procs:
            assert p.poll() is None, f"{p.args} exited: {what}"
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout} s: {what}")
        time.sleep(0.2)


@contextmanager
def started(args: list[str], log: Path, env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "ab") as out:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen([sys.executable, "-m", "proxy.cli", *args], cwd=REPO,
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def backend_keys(agent_url: str) -> dict[str, str]:
    status, text = http(agent_url + "/backends", key=AGENT_KEY)
    if status != 200:
        return {}
    return {b["name"]: b["api_key"] for b in json.loads(text)["backends"]
            if b["state"] == "ready"}


def llama_pids(state: Path) -> list[int]:
    try:
        return [b["pid"] for b in json.loads(state.read_text())["backends"] if b["pid"]]
    except (OSError, ValueError):
        return []


def test_keys_stay_out_of_logs_status_metrics_and_errors(
        tmp_path: Path, llama_server_bin: Path, demo_model: Path) -> None:
    env = {**os.environ, "KVROUTE_AGENT_KEY": AGENT_KEY}
    agent_port, router_port = free_port(), free_port()
    agent_yaml, router_yaml = tmp_path / "agent.yaml", tmp_path / "router.yaml"
    agent_yaml.write_text(yaml.safe_dump({
        "agent": {"host": "127.0.0.1", "port": agent_port, "key_env": "KVROUTE_AGENT_KEY"},
        "llama_server": str(llama_server_bin), "log_dir": str(tmp_path / "agent-logs"),
        "backends": [{"name": "a", "model": "demo", "slots": 2, "ctx_per_slot": 2048}]}))
    router_yaml.write_text(yaml.safe_dump({
        "proxy": {"host": "127.0.0.1", "port": router_port},
        "log_dir": str(tmp_path / "router-logs"),
        "agents": [{"url": f"http://127.0.0.1:{agent_port}", "name": "box1",
                    "key_env": "KVROUTE_AGENT_KEY", "poll_interval_s": 0.3}]}))
    agent_url, router = f"http://127.0.0.1:{agent_port}", f"http://127.0.0.1:{router_port}"
    logs, seen_keys, shown = tmp_path / "agent.log", {AGENT_KEY}, []
    state = tmp_path / "agent-logs" / "backends.json"
    agent_args = ["agent", "--config", str(agent_yaml), "--log-level", "debug"]

    def routed() -> bool:
        status, text = http(router + "/kvroute/status")
        shown.append(text)
        return status == 200 and any(b["routed"] for b in json.loads(text)["backends"])

    try:
        with started(agent_args, logs, env) as agent, \
                started(["serve", "--config", str(router_yaml), "--log-level", "debug"],
                        tmp_path / "router.log", env) as serve:
            until(lambda: len(backend_keys(agent_url)) == 1, 60, "agent ready", (agent,))
            seen_keys |= set(backend_keys(agent_url).values())
            until(routed, 60, "the router routes to the agent's backend", (agent, serve))
            status, text = http(router + "/v1/chat/completions", CHAT)
            assert status == 200, text
            shown += [http(router + p)[1] for p in ("/metrics", "/v1/models", "/health")]
            shown.append(http(router + "/v1/chat/completions", {"messages": 1})[1])
            agent.send_signal(signal.SIGTERM)  # the agent goes away: its backend with it
            agent.wait(20)
            until(lambda: not routed(), 20, "the router sees the backend down", (serve,))
            shown.append(http(router + "/v1/chat/completions", CHAT)[1])  # nothing to serve
            with started(agent_args, logs, env) as agent2:  # and comes back (new keys)
                until(lambda: len(backend_keys(agent_url)) == 1, 60, "agent back", (agent2,))
                seen_keys |= set(backend_keys(agent_url).values())
                until(routed, 30, "routed again", (agent2, serve))
                status, text = http(router + "/v1/chat/completions", CHAT)
                assert status == 200, text
                shown.append(http(router + "/kvroute/status")[1])
    finally:
        for pid in llama_pids(state):
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
    router_log = (tmp_path / "router.log").read_text()
    assert '"agent.unreachable"' in router_log and '"level": "warning"' in router_log
    assert len(seen_keys) == 3  # the agent's, and one per start of its llama-server
    texts = {"agent log": logs.read_text(), "router log": router_log,
             "router answers": "\n".join(shown),
             "llama-server log": (tmp_path / "agent-logs" / "a.log").read_text(),
             **{str(p): p.read_text() for p in tmp_path.rglob("*.json")}}
    for where, text in texts.items():
        for key in seen_keys:
            assert key not in text, f"a key in the {where}"


def test_agent_without_its_key_says_which_variable_to_set(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump({"agent": {"key_env": "KVROUTE_TEST_UNSET_KEY"},
                                    "backends": [{"name": "a", "model": "demo"}]}))
    env = {k: v for k, v in os.environ.items() if k != "KVROUTE_TEST_UNSET_KEY"}
    done = subprocess.run([sys.executable, "-m", "proxy.cli", "agent", "--config", str(path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.startswith("kvroute: agent.key_env: the environment variable "
                                  "KVROUTE_TEST_UNSET_KEY is not set (fix: export "), done.stderr
