"""The faults `loadtest soak` injects, each on a schedule of its own, and what it watches.

Kills, disconnects and malformed requests reach the proxy and its backends; the disk
faults reach the disk tier's directory: a saved slot file cut short (the server would
abort on it: kvroute must drop that one and keep the rest), the directory made
unwritable for a while (saves fail: kvroute must say so and count true). Every fault is
bounded and loopback or this run's own directory only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from loadtest import workloads as wl

MALFORMED: tuple[tuple[str, bytes], ...] = (
    ("/v1/chat/completions", b"{not json"),
    ("/v1/chat/completions", b'{"messages": "x"}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xff"}]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], '
                             b'"max_tokens": "ten"}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], '
                             b'"model": "no-such-model"}'),
    ("/v1/chat/completions", b"[" * 50_000),
    ("/completion", b'{"prompt": [999999999]}'),
    ("/v1/messages", b'{"max_tokens": 5}'),
)
# Requests that do not parse as HTTP: the answer must still be the API's JSON error
RAW: tuple[bytes, ...] = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-A: b\nc\r\n\r\n",
    b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nX-Session-Id: \xff\xfe\r\n"
    b"Content-Length: 2\r\n\r\n{}",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
)


@dataclass
class Faults:
    kills: list[tuple[float, str]] = field(default_factory=list)  # (run time, backend)
    disconnects: int = 0
    malformed: dict[str, int] = field(default_factory=dict)  # answer kind -> count
    rss_kib: list[int] = field(default_factory=list)
    truncated: list[str] = field(default_factory=list)  # slot files cut short
    unwritable_s: float = 0.0  # time the directory was unwritable


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def serve_state(log_dir: Path) -> dict[str, Any]:
    return dict(json.loads((log_dir / "backends.json").read_text()))


async def every(period: float, t0: float, end: float,
                fn: Callable[[], Awaitable[None]]) -> None:
    n = 1
    while (at := t0 + n * period) < end:
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        with contextlib.suppress(Exception):  # a fault injector must not stop the run
            await fn()
        n += 1


class Injector:
    """The faults of one run against ``url`` (its servers in ``log_dir``/backends.json,
    its disk tier in ``slots``, None: none)."""

    def __init__(self, url: str, log_dir: Path, slots: Path | None, faults: Faults,
                 rng: random.Random, t0: float) -> None:
        self.url, self.log_dir, self.slots = url, log_dir, slots
        self.faults, self.rng, self.t0 = faults, rng, t0
        self._turn = 0
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))

    async def close(self) -> None:
        await self.http.close()

    async def kill(self) -> None:
        backends = [b for b in serve_state(self.log_dir)["backends"]
                    if b.get("pid") and b.get("state") == "ready"]
        if not backends:
            return
        victim = backends[self._turn % len(backends)]
        self._turn += 1
        os.kill(int(victim["pid"]), signal.SIGKILL)
        self.faults.kills.append((time.monotonic() - self.t0, str(victim["name"])))

    async def disconnect(self) -> None:
        body = {"model": "kvroute-demo", "max_tokens": 400, "ignore_eos": True,
                "stream": True,
                "messages": [{"role": "user", "content": wl.words(self.rng, 80)}]}
        async with self.http.post(self.url + "/v1/chat/completions", json=body) as r:
            await r.content.readline()
            self.faults.disconnects += 1
            r.close()  # goes away mid-stream

    async def malformed(self) -> None:
        path, body = self.rng.choice(MALFORMED)
        async with self.http.post(self.url + path, data=body,
                                  headers={"Content-Type": "application/json"}) as r:
            await r.read()
            self._answered(r.status, r.content_type)

    async def raw(self) -> None:
        """Bytes that are not HTTP, on a connection of their own."""
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(self.rng.choice(RAW))
            await writer.drain()
            head = await asyncio.wait_for(reader.read(4096), 10)
        finally:
            writer.close()
        lines = head.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1]) if len(lines[0].split()) > 1 else 0
        kind = next((ln.split(":", 1)[1].split(";")[0].strip() for ln in lines[1:]
                     if ln.lower().startswith("content-type:")), "")
        self._answered(status, kind)

    def _answered(self, status: int, content_type: str) -> None:
        key = ("4xx" if content_type == "application/json" else "4xx_not_json") \
            if 400 <= status < 500 else str(status)
        self.faults.malformed[key] = self.faults.malformed.get(key, 0) + 1

    async def truncate(self) -> None:
        """Cut a saved slot file (one the server finished writing a while ago) to half."""
        assert self.slots is not None
        now = time.time()
        done = [f for f in self.slots.glob("kvroute-*.bin")
                if now - f.stat().st_mtime > 3 and f.name not in self.faults.truncated]
        if not done:
            return
        victim = self.rng.choice(sorted(done))
        with open(victim, "r+b") as fh:
            fh.truncate(victim.stat().st_size // 2)
        self.faults.truncated.append(victim.name)

    async def unwritable(self, seconds: float) -> None:
        """The directory refuses new files for ``seconds`` (as root a mode is not enough:
        the immutable attribute)."""
        assert self.slots is not None
        began = time.monotonic()
        with read_only(self.slots):
            await asyncio.sleep(seconds)
        self.faults.unwritable_s += time.monotonic() - began

    async def sample(self, pid: int) -> None:
        self.faults.rss_kib.append(rss_kib(pid))


@contextlib.contextmanager
def read_only(directory: Path) -> Any:
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i", str(directory)], check=True)
        try:
            yield
        finally:
            subprocess.run(["chattr", "-i", str(directory)], check=True)
    else:
        mode = directory.stat().st_mode & 0o7777
        directory.chmod(0o500)
        try:
            yield
        finally:
            directory.chmod(mode)


class DirWatch:
    """The slot files of a directory as seen every poll: which went away (each must be
    accounted for by a logged removal)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.seen: set[str] = set()

    def poll(self) -> None:
        with contextlib.suppress(OSError):
            self.seen |= {f.name for f in self.directory.glob("kvroute-*.bin")}

    def gone(self) -> set[str]:
        """Files seen once that are neither in the directory nor quarantined now."""
        here = {f.name for f in self.directory.rglob("kvroute-*.bin")}
        return self.seen - here


def removals(log: Path) -> list[dict[str, Any]]:
    """The slot-file lines of a kvroute log: removals and failures."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            d = json.loads(line)
            if isinstance(d, dict) and str(d.get("event", "")).startswith("slot."):
                out.append(d)
    return out
