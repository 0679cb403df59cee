"""Two kvroute replicas under faults: one killed mid-run, the broker stopped for a while;
and what sharing costs: the broker's traffic per routed request, the replicas' CPU and
TTFT against one replica and two that share nothing.

    python bench/bench_replica_faults.py [--runs one,shared,alone,kill,outage]
        [--sessions 16] [--turns 6] [--session-rate 0.12] [--kill-at 75]
        [--outage-at 40] [--outage-s 30] [--out /tmp/bench_replica_faults]

Every run gets fresh llama-servers (demo model, 4 x 2 slots, no RAM tier) as `url:`
backends, and its replicas as `kvroute serve` processes (their logs in --out). The agentic
workload (loadtest/workloads.py, sessions arriving over ~2 min) is sent round-robin over
the replicas by the client, which also does what a balancer's passive health check does:
a replica that refuses a connection is dropped and the request goes to the next (it
never reached the refused one). Runs:

- one: one replica, no broker (the reference every window is compared with);
- shared: two replicas over nats-server; its /varz before and after gives messages and
  bytes per routed request, a tap subscriber splits them by event kind;
- alone: two replicas that share nothing;
- kill: two shared replicas, r1 SIGKILLed at --kill-at s: which requests failed (against
  those in flight on r1 then), when the survivor's /kvroute/status drops its peer, and
  the survivor's reuse and prediction before and after;
- outage: two shared replicas, the broker SIGKILLed at --outage-at s and started again on
  the same port --outage-s later: reuse and prediction before, during and after, beside
  the same windows of `one` and `shared`.

Also, in this process: the CPU to encode and decode one request's events (its `start`
with the prompt, `first`, its `end` with the answer) at 2k / 8k / 32k prompt tokens, real
ids (this tree's README and docs in the demo model's vocabulary). Reused = backend-reported
/ prompt tokens; exact = predicted within max(16, 2%) of the report.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from array import array
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backends.demo_model import ensure_demo_model  # noqa: E402
from backends.process import free_port  # noqa: E402
from loadtest.client import Result  # noqa: E402
from loadtest.fleet import Cluster, external_config, fresh_servers  # noqa: E402
from loadtest.replica_set import (  # noqa: E402
    Balancer,
    Broker,
    Replica,
    get_json,
    start_replica,
    wait_ready,
)
from loadtest.workloads import Workload, agentic  # noqa: E402
from proxy.replicas.events import Event, Kind, decode, encode  # noqa: E402
from proxy.replicas.parts import is_part  # noqa: E402

RUNS = ("one", "shared", "alone", "kill", "outage")
_EVENTS = re.compile(r'^kvroute_replica_events_total\{event="(\w+)"\} (\S+)$', re.M)


@dataclass
class RunResult:
    mode: str
    results: list[Result]
    target: dict[str, str]
    replicas: list[str]  # their URLs, r0 first
    wall_s: float
    cpu_s: dict[str, float] = field(default_factory=dict)  # per replica, during the load
    events: dict[str, dict[str, float]] = field(default_factory=dict)  # replica -> counts
    traffic: dict[str, Any] = field(default_factory=dict)
    timeline: list[tuple[float, str, dict[str, Any]]] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)


def workload(args: argparse.Namespace) -> Workload:
    return agentic(sessions=args.sessions, turns=args.turns, prefix_tokens=2000,
                   context_tokens=800, tool_tokens=200, reply_tokens=30, max_tokens=8,
                   think_s=args.think_s, session_rate=args.session_rate, seed=args.seed)


async def event_counts(http: aiohttp.ClientSession, r: Replica) -> dict[str, float]:
    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
        async with http.get(r.url + "/metrics", timeout=aiohttp.ClientTimeout(total=3)) as resp:
            return {k: float(v) for k, v in _EVENTS.findall(await resp.text())}
    return {}


class Tap:
    """A subscriber of the replicas' subjects: messages and bytes by event kind."""

    def __init__(self) -> None:
        self.msgs: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        self.nc: Any = None

    async def start(self, url: str) -> None:
        import nats

        async def quiet(e: Exception) -> None:
            pass

        self.nc = await nats.connect(servers=[url], name="bench tap", error_cb=quiet,
                                     max_reconnect_attempts=-1, reconnect_time_wait=1)

        async def on_msg(msg: Any) -> None:
            e = decode(msg.data)
            # (a part of an event larger than the broker's max payload: parts.py)
            kind = "part" if is_part(msg.data) else "invalid" if e is None else e.kind.value
            self.msgs[kind] += 1
            self.bytes[kind] += len(msg.data)

        await self.nc.subscribe("kvroute.>", cb=on_msg)
        await self.nc.flush()

    async def stop(self) -> None:
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.flush(2)
                await self.nc.close()


