"""`python -m loadtest soak`: the agentic workload for a bounded time, with faults.

Two parts, one after the other, each with its share of `--minutes`:

- **disk** (two thirds): a `kvroute serve` subprocess (fresh managed backends, the disk
  tier on, a small budget) takes a steady agentic workload while faults come on a
  schedule (loadtest/soak_faults.py): a backend's llama-server killed (SIGKILL, in
  turn; the supervisor restarts it), a client leaving mid-stream, malformed JSON and
  bytes that are not HTTP, a saved slot file cut short, the directory unwritable for a
  while. Halfway, kvroute is stopped, garbage is written over its index, and it is
  started again on the same directory: every file it saved and nobody cut short must
  still be there (rebuilt from the files), and the second half runs on.
- **replicas** (one third): two external llama-servers, two kvroute replicas on one
  nats-server, the client balancing over them; the broker is killed for
  `--outage-s` and started again on the same port.

Reported: requests sent, succeeded, retried, failed by cause (a failure is *expected*
only for a stream in flight on a backend when it was killed), malformed requests
answered 4xx in JSON vs otherwise, saved files kept across the restart and lost, files
removed by logged reason and files gone without one, failed saves logged, the proxy's
RSS (after warm-up, peak, end), and processes left behind. Bounded in time and
requests; loopback targets and this run's directories only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from loadtest import workloads as wl
from loadtest.client import LoadClient, Result
from loadtest.fleet import Cluster, external_config, fresh_servers
from loadtest.launch import kvroute_serve, write_config
from loadtest.replica_set import Balancer, Broker, Replica, start_replica, wait_ready
from loadtest.soak_faults import (
    DirWatch,
    Faults,
    Injector,
    every,
    removals,
    rss_kib,
    serve_state,
)

GARBAGE = b"\x00\xff\xfegarbage{{{["


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


def _workload(args: argparse.Namespace, seconds: float, seed: int) -> wl.Workload:
    sessions = max(1, int(seconds * args.session_rate))
    return wl.agentic(sessions=sessions, turns=args.turns, prefix_tokens=args.prefix_tokens,
                      context_tokens=300, tool_tokens=120, max_tokens=16, think_s=1.0,
                      session_rate=args.session_rate, seed=seed)


def _failed(results: list[Result], kills: list[tuple[float, str]]) -> dict[str, int]:
    return dict(Counter(classify(r, kills) for r in results if not r.ok))


async def _half(args: argparse.Namespace, cfg: Path, log_dir: Path, slots: Path,
                seconds: float, seed: int, faults: Faults, watch: DirWatch
                ) -> dict[str, Any]:
    """One kvroute's run on ``cfg`` for ``seconds`` under every fault."""
    n = len(yaml.safe_load(cfg.read_text())["backends"])
    async with kvroute_serve(cfg, "prefix", n, 180.0) as url:
        pid = int(serve_state(log_dir)["kvroute_pid"])
        t0 = time.monotonic()
        end = t0 + seconds
        inj = Injector(url, log_dir, slots, faults, random.Random(seed), t0)

        async def watch_dir() -> None:
            watch.poll()

        injectors = asyncio.gather(
            every(args.kill_every, t0, end, inj.kill),
            every(args.disconnect_every, t0, end, inj.disconnect),
            every(args.malformed_every, t0, end, inj.malformed),
            every(args.malformed_every * 3, t0, end, inj.raw),
            every(args.truncate_every, t0, end, inj.truncate),
            every(args.unwritable_every, t0, end,
                  lambda: inj.unwritable(args.unwritable_s)),
            every(1.0, t0, end, watch_dir),
            every(5.0, t0, end, lambda: inj.sample(pid)))
        client = LoadClient(url, time_limit_s=seconds, max_requests=args.max_requests,
                            request_timeout_s=120)
        try:
            outcome = await client.run(_workload(args, seconds, seed))
        finally:
            injectors.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await injectors
            await inj.close()
        watch.poll()
        out = {"results": outcome.results, "cut": outcome.cut,
               "retried": await metric_sum(url, "kvroute_retries_total"),
               "trips": await metric_sum(url, "kvroute_breaker_trips_total"),
               "rss_end": rss_kib(pid), "pids": _server_pids(log_dir)}
    return out


