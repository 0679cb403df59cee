"""Hosts on this machine for tests and benches: Linux network namespaces on a bridge.

    with hosts("b1", "r1", "client") as net:     # RuntimeError when it cannot (unavailable())
        net.ip("b1")                              # 10.77.0.1: each host its own address
        proc = net.spawn("b1", [...], log=path)   # a process on that host (killed at exit)
        with net.client("client") as c:           # HTTP from inside a host, a child process
            status, headers, body = c.request("GET", "http://10.77.0.1:8080/health")
        net.run_in("client", make_coroutine)      # asyncio in a thread inside a host

Each host is a namespace with its loopback up and one veth (eth0, 10.77.0.i/24) whose
other end sits on a bridge in a "switch" namespace of its own: the root namespace gets
no interface and no address, so nothing sent from them leaves them. Names carry the pid
of the process that made them, so parallel runs never share one, and namespaces of this
prefix left behind by a killed run (its pid gone) are removed at the next start.

`reachable(address)` tells the load client (loadtest/client.py) that an address is one of
these hosts and that the calling thread is inside them, where nothing else is reachable.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import IO, Any, TypeVar

PREFIX = "kvt"
SUBNET = "10.77.0"
_NAME = re.compile(rf"^{PREFIX}-(\d+)-")
_PR_SET_PDEATHSIG = 1
_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)
_prctl = _libc.prctl  # (resolved before any fork)
_LIVE: list[Net] = []  # the hosts up in this process
T = TypeVar("T")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10,
                          check=check)


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "no `ip` command (apt-get install iproute2)"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"network namespaces unsupported here: {made.stderr.strip()[:200]}"
    _ip("netns", "del", probe, check=False)
    return None


def _kill_inside(ns: str) -> None:
    """SIGKILL every process still in namespace ``ns`` (only ever one of ours)."""
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def reap_stale() -> None:
    """Remove namespaces of this prefix whose process is gone."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split(" ", 1)[0]
        m = _NAME.match(name)
        if m and int(m.group(1)) != os.getpid() and _gone(int(m.group(1))):
            _kill_inside(name)
            _ip("netns", "del", name, check=False)


