"""Routers in front of fresh external llama-servers, for side-by-side runs.

A run of ``--external`` or of a peer router (``smg:<policy>``) starts its own
llama-servers (the pinned build, the demo model, no API key, empty caches), puts the
router in front, and stops everything when the run ends. kvroute then sees the servers
as ``url:`` backends, as an operator with servers of their own configures it: told the
RAM cache size and the model (``proxy.tokenizer``), nothing else.

The peer is SGLang's gateway, ``smg`` on PyPI. It is never a dependency: install it in a
venv of its own and pass its binary with ``--smg``.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from backends.binary import ensure_llama_server
from backends.demo_model import ensure_demo_model
from backends.process import LlamaServerProcess, ServerSpec, free_port
from proxy.routing.settings import RouterSettings

PEERS = ("smg",)



@dataclass(frozen=True)
class Cluster:
    """What each policy run starts: n managed demo-model backends."""

    backends: int = 2
    slots: int = 2
    threads: int = 1
    ctx_per_slot: int = 8192
    cache_ram_mib: int = 1024
    model: str = "demo"
    kv_disk: bool = False  # managed backends' slots saved to disk (kv_disk in the config)
    startup_timeout_s: float = 180.0
    # one device per backend (a CUDA index or a --list-devices name), every layer on it;
    # none: the build's default
    devices: tuple[str | int, ...] = ()

    def offload(self, i: int) -> tuple[tuple[str | int, ...], tuple[str, ...]]:
        """Backend ``i``'s devices and the flags that put every layer there."""
        if not self.devices:
            return (), ()
        return (self.devices[i],), ("-ngl", "all")


def policy_variant(spec: str) -> tuple[str, dict[str, Any]]:
    """``prefix[wait_starve_s=0,wait_ageing=1]`` -> ("prefix", {"wait_starve_s": 0, ...}):
    a kvroute policy with routing settings of its own (config ``routing:``), so that two
    settings of one policy are compared in one run. Values read as YAML scalars."""
    name, sep, rest = spec.partition("[")
    if not sep:
        return spec, {}
    if not rest.endswith("]"):
        raise ValueError(f"policy {spec!r}: expected name[key=value,...]")
    out: dict[str, Any] = {}
    for item in filter(None, rest[:-1].split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"policy {spec!r}: {item!r} is not key=value")
        out[key.strip()] = yaml.safe_load(value)
    try:
        RouterSettings(**out)
    except TypeError as e:
        raise ValueError(f"policy {spec!r}: {e} (the keys are those of routing: in the "
                         "config, docs/configuration.md)") from None
    return name, out


def split_policies(text: str) -> list[str]:
    """``"prefix,prefix[a=1,b=2],smg:cache_aware"`` -> its three policies (commas inside
    brackets belong to a policy's settings)."""
    out, depth, cur = [], 0, ""
    for ch in text + ",":
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            if cur.strip():
                out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return out


def split_router(name: str) -> tuple[str, str]:
    """``smg:cache_aware`` -> ("smg", "cache_aware"); a kvroute policy -> ("kvroute", it)."""
    peer, sep, policy = name.partition(":")
    return (peer, policy) if sep else ("kvroute", name)


@contextlib.asynccontextmanager
async def fresh_servers(cluster: Cluster, log_dir: Path) -> AsyncIterator[list[str]]:
    """``cluster.backends`` new llama-servers on free loopback ports; yields their URLs."""
    binary = ensure_llama_server(None).path
    model = ensure_demo_model(kind=cluster.model)
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = [LlamaServerProcess(ServerSpec(binary, model, free_port(), cluster.slots,
                                           cluster.ctx_per_slot, cluster.threads,
                                           cache_ram_mib=cluster.cache_ram_mib,
                                           alias="kvroute-demo",
                                           devices=cluster.offload(i)[0],
                                           extra_args=cluster.offload(i)[1]),
                                log_dir / f"{chr(ord('a') + i)}.log")
             for i in range(cluster.backends)]
    try:
        async with aiohttp.ClientSession() as http:
            for p in procs:
                p.spawn()
            for p in procs:
                ready = await p.wait_ready(http, cluster.startup_timeout_s)
                if not hasattr(ready, "seconds"):
                    raise RuntimeError(f"llama-server did not start: {ready}")
        yield [p.spec.url for p in procs]
    finally:
        await asyncio.gather(*(p.stop() for p in procs), return_exceptions=True)


def external_config(path: Path, cluster: Cluster, urls: list[str], policy: str) -> Path:
    """A kvroute config with ``urls`` as external backends and the demo model's GGUF as
    the tokenizer (the servers' model, as an operator would name it); ``policy`` may
    carry settings (``policy_variant``)."""
    policy, routing = policy_variant(policy)
    cfg: dict[str, Any] = {
        "proxy": {"host": "127.0.0.1", "port": free_port(), "policy": policy,
                  "tokenizer": str(ensure_demo_model(kind=cluster.model))},
        "log_dir": str(path.parent / "logs" / path.stem),
        "backends": [{"name": chr(ord("a") + i), "url": u,
                      "cache_ram_mib": cluster.cache_ram_mib} for i, u in enumerate(urls)],
    }
    if routing:
        cfg["routing"] = routing
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


@contextlib.contextmanager
def busy_loops(n: int) -> Iterator[None]:
    """``n`` processes spinning a core each for as long as the block runs: the machine
    kept busy by another program, as a shared host is (killed on the way out)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
             for _ in range(max(0, n))]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def find_smg(configured: str | None) -> str:
    found = shutil.which(configured or "smg")
    if found is None:
        raise RuntimeError("smg not found: install it in a venv of its own "
                           "(`python -m venv /tmp/smg && /tmp/smg/bin/pip install "
                           "smg==1.13.0`) and pass --smg /tmp/smg/bin/smg")
    return found


@contextlib.asynccontextmanager
async def smg_router(binary: str, urls: list[str], policy: str, log: Path,
                     timeout_s: float = 60.0) -> AsyncIterator[str]:
    """``smg launch`` in front of ``urls``; yields its URL once it routes a request."""
    port = free_port()
    argv = [binary, "launch", "--worker-urls", *urls, "--policy", policy,
            "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-port", str(free_port())]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as fh:
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        await _wait_models(url, proc, timeout_s)
        yield url
    finally:
        await terminate(proc, 10.0)


async def terminate(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM a router process, SIGKILL it if it has not exited within ``grace_s``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(proc.wait, grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _wait_models(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as http:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"smg exited with {proc.returncode}")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with http.get(url + "/v1/models") as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.5)
    raise RuntimeError(f"smg at {url} not ready within {timeout_s:.0f} s")