def _server_pids(log_dir: Path) -> set[int]:
    with contextlib.suppress(OSError, ValueError):
        return {int(b["pid"]) for b in serve_state(log_dir)["backends"] if b.get("pid")}
    return set()


async def disk_part(args: argparse.Namespace, work: Path, seconds: float,
                    faults: Faults) -> dict[str, Any]:
    cluster = Cluster(backends=2, slots=2, ctx_per_slot=8192, kv_disk=True)
    cfg = write_config(work / "soak.yaml", cluster, cluster.backends, "prefix")
    data = yaml.safe_load(cfg.read_text())
    data["kv_disk"].update(max_gib=args.disk_gib, save_after_idle_s=0.5)
    cfg.write_text(yaml.safe_dump(data, sort_keys=False))
    log_dir, slots = work / "logs" / "soak", Path(data["kv_disk"]["path"])
    watch = DirWatch(slots)
    first = await _half(args, cfg, log_dir, slots, seconds / 2, args.seed, faults, watch)
    log = cfg.with_suffix(".serve.log")
    log.rename(work / "soak.first.serve.log")
    # kvroute is down: its index becomes garbage; what it saved must survive that
    intact = {f.name for f in slots.glob("kvroute-*.bin")} - set(faults.truncated)
    (slots / "kvroute-index.json").write_bytes(GARBAGE)
    second = await _half(args, cfg, log_dir, slots, seconds / 2, args.seed + 1, faults,
                         watch)
    lines = removals(work / "soak.first.serve.log") + removals(log)
    kept = {f.name for f in slots.rglob("kvroute-*.bin")}
    removed = [d for d in lines if d.get("event") == "slot.file_removed"]
    named = {Path(str(d.get("file"))).name for d in removed}
    results = first["results"] + second["results"]
    return {
        "sent": len(results), "succeeded": sum(r.ok for r in results),
        "retried": int(first["retried"] + second["retried"]),
        "breaker_trips": int(first["trips"] + second["trips"]),
        "failed": _failed(results, faults.kills),
        "cut_by_time_limit": first["cut"] + second["cut"],
        "kills": len(faults.kills), "client_disconnects": faults.disconnects,
        "malformed": faults.malformed,
        "files": {
            "intact_at_restart": len(intact),
            # (kept across the restart: in the directory or its quarantine, or removed
            # later for a logged reason)
            "lost_at_restart": len(intact - kept - named),
            "truncated_by_soak": len(faults.truncated),
            "removed_by_reason": dict(Counter(str(d.get("reason")) for d in removed)),
            "gone_without_a_logged_reason": len(watch.gone() - named),
            "valid_removed": sum(Path(str(d.get("file"))).name not in faults.truncated
                                 and not _routine(str(d.get("reason"))) for d in removed),
            "save_failed_logged": sum(d.get("event") == "slot.save_failed" for d in lines),
            "unwritable_s": round(faults.unwritable_s, 1),
        },
        "rss_end_kib": second["rss_end"], "pids": first["pids"] | second["pids"],
    }


def _routine(reason: str) -> bool:
    """A removal the tier makes by design: a valid file replaced by a newer save of its
    conversation or over the budget, or what a save given up left."""
    return any(w in reason for w in ("replaced", "budget", "given up"))


async def replicas_part(args: argparse.Namespace, work: Path, seconds: float
                        ) -> dict[str, Any]:
    binary = shutil.which("nats-server")
    if binary is None:
        return {"skipped": "nats-server not found (fix: apt-get install nats-server)"}
    from backends.process import free_port

    out = work / "replicas"
    out.mkdir(parents=True, exist_ok=True)
    broker = Broker(binary, free_port(), free_port(), out / "nats-server.log")
    cluster = Cluster(backends=2, slots=2, cache_ram_mib=0)
    broker.start()
    reps: list[Replica] = []
    try:
        async with fresh_servers(cluster, out / "servers") as urls, \
                aiohttp.ClientSession() as http:
            base = external_config(out / "kvroute.yaml", cluster, urls, "prefix")
            reps = [await start_replica(base, f"r{i}", broker.url, out) for i in range(2)]
            for r in reps:
                await wait_ready(http, r, cluster.backends, True)
            await asyncio.sleep(2.0)  # (each hears the other's `alive`)
            client = Balancer([r.url for r in reps], time_limit_s=seconds,
                              max_requests=args.max_requests, request_timeout_s=120)
            outage = asyncio.create_task(_outage(broker, seconds / 3, args.outage_s))
            try:
                outcome = await client.run(_workload(args, seconds, args.seed + 2))
            finally:
                outage.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await outage
            if broker.proc is None or broker.proc.poll() is not None:
                broker.start()
            results = outcome.results
            return {"sent": len(results), "succeeded": sum(r.ok for r in results),
                    "failed": _failed(results, []), "outage_s": args.outage_s,
                    "replicas_alive": sum(r.proc.poll() is None for r in reps)}
    finally:
        for r in reps:
            if r.proc.poll() is None:
                r.proc.send_signal(signal.SIGTERM)
        for r in reps:
            await asyncio.to_thread(r.proc.wait, 30)
        broker.kill()