async def run(mode: str, args: argparse.Namespace, broker: Broker) -> RunResult:
    out = args.out / mode
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cluster = Cluster(backends=args.backends, slots=args.slots, cache_ram_mib=0)
    w = workload(args)
    shared = mode in ("shared", "kill", "outage")
    n = 1 if mode == "one" else 2
    async with fresh_servers(cluster, out / "servers") as urls, aiohttp.ClientSession() as http:
        base = external_config(out / "kvroute.yaml", cluster, urls, "prefix")
        reps = [await start_replica(base, f"r{i}", broker.url if shared else None, out)
                for i in range(n)]
        tap = Tap()
        try:
            for r in reps:
                await wait_ready(http, r, args.backends, shared)
            if shared:
                await tap.start(broker.url)
                # (each hears the other's `alive` before the first request)
                await asyncio.sleep(2.0)
            res = RunResult(mode, [], {}, [r.url for r in reps], 0.0)
            events0 = {r.name: await event_counts(http, r) for r in reps}
            varz0 = broker.varz_sync() if shared else {}
            cpu0 = {r.name: r.cpu_s() for r in reps}
            client = Balancer([r.url for r in reps], time_limit_s=args.time_limit,
                              max_requests=len(w.requests()))
            t0 = time.perf_counter()
            watch = asyncio.create_task(watcher(http, reps, res, t0))
            acts = asyncio.create_task(actions(mode, args, reps, broker, res, t0))
            try:
                outcome = await client.run(w)
            finally:
                for t in (watch, acts):
                    t.cancel()
                await asyncio.gather(watch, acts, return_exceptions=True)
            res.wall_s = outcome.wall_s
            res.results, res.target = outcome.results, client.target
            res.notes["cut"], res.notes["skipped"] = outcome.cut, outcome.skipped
            res.notes["dropped"] = {u: at - t0 for u, at in client.dropped.items()}
            live = [r for r in reps if r.proc.poll() is None]
            res.cpu_s = {r.name: r.cpu_s() - cpu0[r.name] for r in live}
            if shared:
                await asyncio.sleep(1.0)  # (the last events reach the broker and the tap)
                varz1 = broker.varz_sync()
                res.traffic = {k: varz1[k] - varz0.get(k, 0) for k in
                               ("in_msgs", "in_bytes", "out_msgs", "out_bytes")}
                res.traffic["restarted"] = mode == "outage"
                res.traffic["tap_msgs"] = dict(tap.msgs)
                res.traffic["tap_bytes"] = dict(tap.bytes)
            for r in live:
                e1 = await event_counts(http, r)
                res.events[r.name] = {k: v - events0[r.name].get(k, 0.0) for k, v in e1.items()}
            return res
        finally:
            await tap.stop()
            for r in reps:
                if r.proc.poll() is None:
                    r.proc.send_signal(signal.SIGTERM)
            for r in reps:
                try:
                    await asyncio.to_thread(r.proc.wait, 30)
                except subprocess.TimeoutExpired:
                    r.proc.kill()
            if mode == "outage" and (broker.proc is None or broker.proc.poll() is not None):
                broker.start()


async def watcher(http: aiohttp.ClientSession, reps: list[Replica], res: RunResult,
                  t0: float) -> None:
    """Each replica's `replicas` status every 0.5 s (a changed one goes in the timeline)."""
    last: dict[str, Any] = {}
    while True:
        for r in reps:
            if r.proc.poll() is not None:
                continue
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                s = (await get_json(http, r.url + "/kvroute/status")).get("replicas") or {}
                now = {"connected": s.get("connected"), "peers": s.get("peers"),
                       "peers_in_flight": s.get("peers_in_flight")}
                if now != last.get(r.name):
                    last[r.name] = now
                    res.timeline.append((time.perf_counter() - t0, r.name, now))
        await asyncio.sleep(0.5)


