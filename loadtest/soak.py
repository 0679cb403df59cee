"""`python -m loadtest soak`: the agentic workload for a bounded time, with faults.

A `kvroute serve` subprocess (fresh managed backends) takes a steady agentic workload
while faults are injected on a schedule:

- every `--kill-every` s a backend's llama-server is killed (SIGKILL, in turn); the
  supervisor restarts it;
- every `--disconnect-every` s a client opens a stream and goes away after its first
  event;
- every `--malformed-every` s a malformed request is sent (must get a 4xx).

Reported: requests sent, succeeded, retried (the proxy's `kvroute_retries_total`), failed
by cause (a failure is *expected* only for a stream that was in flight on a backend when
it was killed), malformed requests answered 4xx vs otherwise, and the proxy's RSS at start
(after warm-up), peak and end. Bounded in time and requests; loopback targets only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from loadtest import workloads as wl
from loadtest.client import LoadClient, Result
from loadtest.fleet import Cluster
from loadtest.runner import kvroute_serve, write_config

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


@dataclass
class Faults:
    kills: list[tuple[float, str]] = field(default_factory=list)  # (run time, backend)
    disconnects: int = 0
    malformed: dict[str, int] = field(default_factory=dict)  # status class -> count
    rss_kib: list[int] = field(default_factory=list)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def serve_state(log_dir: Path) -> dict[str, Any]:
    return dict(json.loads((log_dir / "backends.json").read_text()))


async def _every(period: float, t0: float, end: float, fn: Any) -> None:
    n = 1
    while (at := t0 + n * period) < end:
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        with contextlib.suppress(Exception):  # a fault injector must not stop the run
            await fn()
        n += 1


async def inject(url: str, log_dir: Path, args: argparse.Namespace, t0: float,
                 faults: Faults) -> None:
    end = t0 + args.minutes * 60
    rng = random.Random(args.seed)
    proxy_pid = int(serve_state(log_dir)["kvroute_pid"])
    turn = 0
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))

    async def kill() -> None:
        nonlocal turn
        backends = [b for b in serve_state(log_dir)["backends"]
                    if b.get("pid") and b.get("state") == "ready"]
        if not backends:
            return
        victim = backends[turn % len(backends)]
        turn += 1
        os.kill(int(victim["pid"]), signal.SIGKILL)
        faults.kills.append((time.monotonic() - t0, str(victim["name"])))

    async def disconnect() -> None:
        body = {"model": "kvroute-demo", "max_tokens": 400, "ignore_eos": True, "stream": True,
                "messages": [{"role": "user", "content": wl.words(rng, 80)}]}
        async with http.post(url + "/v1/chat/completions", json=body) as r:
            await r.content.readline()
            faults.disconnects += 1
            r.close()  # goes away mid-stream

    async def malformed() -> None:
        path, body = rng.choice(MALFORMED)
        async with http.post(url + path, data=body,
                             headers={"Content-Type": "application/json"}) as r:
            await r.read()
            key = "4xx" if 400 <= r.status < 500 else str(r.status)
            faults.malformed[key] = faults.malformed.get(key, 0) + 1

    async def sample() -> None:
        faults.rss_kib.append(rss_kib(proxy_pid))

    try:
        await asyncio.gather(_every(args.kill_every, t0, end, kill),
                             _every(args.disconnect_every, t0, end, disconnect),
                             _every(args.malformed_every, t0, end, malformed),
                             _every(5.0, t0, end, sample))
    finally:
        await http.close()


def classify(r: Result, kills: list[tuple[float, str]]) -> str:
    """Why a request failed; `killed_stream` is the expected kind."""
    err = r.error or ""
    on_killed = any(name == r.backend and r.sent_s <= at <= r.sent_s + r.e2e_s + 0.5
                    for at, name in kills)
    if err.startswith("stream error") and on_killed:
        return "killed_stream"
    if err.startswith("HTTP"):
        return err.split(":")[0].lower().replace(" ", "_")
    return err.split(":")[0] or "unknown"


async def metric_sum(url: str, name: str) -> float:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
        text = await r.text()
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.startswith(name) and not ln.startswith("#"))


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(args.out).parent / "soak-run"
    cluster = Cluster(backends=2, slots=2, ctx_per_slot=8192)
    cfg = write_config(work / "soak.yaml", cluster, cluster.backends, "prefix")
    log_dir = work / "logs" / "soak"
    # sessions arrive for the whole run; each plays `turns` turns
    sessions = max(1, int(args.minutes * 60 * args.session_rate))
    workload = wl.agentic(sessions=sessions, turns=args.turns, prefix_tokens=args.prefix_tokens,
                          context_tokens=300, tool_tokens=120, max_tokens=16, think_s=1.0,
                          session_rate=args.session_rate, seed=args.seed)
    async with kvroute_serve(cfg, "prefix", cluster.backends, cluster.startup_timeout_s) as url:
        proxy_pid = int(serve_state(log_dir)["kvroute_pid"])
        faults = Faults()
        client = LoadClient(url, time_limit_s=args.minutes * 60, max_requests=args.max_requests,
                            request_timeout_s=120)
        t0 = time.monotonic()
        injector = asyncio.create_task(inject(url, log_dir, args, t0, faults))
        outcome = await client.run(workload)
        injector.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await injector
        retries = await metric_sum(url, "kvroute_retries_total")
        trips = await metric_sum(url, "kvroute_breaker_trips_total")
        rss_end = rss_kib(proxy_pid)
    failed: dict[str, int] = {}
    for r in outcome.results:
        if not r.ok:
            cause = classify(r, faults.kills)
            failed[cause] = failed.get(cause, 0) + 1
    samples = faults.rss_kib or [rss_end]
    return {
        "minutes": args.minutes, "sessions": sessions, "sent": len(outcome.results),
        "succeeded": sum(r.ok for r in outcome.results), "retried": int(retries),
        "failed": failed, "cut_by_time_limit": outcome.cut,
        "unexpected_failures": sum(n for c, n in failed.items() if c != "killed_stream"),
        "kills": [{"at_s": round(at, 1), "backend": b} for at, b in faults.kills],
        "breaker_trips": int(trips), "client_disconnects": faults.disconnects,
        "malformed": faults.malformed,
        "rss_mib": {"start": round(samples[0] / 1024, 1),
                    "peak": round(max([*samples, rss_end]) / 1024, 1),
                    "end": round(rss_end / 1024, 1)},
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=10.0, help="run length (bounded)")
    p.add_argument("--session-rate", type=float, default=0.15, help="new sessions per second")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--prefix-tokens", type=int, default=1500)
    p.add_argument("--kill-every", type=float, default=90.0, help="s between backend kills")
    p.add_argument("--disconnect-every", type=float, default=10.0)
    p.add_argument("--malformed-every", type=float, default=2.0)
    p.add_argument("--max-requests", type=int, default=5000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="loadtest-results/soak.json", help="JSON result file")


def main_soak(args: argparse.Namespace) -> int:
    result = asyncio.run(soak(args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    ok = result["unexpected_failures"] == 0 and set(result["malformed"]) <= {"4xx"}
    return 0 if ok else 1