async def _outage(broker: Broker, at_s: float, for_s: float) -> None:
    await asyncio.sleep(at_s)
    broker.kill()
    await asyncio.sleep(for_s)
    await asyncio.to_thread(broker.start)


def orphans(pids: set[int], work: Path) -> list[int]:
    """Processes of the run still alive (zombies aside): those of ``pids``, and any
    whose command line names the run's directory (replicas, managed servers)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            argv = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(
                errors="replace")
            if state != "Z" and (int(entry.name) in pids or str(work) in argv):
                out.append(int(entry.name))
    return sorted(out)


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(args.out).parent / "soak-run"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    parts = set(args.parts.split(","))
    total = args.minutes * 60
    share = {"disk": 2 / 3, "replicas": 1 / 3} if parts == {"disk", "replicas"} else {
        p: 1.0 for p in parts}
    faults = Faults()
    out: dict[str, Any] = {"minutes": args.minutes, "unexpected_failures": 0}
    pids: set[int] = set()
    if "disk" in parts:
        disk = out["disk"] = await disk_part(args, work, total * share["disk"], faults)
        pids = disk.pop("pids")
        samples = faults.rss_kib or [disk["rss_end_kib"]]
        rss_end = disk.pop("rss_end_kib")
        out["unexpected_failures"] += sum(n for c, n in disk["failed"].items()
                                          if c != "killed_stream")
        out["rss_mib"] = {"start": round(samples[0] / 1024, 1),
                          "peak": round(max([*samples, rss_end]) / 1024, 1),
                          "end": round(rss_end / 1024, 1)}
    if "replicas" in parts:
        reps = out["replicas"] = await replicas_part(args, work,
                                                     total * share["replicas"])
        out["unexpected_failures"] += sum(reps.get("failed", {}).values())
    await asyncio.sleep(2.0)  # (servers stopped by their parent-death check)
    out["orphans"] = orphans(pids, work)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=10.0, help="run length (bounded)")
    p.add_argument("--parts", default="disk,replicas", help="disk, replicas or both")
    p.add_argument("--session-rate", type=float, default=0.15, help="new sessions per second")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--prefix-tokens", type=int, default=1500)
    p.add_argument("--kill-every", type=float, default=90.0, help="s between backend kills")
    p.add_argument("--disconnect-every", type=float, default=10.0)
    p.add_argument("--malformed-every", type=float, default=2.0)
    p.add_argument("--truncate-every", type=float, default=45.0,
                   help="s between slot files cut short")
    p.add_argument("--unwritable-every", type=float, default=100.0,
                   help="s between spells of an unwritable slot directory")
    p.add_argument("--unwritable-s", type=float, default=15.0)
    p.add_argument("--disk-gib", type=float, default=0.25, help="the disk tier's budget")
    p.add_argument("--outage-s", type=float, default=20.0, help="the broker's outage")
    p.add_argument("--max-requests", type=int, default=5000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="loadtest-results/soak.json", help="JSON result file")


def main_soak(args: argparse.Namespace) -> int:
    result = asyncio.run(soak(args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    ok = result["unexpected_failures"] == 0 and not result["orphans"]
    if "disk" in result:
        files = result["disk"]["files"]
        ok = ok and set(result["disk"]["malformed"]) <= {"4xx"} and not (
            files["lost_at_restart"] or files["valid_removed"]
            or files["gone_without_a_logged_reason"])
    return 0 if ok else 1