async def actions(mode: str, args: argparse.Namespace, reps: list[Replica], broker: Broker,
                  res: RunResult, t0: float) -> None:
    async def at(s: float) -> None:
        await asyncio.sleep(max(0.0, t0 + s - time.perf_counter()))

    if mode == "kill":
        await at(args.kill_at)
        reps[1].proc.kill()
        res.notes["kill_s"] = time.perf_counter() - t0
    elif mode == "outage":
        await at(args.outage_at)
        broker.kill()
        res.notes["broker_down_s"] = time.perf_counter() - t0
        await at(args.outage_at + args.outage_s)
        await asyncio.to_thread(broker.start)
        res.notes["broker_up_s"] = time.perf_counter() - t0


# -- figures -----------------------------------------------------------------------------


def counted(r: Result) -> bool:
    return r.ok and bool(r.prompt_tokens) and r.cached_tokens is not None \
        and r.predicted_cached is not None


def reuse(rs: list[Result]) -> tuple[float, float, int]:
    """reused / prompt tokens, the share predicted exactly, how many (counted ones)."""
    done = [r for r in rs if counted(r)]
    if not done:
        return float("nan"), float("nan"), 0
    reused = sum(r.cached_tokens or 0 for r in done)
    exact = sum(abs((r.predicted_cached or 0) - (r.cached_tokens or 0))
                <= max(16, 0.02 * (r.cached_tokens or 0)) for r in done)
    return reused / sum(r.prompt_tokens or 0 for r in done), exact / len(done), len(done)


def window(rs: list[Result], lo: float, hi: float) -> list[Result]:
    return [r for r in rs if lo <= r.sent_s < hi]


def ttft(rs: list[Result]) -> tuple[float, float]:
    t = [r.ttft_s for r in rs if counted(r) and r.ttft_s is not None]
    return (statistics.fmean(t), statistics.median(t)) if t else (float("nan"),) * 2


def fmt(v: tuple[float, float, int]) -> str:
    return f"{v[0]:.3f} / {v[1]:.0%} ({v[2]})"


def report_kill(k: RunResult, one: RunResult | None) -> list[tuple[str, str]]:
    kill = k.notes.get("kill_s")
    if kill is None:
        return [("kill", "not reached")]
    dead, survivor = k.replicas[1], k.replicas[0]
    in_flight = {r.id for r in k.results if k.target.get(r.id) == dead
                 and r.sent_s < kill < r.sent_s + r.e2e_s}
    failed = [r for r in k.results if not counted(r)]
    others = [(r.id, r.error) for r in failed if r.id not in in_flight]
    gone = next((t for t, name, s in k.timeline if name == "r0" and t > kill
                 and "r1" not in (s["peers"] or ())), None)
    idle = next((t for t, name, s in k.timeline if name == "r0" and t > kill
                 and "r1" not in (s["peers"] or ()) and not s["peers_in_flight"]), None)
    mine = [r for r in k.results if k.target.get(r.id) == survivor]
    rows = [
        ("kill: r1 SIGKILLed at", f"{kill:.1f} s; requests in flight on r1 then: "
                                  f"{len(in_flight)}"),
        ("kill: requests failed", f"{len(failed)} of {len(k.results) + k.notes['skipped']}; "
                                  f"of them in flight on r1 at the kill: "
                                  f"{sum(r.id in in_flight for r in failed)}; others: "
                                  f"{len(others)} {others[:3]}"),
        ("kill: client dropped r1 (refused) at",
         ", ".join(f"{v:.1f} s" for v in k.notes["dropped"].values()) or "never"),
        ("kill: r0's peers drop r1 / its in-flight 0", f"{gone - kill:+.1f} s / "
         f"{idle - kill:+.1f} s after the kill" if gone and idle else f"{gone} / {idle}"),
        ("kill: r0 reused / exact, before", fmt(reuse(window(mine, 0, kill)))),
        ("kill: r0 after (all traffic)", fmt(reuse(window(mine, kill, 1e9)))),
        ("kill: r0 after, from +10 s", fmt(reuse(window(mine, kill + 10, 1e9)))),
    ]
    if one is not None:
        rows.append(("kill: one replica, same windows",
                     f"{fmt(reuse(window(one.results, 0, kill)))}  |  "
                     f"{fmt(reuse(window(one.results, kill, 1e9)))}"))
    return rows