def _child_setup() -> None:
    # the kernel kills the child when the thread that started it dies, even by SIGKILL
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class Net:
    def __init__(self, names: Sequence[str]) -> None:
        base = f"{PREFIX}-{os.getpid()}"
        self.switch = f"{base}-sw"
        self.ns = {name: f"{base}-{name}" for name in names}
        self.addr = {name: f"{SUBNET}.{i + 1}" for i, name in enumerate(names)}
        self.procs: list[subprocess.Popen[bytes]] = []

    def ip(self, host: str) -> str:
        return self.addr[host]

    def _up(self) -> None:
        sw = self.switch
        _ip("netns", "add", sw)
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        for i, (host, ns) in enumerate(self.ns.items()):
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", sw, "link", "add", f"h{i}", "type", "veth", "peer", "name", "eth0",
                "netns", ns)
            _ip("-n", sw, "link", "set", f"h{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.addr[host]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")

    def _down(self) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)
        for ns in [*self.ns.values(), self.switch]:
            _kill_inside(ns)  # (a grandchild that left its process group)
            _ip("netns", "del", ns, check=False)

    def spawn(self, host: str, argv: Sequence[str], log: Path | None = None,
              env: dict[str, str] | None = None, pipes: bool = False
              ) -> subprocess.Popen[bytes]:
        """Start ``argv`` on ``host`` (its own process group, killed at exit). Output goes
        to ``log``, or to pipes with ``pipes``. The environment loses any HTTP proxy: one
        outside these namespaces is unreachable from them."""
        clean = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
        out: IO[Any] | int = subprocess.DEVNULL
        if log is not None:
            out = log.open("ab")
        try:
            p = subprocess.Popen(
                ["ip", "netns", "exec", self.ns[host], *argv], env={**clean, **(env or {})},
                stdin=subprocess.PIPE if pipes else subprocess.DEVNULL,
                stdout=subprocess.PIPE if pipes else out,
                stderr=out if pipes else subprocess.STDOUT,
                start_new_session=True, preexec_fn=_child_setup)
        finally:
            if log is not None:
                out.close()  # type: ignore[union-attr]
        self.procs.append(p)
        return p

    def run_in(self, host: str, main: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """``asyncio.run(main())`` in a thread of its own inside ``host``'s network: every
        socket it opens is that host's. Its result, or its exception raised here."""
        out: list[T] = []
        err: list[BaseException] = []

        def inside() -> None:
            try:
                with open(f"/run/netns/{self.ns[host]}") as fh:
                    if _libc.setns(fh.fileno(), _CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), f"setns into {host}")
                out.append(asyncio.run(main()))
            except BaseException as e:  # (handed to the caller)
                err.append(e)

        # a daemon: a signal that ends the caller ends the process, thread and all
        t = threading.Thread(target=inside, name=f"netns-{host}", daemon=True)
        t.start()
        t.join()
        if err:
            raise err[0]
        return out[0]

    def holds(self, address: str) -> bool:
        """Is ``address`` one of these hosts', and this thread inside one of them?"""
        if address not in self.addr.values():
            return False
        here = os.stat("/proc/thread-self/ns/net")
        return any(_same(here, os.stat(f"/run/netns/{ns}")) for ns in self.ns.values())

    @contextlib.contextmanager
    def client(self, host: str) -> Iterator[Client]:
        c = Client(self.spawn(host, [sys.executable, "-c", _CLIENT], pipes=True))
        try:
            yield c
        finally:
            c.proc.kill()
            c.proc.wait(10)


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def reachable(address: str) -> bool:
    """Is ``address`` a host of hosts() up in this process, and the calling thread inside
    that network (so a connection to it cannot leave the namespaces)?"""
    return any(net.holds(address) for net in _LIVE)


@contextlib.contextmanager
def hosts(*names: str) -> Iterator[Net]:
    """Namespaces ``names`` on one bridge, removed (with their processes) at exit, even
    on an exception; RuntimeError saying why where namespaces cannot be made."""
    why = unavailable()
    if why:
        raise RuntimeError(why)
    reap_stale()
    net = Net(names)
    try:
        net._up()
        _LIVE.append(net)
        yield net
    finally:
        if net in _LIVE:
            _LIVE.remove(net)
        net._down()


# One request at a time: a JSON line in, a JSON line out. urllib, no proxies: the
# interpreter starts in well under a second and sends only where it is told.
_CLIENT = """
import json, sys, urllib.error, urllib.request
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
for line in sys.stdin:
    q = json.loads(line)
    data = None if q["body"] is None else json.dumps(q["body"]).encode()
    req = urllib.request.Request(q["url"], data=data, method=q["method"],
                                 headers={"Content-Type": "application/json"})
    try:
        with opener.open(req, timeout=q["timeout"]) as r:
            out = [r.status, dict(r.headers), r.read().decode()]
    except urllib.error.HTTPError as e:
        out = [e.code, dict(e.headers), e.read().decode()]
    except Exception as e:
        out = [0, {}, repr(e)]
    print(json.dumps(out), flush=True)
"""


class Client:
    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc

    def request(self, method: str, url: str, body: Any = None, timeout: float = 30
                ) -> tuple[int, dict[str, str], str]:
        """(status, headers with lower-case names, body text); status 0: no answer."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        q = {"method": method, "url": url, "body": body, "timeout": timeout}
        self.proc.stdin.write(json.dumps(q).encode() + b"\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout + 5)
        if not ready:
            raise TimeoutError(f"{method} {url}: the client did not answer")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{method} {url}: the client exited")
        status, headers, text = json.loads(line)
        return status, {k.lower(): v for k, v in headers.items()}, text
