"""`bench_proxy.py --replicas`: what sharing the view over NATS adds to a proxied request.

Processes: bench_proxy's fake backend; nats-server on 127.0.0.1; kvroute alone ("off");
kvroute replica r0 on that broker ("on"); replica r1 on the same broker in front of the
same fake backend, sent nothing: it hears r0's events and applies them to its view, as
a peer does; and this client. Each body goes to the fake backend directly, to off and to
on, in turn, then in runs to one target (a proxy in steady use; latency.added_latency):
small chat requests, and 30k-token turns whose history was seen. Printed: the median each
proxy adds, on - off, each proxy's CPU per request, and the events r0 sent and r1 applied
per request (that sharing really ran), and the peer's CPU per request (applying them).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import aiohttp
from latency import added_latency, cpu_seconds, free_port, long_history, turns_after, wait_up

_EVENTS = re.compile(r'^kvroute_replica_events_total\{event="(\w+)"\} (\S+)$', re.M)


async def events(session: aiohttp.ClientSession, base: str) -> dict[str, float]:
    """A replica's kvroute_replica_events_total by event (its /metrics)."""
    async with session.get(base + "/metrics") as r:
        return {k: float(v) for k, v in _EVENTS.findall(await r.text())}


async def connected(session: aiohttp.ClientSession, bases: list[str], timeout: float = 30
                    ) -> None:
    deadline = time.monotonic() + timeout
    for base in bases:
        while True:
            async with session.get(base + "/kvroute/status") as r:
                if ((await r.json()).get("replicas") or {}).get("connected"):
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{base}: not connected to the broker in {timeout:.0f} s")
            await asyncio.sleep(0.2)
    await asyncio.sleep(1.5)  # (each hears the other's first alive)


async def measure(urls: dict[str, str], pids: dict[str, int], quick: bool
                  ) -> dict[str, float]:
    fake, off, on, peer = urls["fake"], urls["off"], urls["on"], urls["peer"]
    async with aiohttp.ClientSession() as session:
        for u in urls.values():
            await wait_up(session, u)
        await connected(session, [on, peer])
        before_on, before_peer = await events(session, on), await events(session, peer)
        peer_cpu0 = cpu_seconds(pids["peer"])
        n_small, n_long = (200, 30) if quick else (1000, 100)
        small = [json.dumps({"messages": [{"role": "user", "content": f"hr {i}"}],
                             "max_tokens": 1}).encode() for i in range(4 * n_small)]
        history = long_history(random.Random(0))
        rng = random.Random(1)
        # (name, bodies, warm-up, block): each body to every target in turn, then in runs
        # to one target (a proxy in steady use); the first long turn makes it seen
        plan = [("small", small[:n_small], 50, 1),
                ("long", turns_after(history, n_long + 1, rng), 1, 1),
                ("small_steady", small[n_small:], 150, 50),
                ("long_steady", turns_after(history, 3 * n_long, rng), 0, 10)]
        figures = {name: await added_latency(session, fake, on, bodies, warmup, pids["on"],
                                             bare=off, block=block, bare_pid=pids["off"])
                   for name, bodies, warmup, block in plan}
        peer_cpu = cpu_seconds(pids["peer"]) - peer_cpu0
        after_on, after_peer = await events(session, on), await events(session, peer)
    n = sum(len(bodies) for _, bodies, _, block in plan if block == 1) + \
        sum(len(bodies) // 3 for _, bodies, _, block in plan if block > 1)

    def per_request(now: dict[str, float], then: dict[str, float], kind: str) -> float:
        return (now.get(kind, 0.0) - then.get(kind, 0.0)) / n

    out = {f"{name}_{k}": v for name, m in figures.items()
           for k, v in (("off_added_ms", m["bare_added"]), ("on_added_ms", m["added"]),
                        ("off_cpu_ms", m["bare_cpu"]), ("on_cpu_ms", m["cpu"]),
                        ("direct_ms", m["direct"]))}
    out.update(sent_per_request=per_request(after_on, before_on, "sent"),
               peer_applied_per_request=per_request(after_peer, before_peer, "applied"),
               peer_ignored_per_request=per_request(after_peer, before_peer, "ignored"),
               peer_cpu_ms=peer_cpu * 1000 / n,
               dropped=after_on.get("dropped", 0.0) - before_on.get("dropped", 0.0))
    return out


def run(me: list[str], model: Path, quick: bool, ram_mib: int) -> dict[str, float]:
    """Start the processes (``me``: bench_proxy.py's argv), measure, stop them all."""
    nats = shutil.which("nats-server")
    if nats is None:
        raise RuntimeError("nats-server not found (apt-get install nats-server)")
    ports = {k: free_port() for k in ("fake", "off", "on", "peer", "nats")}
    urls = {k: f"http://127.0.0.1:{ports[k]}" for k in ("fake", "off", "on", "peer")}
    broker = f"nats://127.0.0.1:{ports['nats']}"
    with tempfile.TemporaryDirectory() as tmp:
        def proxy(name: str, *replica: str) -> subprocess.Popen[bytes]:
            return subprocess.Popen([*me, "--role", "proxy", "--port", str(ports[name]),
                                     "--backend-port", str(ports["fake"]), "--model",
                                     str(model), "--log", str(Path(tmp) / f"{name}.log"),
                                     "--ram-mib", str(ram_mib), *replica])

        procs = {"fake": subprocess.Popen([*me, "--role", "fake", "--port",
                                           str(ports["fake"])]),
                 "nats": subprocess.Popen([nats, "-a", "127.0.0.1", "-p", str(ports["nats"])],
                                          stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL)}
        try:
            procs["off"] = proxy("off")
            procs["on"] = proxy("on", "--nats", broker, "--replica", "r0")
            procs["peer"] = proxy("peer", "--nats", broker, "--replica", "r1")
            return asyncio.run(measure(urls, {k: p.pid for k, p in procs.items()}, quick))
        finally:
            for p in procs.values():
                p.terminate()
            for p in procs.values():
                p.wait(10)


def report(res: dict[str, float]) -> None:
    for kind, what in (("small", "small request "), ("long", "30k-token turn"),
                       ("small_steady", "small, steady "), ("long_steady", "30k, steady   ")):
        off, on = res[f"{kind}_off_added_ms"], res[f"{kind}_on_added_ms"]
        c_off, c_on = res[f"{kind}_off_cpu_ms"], res[f"{kind}_on_cpu_ms"]
        print(f"{what}: added median, replicas off {off:.3f} ms, on {on:.3f} ms: on - off "
              f"{on - off:+.3f} ms ({on / off:.2f}x); proxy CPU {c_off:.3f} / {c_on:.3f} "
              f"ms/request ({c_on / c_off:.2f}x); direct {res[f'{kind}_direct_ms']:.3f} ms")
    print(f"sharing ran: r0 sent {res['sent_per_request']:.2f} events a request, the peer "
          f"applied {res['peer_applied_per_request']:.2f} (ignored "
          f"{res['peer_ignored_per_request']:.2f}; its CPU {res['peer_cpu_ms']:.3f} ms a "
          f"request, on the same 2 cores); dropped {res['dropped']:.0f}")
    print(json.dumps({k: round(v, 4) for k, v in res.items()}))