def report_outage(o: RunResult, refs: list[RunResult], args: argparse.Namespace
                  ) -> list[tuple[str, str]]:
    down = o.notes.get("broker_down_s", args.outage_at)
    up = o.notes.get("broker_up_s", args.outage_at + args.outage_s)
    windows = (("before", 0.0, down), ("during", down, up), ("after", up, 1e9),
               ("after, from +10 s", up + 10, 1e9))
    rows = [("outage: broker down / up at", f"{down:.1f} s / {up:.1f} s")]
    conn = [(t, name, s["connected"]) for t, name, s in o.timeline]
    for name in ("r0", "r1"):
        changes = [(round(t, 1), c) for t, n, c in conn if n == name]
        changes = [c for i, c in enumerate(changes) if i == 0 or c[1] != changes[i - 1][1]]
        rows.append((f"outage: {name} connected (s, state)", str(changes)))
    two = paired(o.results)
    rows.append(("outage: exact, requests alone in their step / sent with another",
                 f"{reuse([x for x in o.results if x.id not in two])[1]:.1%} / "
                 f"{reuse([x for x in o.results if x.id in two])[1]:.1%}"))
    failed = [r for r in o.results if not counted(r)]
    rows.append(("outage: requests failed",
                 f"{len(failed)} {[(r.id, r.error) for r in failed][:3]}"))
    for label, lo, hi in windows:
        cells = [fmt(reuse(window(o.results, lo, hi)))]
        cells += [f"{ref.mode} {fmt(reuse(window(ref.results, lo, hi)))}" for ref in refs]
        ratios = [reuse(window(o.results, lo, hi))[0] / reuse(window(ref.results, lo, hi))[0]
                  for ref in refs]
        cells += [f"x{v:.3f} of {ref.mode}" for v, ref in zip(ratios, refs, strict=True)]
        rows.append((f"outage: {label} reused / exact", "  |  ".join(cells)))
    return rows


def report_traffic(s: RunResult) -> list[tuple[str, str]]:
    # per request routed: the ones cut by the time limit were routed and told too
    t, n = s.traffic, len(s.results) + s.notes["cut"]
    if not t:
        return []
    rows = [("shared: broker in msgs / bytes per request",
             f"{t['in_msgs'] / n:.2f} / {t['in_bytes'] / n:,.0f} B ({n} requests, "
             f"{s.wall_s:.0f} s: {t['in_msgs'] / s.wall_s:.1f} msgs/s, "
             f"{t['in_bytes'] / s.wall_s / 1e3:.1f} kB/s)")]
    tap = sum(t["tap_msgs"].values())
    rows.append(("shared: broker out to replicas per request",
                 f"{(t['out_msgs'] - tap) / n:.2f} msgs / "
                 f"{(t['out_bytes'] - sum(t['tap_bytes'].values())) / n:,.0f} B (the tap's "
                 f"{tap} taken off)"))
    by = ", ".join(f"{k} {t['tap_msgs'][k] / n:.2f} x {t['tap_bytes'][k] / t['tap_msgs'][k]:,.0f} B"
                   for k in sorted(t["tap_msgs"], key=lambda k: -t["tap_bytes"][k]))
    by += f" (alive: {t['tap_msgs'].get('alive', 0) / s.wall_s:.2f}/s)"
    rows.append(("shared: by kind, per request (msgs x mean size)", by))
    for name, ev in s.events.items():
        rows.append((f"shared: {name} kvroute_replica_events_total",
                     ", ".join(f"{k} {v:.0f}" for k, v in sorted(ev.items()))))
    return rows


