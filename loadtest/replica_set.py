"""Replicas of kvroute on one NATS broker, as the load tools run them: the broker, each
replica a `kvroute serve` process, and a client that balances over them.

The client does what a balancer's passive health check does: a replica that refuses a
connection is dropped and the request goes to the next (it never reached the refused
one).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from backends.process import free_port
from loadtest.client import LoadClient, Result

ROOT = Path(__file__).resolve().parent.parent
_TICK = os.sysconf("SC_CLK_TCK")


class Balancer(LoadClient):
    """The load client's round robin, with a balancer's passive health check: a target
    that refuses a connection leaves the rotation and the request goes to the next one
    (safe: nothing reached the refused target). Remembers where each request went."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.target: dict[str, str] = {}
        self.dropped: dict[str, float] = {}  # target -> when (perf_counter)

    async def _one(self, session: aiohttp.ClientSession, req: Any, t0: float) -> Result:
        while True:
            # (the parent picks the same target: nothing awaits in between)
            base = self.bases[self._sent % len(self.bases)]
            self.target[req.id] = base
            res = await super()._one(session, req, t0)
            refused = (res.error or "").startswith("ClientConnectorError")
            if not refused or len(self.bases) < 2:
                return res
            if base in self.bases:
                self.bases.remove(base)
                self.dropped[base] = time.perf_counter()


@dataclass
class Broker:
    binary: str
    port: int
    monitor: int
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        with open(self.log, "ab") as fh:
            self.proc = subprocess.Popen(
                [self.binary, "-a", "127.0.0.1", "-p", str(self.port), "-m", str(self.monitor)],
                stdout=fh, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                self.varz_sync()
                return
            time.sleep(0.05)
        raise RuntimeError("nats-server did not start")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def varz_sync(self) -> dict[str, Any]:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.monitor}/varz", timeout=2) as r:
            return json.loads(r.read())


@dataclass
class Replica:
    name: str
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def cpu_s(self) -> float:
        """user + system CPU seconds of the process so far."""
        with open(f"/proc/{self.proc.pid}/stat") as fh:
            f = fh.read().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / _TICK


async def start_replica(base_cfg: Path, name: str, nats: str | None, out: Path
                        ) -> Replica:
    cfg = yaml.safe_load(base_cfg.read_text())
    port = free_port()
    cfg["proxy"]["port"] = port
    cfg["log_dir"] = str(out / f"{name}-logs")
    if nats is not None:
        cfg["replicas"] = {"nats": nats, "id": name}
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    log = out / f"{name}.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "proxy.cli", "serve", "--config",
                                 str(path), "--log-level", "info"],
                                cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT)
    return Replica(name, f"http://127.0.0.1:{port}", proc, log)


async def wait_ready(http: aiohttp.ClientSession, r: Replica, n: int, shared: bool) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if r.proc.poll() is not None:
            raise RuntimeError(f"{r.name} exited with {r.proc.returncode} (see {r.log})")
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
            s = await get_json(http, r.url + "/kvroute/status")
            ready = sum(bool(b.get("healthy")) for b in s.get("backends", ()))
            if ready >= n and (not shared or (s.get("replicas") or {}).get("connected")):
                return
        await asyncio.sleep(0.3)
    raise RuntimeError(f"{r.name} not ready within 120 s (see {r.log})")


async def get_json(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url, timeout=aiohttp.ClientTimeout(total=3)) as resp:
        return await resp.json()  # type: ignore[no-any-return]
