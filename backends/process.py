"""One llama-server process: start, wait until ready, stop. No restart logic here.

Children must never outlive kvroute:
- each server runs in its own session/process group, so stop() can kill the group;
- PR_SET_PDEATHSIG makes the kernel SIGKILL the server if kvroute dies, even by
  SIGKILL. The signal fires when the *thread* that forked exits, so spawn() must be
  called from a long-lived thread (the event loop's), never from an executor thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import structlog

from backends.devices import DeviceRef, launch

log = structlog.get_logger(__name__)

_PR_SET_PDEATHSIG = 1
try:
    # resolved before any fork: the child may only call async-signal-safe code
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: fall back to process groups only
    _prctl = None


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now. Racy by nature; a bind failure shows up as a crash and
    the supervisor restarts on a new port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _child_setup(parent_pid: int) -> None:
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    # the parent may have died between fork and prctl: then nobody would kill us
    if os.getppid() != parent_pid:
        os._exit(1)


@dataclass(frozen=True)
class ServerSpec:
    """Everything needed to launch one llama-server."""

    binary: Path
    model: Path
    port: int
    slots: int = 2
    ctx_per_slot: int = 8192
    threads: int = 1
    api_key: str | None = None
    cache_ram_mib: int = 1024
    host: str = "127.0.0.1"
    alias: str | None = None
    slot_save_path: Path | None = None  # --slot-save-path: slots saved and restored there
    extra_args: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    devices: tuple[DeviceRef, ...] = ()  # (backends/devices.py)
    mmproj: Path | None = None  # --mmproj: the projector that makes it serve media
    lora: tuple[Path, ...] = ()  # --lora: adapters, ids 0, 1, ... in this order

    def argv(self) -> list[str]:
        args = [
            str(self.binary),
            "-m", str(self.model),
            "--host", self.host,
            "--port", str(self.port),
            "-np", str(self.slots),
            # -c is the total: with an explicit -np each slot gets c / np tokens
            "-c", str(self.slots * self.ctx_per_slot),
            "-t", str(self.threads),
            "--cache-ram", str(self.cache_ram_mib),
            "--metrics",
            "--slots",
            "--jinja",
        ]
        if self.alias:
            args += ["-a", self.alias]
        if self.slot_save_path is not None:
            args += ["--slot-save-path", str(self.slot_save_path)]
        if self.mmproj is not None:
            args += ["--mmproj", str(self.mmproj)]
        if self.lora:  # one comma-separated --lora: the server deprecates repeating it
            args += ["--lora", ",".join(map(str, self.lora))]
        return [*args, *launch(self.devices)[0], *self.extra_args]

    @property
    def url(self) -> str:
        """Where this host reaches it (a wildcard address is not one to connect to)."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        return f"http://{'[' + host + ']' if ':' in host else host}:{self.port}"


@dataclass(frozen=True)
class Ready:
    """The server answers /health with 200."""

    seconds: float


@dataclass(frozen=True)
class Failed:
    """The server exited or did not become healthy in time."""

    reason: str
    log_tail: str


class LlamaServerProcess:
    def __init__(self, spec: ServerSpec, log_path: Path) -> None:
        self.spec = spec
        self.log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_start = 0  # where this process's lines begin (the log is appended to)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def spawn(self) -> int:
        """Start the process (non-blocking). Call from the event loop thread (see module doc)."""
        assert self._proc is None, "spawn() called twice"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **launch(self.spec.devices, self.spec.binary)[1], **self.spec.env}
        # the key goes in the environment, not argv: argv is world-readable via ps
        env.pop("LLAMA_API_KEY", None)
        if self.spec.api_key:
            env["LLAMA_API_KEY"] = self.spec.api_key
        parent = os.getpid()
        with open(self.log_path, "ab") as logf:
            self._log_start = logf.tell()
            logf.write(f"\n=== kvroute: {' '.join(self.spec.argv())}\n".encode())
            logf.flush()
            self._proc = subprocess.Popen(
                self.spec.argv(),
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # own process group: stop() kills the group
                preexec_fn=lambda: _child_setup(parent),
                close_fds=True,
            )
        log.info("llama_server.spawned", pid=self._proc.pid, url=self.spec.url,
                 log=str(self.log_path))
        return self._proc.pid

    def exited(self) -> bool:
        """True once the process has exited. Does not reap it: while the zombie holds
        its pid, the process group id cannot be reused, so stop() can still killpg safely."""
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return True
        try:
            info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return True
        return info is not None

    def alive(self) -> bool:
        return self._proc is not None and not self.exited()

    def log_tail(self, n: int = 20) -> str:
        """This process's last `n` log lines (not an earlier process's: a restart)."""
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(max(self._log_start, os.path.getsize(self.log_path) - 8192))
                lines = fh.read().decode(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    async def wait_ready(
        self, session: aiohttp.ClientSession, timeout: float = 120.0
    ) -> Ready | Failed:
        """Poll /health (no API key needed) until 200, the process exits, or timeout."""
        t0 = time.monotonic()
        url = self.spec.url + "/health"
        while time.monotonic() - t0 < timeout:
            if self.exited():
                return Failed("llama-server exited during start-up", self.log_tail())
            try:
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return Ready(time.monotonic() - t0)
            except (aiohttp.ClientError, TimeoutError):
                pass  # not listening yet, or 503 while loading
            await asyncio.sleep(0.1)
        return Failed(f"not healthy after {timeout:.0f} s", self.log_tail())

    async def stop(self, grace: float = 5.0) -> int | None:
        """SIGTERM the process group, SIGKILL it after `grace` s; reap. Returns the exit code."""
        proc = self._proc
        if proc is None:
            return None
        if proc.returncode is None:
            pgid = proc.pid  # start_new_session: the pid is the group id
            if not self.exited():
                _killpg(pgid, signal.SIGTERM)
                deadline = time.monotonic() + grace
                while not self.exited() and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
            # the leader is at worst an unreaped zombie here, so the group id is still
            # ours: kill whatever is left of the group, then reap
            _killpg(pgid, signal.SIGKILL)
            while proc.poll() is None:
                await asyncio.sleep(0.02)
            log.info("llama_server.stopped", pid=proc.pid, returncode=proc.returncode)
        return proc.returncode


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