def codec_cpu(sizes: tuple[int, ...] = (2048, 8192, 32768)) -> list[tuple[str, str]]:
    """CPU to encode and decode one request's events, at each prompt size."""
    from proxy.prompt.tokenizer import FragmentTokenizer

    tok = FragmentTokenizer(ensure_demo_model())
    text = "\n\n".join(p.read_text() for p in [ROOT / "README.md",
                                                 *sorted((ROOT / "docs").glob("*.md"))])
    ids: array = tok.tokenize_ids(text, add_special=False)
    while len(ids) < max(sizes):
        ids += ids
    answer = ids[-8:].tobytes()
    rows = []
    for n in sizes:
        prompt = ids[:n].tobytes()
        evs = [Event("r0", Kind.START, "", "a", 1, 7, prompt),
               Event("r0", Kind.FIRST, "", "a", 0, 7),
               Event("r0", Kind.END, "", "a", 1, 7, answer, n)]
        rounds = max(20, 200_000 // n)
        t = time.process_time()
        for _ in range(rounds):
            data = [encode(e) for e in evs]
        enc = (time.process_time() - t) / rounds
        t = time.process_time()
        for _ in range(rounds):
            for d in data:
                decode(d)
        dec = (time.process_time() - t) / rounds
        rows.append((f"codec: {n // 1024}k-token request: encode / decode",
                     f"{enc * 1e3:.3f} / {dec * 1e3:.3f} ms CPU ({len(data[0]):,} B start)"))
    return rows


def paired(rs: list[Result]) -> set[str]:
    """Requests sent together with another of their session's step (a turn and its title
    or summary call): round robin hands the two to different replicas at the same
    instant, before either has heard of the other's."""
    steps = Counter((r.session, r.turn) for r in rs)
    return {r.id for r in rs if steps[r.session, r.turn] > 1}


def report_cpu_ttft(runs: dict[str, RunResult]) -> list[tuple[str, str]]:
    rows = []
    for mode, r in runs.items():
        if mode not in ("one", "shared", "alone"):
            continue
        n = len(r.results)
        cpu = sum(r.cpu_s.values())
        mean, p50 = ttft(r.results)
        rr = reuse(r.results)
        rows.append((f"{mode}: reused / exact; TTFT mean / p50; replicas' CPU per request",
                     f"{fmt(rr)}; {mean * 1e3:.0f} / {p50 * 1e3:.0f} ms; "
                     f"{cpu / n * 1e3:.2f} ms ({cpu:.1f} s / {n}, wall {r.wall_s:.0f} s)"))
        two = paired(r.results)
        rows.append((f"{mode}: exact, requests alone in their step / sent with another",
                     f"{reuse([x for x in r.results if x.id not in two])[1]:.1%} / "
                     f"{reuse([x for x in r.results if x.id in two])[1]:.1%}"))
    return rows


async def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", default=",".join(RUNS))
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=6)
    # (sized for this 2-core VM: ~3 sessions at a time, TTFT well under a second when warm)
    p.add_argument("--session-rate", type=float, default=0.12)
    p.add_argument("--think-s", type=float, default=3.0)
    p.add_argument("--backends", type=int, default=4)
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-limit", type=float, default=240.0)
    p.add_argument("--kill-at", type=float, default=75.0)  # (a third of the run)
    p.add_argument("--outage-at", type=float, default=40.0)
    p.add_argument("--outage-s", type=float, default=30.0)
    p.add_argument("--out", type=Path, default=Path("/tmp/bench_replica_faults"))
    args = p.parse_args()
    modes = [m for m in args.runs.split(",") if m]
    if unknown := set(modes) - set(RUNS):
        p.error(f"unknown runs {sorted(unknown)}; choose from {RUNS}")
    binary = shutil.which("nats-server")
    if binary is None:
        print("nats-server not found (apt-get install nats-server)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    w = workload(args)
    print(f"agentic: {len(w.sessions)} sessions, {len(w.requests())} requests, last session "
          f"starts at {w.sessions[-1].start_s:.0f} s; logs in {args.out}", flush=True)
    broker = Broker(binary, free_port(), free_port(), args.out / "nats-server.log")
    broker.start()
    runs: dict[str, RunResult] = {}
    try:
        for mode in modes:
            t = time.monotonic()
            runs[mode] = await run(mode, args, broker)
            rr = reuse(runs[mode].results)
            print(f"{mode:8s} reused {rr[0]:.3f}, exact {rr[1]:.1%} of {rr[2]} counted, "
                  f"{len(runs[mode].results)} done, wall {runs[mode].wall_s:.0f} s "
                  f"({time.monotonic() - t:.0f} s with set-up), load "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
    finally:
        broker.kill()
    rows = codec_cpu()
    rows += report_cpu_ttft(runs)
    if "shared" in runs:
        rows += report_traffic(runs["shared"])
    if "kill" in runs:
        rows += report_kill(runs["kill"], runs.get("one"))
    if "outage" in runs:
        rows += report_outage(runs["outage"], [runs[m] for m in ("one", "shared") if m in runs],
                              args)
    width = max(len(k) for k, _ in rows)
    print()
    for k, v in rows:
        print(f"{k:{width}s}  {v}")
    dump = {m: {"notes": r.notes, "traffic": r.traffic, "events": r.events, "cpu_s": r.cpu_s,
                "timeline": r.timeline, "target": r.target,
                "results": [x.to_dict() for x in r.results]} for m, r in runs.items()}
    (args.out / "results.json").write_text(json.dumps(dump, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
