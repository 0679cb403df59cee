"""What the proxy benches measure with: interleaved latencies, a process's CPU time, and
the helpers around them (bench_proxy.py, proxy_replicas.py, bench_upstream.py)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import statistics
import time
from pathlib import Path

import aiohttp


def words(n: int, rng: random.Random) -> str:
    vocab = ("apple", "river", "stone", "cloud", "music", "paper", "window", "garden",
             "silver", "orange", "planet", "forest", "yellow", "rabbit", "engine", "pocket")
    return " ".join(rng.choice(vocab) for _ in range(n))


def long_history(rng: random.Random) -> list[dict[str, str]]:
    """A conversation of ~30k tokens: a system prompt and 99 turns of ~300 words."""
    history = [{"role": "system", "content": words(300, rng)}]
    while len(history) < 100:
        role = "user" if len(history) % 2 else "assistant"
        history.append({"role": role, "content": words(300, rng)})
    return history


def turns_after(history: list[dict[str, str]], n: int, rng: random.Random) -> list[bytes]:
    """``n`` chat bodies: ``history`` and a new user message of 40 words each."""
    return [json.dumps({"messages": [*history, {"role": "user", "content": words(40, rng)}],
                        "max_tokens": 1}).encode() for _ in range(n)]


async def wait_up(session: aiohttp.ClientSession, url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            async with session.get(url + "/health") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} did not come up")


async def added_latency(session: aiohttp.ClientSession, direct: str, proxied: str,
                        bodies: list[bytes], warmup: int, proxy_pid: int,
                        bare: str | None = None, block: int = 1,
                        first_event: bool = False, bare_pid: int | None = None
                        ) -> dict[str, float]:
    """Median direct and proxied latency (ms), interleaved so drift hits both alike (and
    the bare aiohttp forwarder's, when given: or any third target, such as another
    proxy), and the proxy's CPU time per proxied request (ms; after the warm-up, and
    robust to the load other processes put on the machine, unlike the latencies); with
    `bare_pid`, the third target's CPU per request too (`bare_cpu`).

    `first_event`: the bodies ask for a stream; the time is to its first event (TTFT).

    `block` = 1 sends each body to every target, in turn: each server sits idle while
    the others answer, and on this VM a process woken from idle pays for it (the direct
    request alone doubles in some minutes). `block` > 1 sends the bodies in runs of
    `block` to one target after the other (each body to one target; the first fifth of
    each run is not counted): a server in steady use, as a proxy under traffic is."""
    bases = [b for b in (proxied, direct, bare) if b]
    times: dict[str, list[float]] = {b: [] for b in bases}
    hdr = {"Content-Type": "application/json"}
    pids = {proxied: proxy_pid, **({bare: bare_pid} if bare and bare_pid else {})}
    cpu0 = {b: cpu_seconds(p) for b, p in pids.items()}
    sent = dict.fromkeys(pids, 0)
    skip = block // 5
    for i, body in enumerate(bodies):
        if i == warmup:
            cpu0, sent = {b: cpu_seconds(p) for b, p in pids.items()}, dict.fromkeys(pids, 0)
        if block == 1:
            order = bases[i % len(bases):] + bases[:i % len(bases)]
        else:
            order = [bases[(i // block) % len(bases)]]
        for base in order:
            sent[base] = sent.get(base, 0) + 1
            t0 = time.perf_counter()
            async with session.post(base + "/v1/chat/completions", data=body,
                                    headers=hdr) as r:
                assert r.status == 200, await r.text()
                if first_event:  # a stream: the time to its first event
                    await r.content.readuntil(b"\n\n")
                    t1 = time.perf_counter()
                await r.read()
            if i >= warmup and i % block >= skip:
                t_end = t1 if first_event else time.perf_counter()
                times[base].append((t_end - t0) * 1000)
    cpu = {b: (cpu_seconds(p) - cpu0[b]) * 1000 / max(1, sent[b]) for b, p in pids.items()}
    med = {b: statistics.median(t) for b, t in times.items()}
    out = {"direct": med[direct], "proxied": med[proxied],
           "added": med[proxied] - med[direct], "cpu": cpu[proxied]}
    if bare:
        out["bare_added"] = med[bare] - med[direct]
    if bare in cpu:
        out["bare_cpu"] = cpu[bare]
    return out


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_proxy(cfg: object, model: Path, port: int) -> None:
    """kvroute's app for ``cfg`` (a proxy.config.load.Config) on 127.0.0.1:``port``, as
    `kvroute serve` runs it (its backends supervised, ``model`` the tokenizer), until the
    process is killed."""
    from aiohttp import web

    from backends.supervisor import Supervisor
    from proxy.app import create_app
    from proxy.config.settings import ProxySettings
    from proxy.server.runner import make_runner

    async def main() -> None:
        sup = Supervisor(cfg)  # type: ignore[arg-type]
        await sup.start()
        runner = make_runner(create_app(cfg, sup, ProxySettings(tokenizer=model)))  # type: ignore[arg-type]
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    asyncio.run(main())
