"""Two kvroute replicas behind a round-robin balancer, sharing their view over NATS,
against one replica alone and against two that share nothing.

    python bench/bench_replicas.py [--sessions 12] [--turns 5] [--backends 4] [--slots 2]
        [--hosts] [--only MODE] [--dump FILE] [--log FILE]

Fresh llama-servers (demo model, 4 x 2 slots, no RAM tier unless --cache-ram-mib) for
each of three runs; the replicas see them as `url:` backends. The agentic workload
(coding-agent sessions over one shared prefix, title and summary side calls, sessions
arriving and turns following each other as loadtest plays them, streamed), each request
to the next replica in turn, as a round-robin balancer in front sends them.
Printed per run: reused / prompt tokens, and the share of requests predicted within
max(16, 2%) of the reported reuse. Targets: shared reuse within 3 points of one replica's,
prediction >= 97%.

By default everything runs in this process's event loop on 127.0.0.1. With --hosts, each
run gets hosts of its own (network namespaces on a bridge, loadtest/netns.py; root): the
backends' llama-servers spread over two backend hosts, nats-server on a broker host, each
replica a `kvroute serve` on a host of its own, the load client in a thread inside a
client host; every packet stays inside those namespaces, and they go (processes and all)
when the run ends or fails. --log is then a directory for every process's log.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backends.binary import ensure_llama_server  # noqa: E402
from backends.demo_model import ensure_demo_model  # noqa: E402
from backends.process import ServerSpec, free_port  # noqa: E402
from backends.supervisor import Supervisor  # noqa: E402
from loadtest import hosts, netns  # noqa: E402
from loadtest.client import LoadClient  # noqa: E402
from loadtest.fleet import Cluster, external_config, fresh_servers  # noqa: E402
from loadtest.workloads import agentic  # noqa: E402
from proxy.app import create_app  # noqa: E402
from proxy.config.load import ReplicasConfig, load_config  # noqa: E402
from proxy.observability.logging import configure_logging  # noqa: E402
from proxy.server.runner import make_runner  # noqa: E402

BACKEND_HOSTS = ("h1", "h2")
REPLICA_HOSTS = ("r1", "r2")
MODES = ("one replica", "two replicas, shared", "two replicas, alone")
Figures = tuple[float, float, float, float]


async def start_replica(cfg_path: Path, nats: str | None, name: str
                        ) -> tuple[web.AppRunner, Supervisor, str]:
    cfg = load_config(cfg_path, check_port=False)
    if nats is not None:
        cfg = dataclasses.replace(cfg, replicas=ReplicasConfig(nats, name))
    sup = Supervisor(cfg)
    await sup.start()
    runner = make_runner(create_app(cfg, sup))
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, sup, f"http://127.0.0.1:{port}"


async def run(mode: str, args: argparse.Namespace, tmp: Path, nats: str | None
              ) -> Figures:
    cluster = Cluster(backends=args.backends, slots=args.slots,
                      cache_ram_mib=args.cache_ram_mib)
    async with fresh_servers(cluster, tmp / mode / "servers") as urls:
        cfg = external_config(tmp / mode / "kvroute.yaml", cluster, urls, "prefix")
        n_replicas = 1 if mode == "one replica" else 2
        replicas = [await start_replica(cfg, nats, f"r{i}") for i in range(n_replicas)]
        try:
            await asyncio.sleep(1.0)  # (health probes, the broker's connections)
            return await conversations([u for _, _, u in replicas], args)
        finally:
            for runner, sup, _ in replicas:
                await runner.cleanup()
                await sup.stop()


def run_on_hosts(mode: str, args: argparse.Namespace, logs: Path) -> Figures:
    """``mode`` on hosts of its own: the backends round-robin over the backend hosts
    (ports 8080, 8081, ... on each), the replicas on theirs, the client inside its own."""
    shared = mode == "two replicas, shared"
    replicas = REPLICA_HOSTS[:1 if mode == "one replica" else 2]
    logs.mkdir(parents=True, exist_ok=True)
    model = ensure_demo_model()
    spec = ServerSpec(ensure_llama_server(None).path, model, hosts.PROXY_PORT, args.slots,
                      Cluster().ctx_per_slot, cache_ram_mib=args.cache_ram_mib,
                      alias="kvroute-demo")
    with netns.hosts(*BACKEND_HOSTS, "broker", *REPLICA_HOSTS, "client") as net:
        backends = []
        for i in range(args.backends):
            name = chr(ord("a") + i)
            url = hosts.spawn_backend(
                net, BACKEND_HOSTS[i % 2],
                dataclasses.replace(spec, port=spec.port + i // 2), logs, name)
            backends.append({"name": name, "url": url, "cache_ram_mib": args.cache_ram_mib})
        nats = None
        if shared:
            hosts.spawn_broker(net, "broker", logs)
            nats = hosts.broker_url(net, "broker")
        targets = [hosts.spawn_replica(net, r, backends, model, logs, nats,
                                       {"policy": "prefix"}) for r in replicas]
        return net.run_in("client", lambda: _when_ready(targets, shared, args, logs))


async def _when_ready(targets: list[str], shared: bool, args: argparse.Namespace,
                      logs: Path) -> Figures:
    deadline = time.monotonic() + 180
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        for t in targets:
            while not hosts.ready(await _status(http, t), shared):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{t} not routing to every backend within 180 s\n"
                                       f"{hosts.tails(logs)}")
                await asyncio.sleep(0.5)
    await asyncio.sleep(1.0)  # (as on 127.0.0.1: the peers' first alive)
    return await conversations(targets, args)


async def _status(http: aiohttp.ClientSession, base: str) -> dict[str, object]:
    try:
        async with http.get(base + "/kvroute/status") as r:
            return await r.json() if r.status == 200 else {}
    except (aiohttp.ClientError, TimeoutError):
        return {}


async def conversations(targets: list[str], args: argparse.Namespace
                        ) -> tuple[float, float, float, float]:
    """The agentic workload (loadtest/workloads.py) sent round-robin over ``targets``:
    reused / prompt tokens, the share of requests predicted within max(16, 2%), and
    the mean and median TTFT (s)."""
    workload = agentic(sessions=args.sessions, turns=args.turns, prefix_tokens=2000,
                       context_tokens=800, tool_tokens=200, reply_tokens=30, max_tokens=8,
                       think_s=0.5, session_rate=2.0, seed=args.seed)
    outcome = await LoadClient(targets, time_limit_s=600,
                               max_requests=len(workload.requests())).run(workload)
    done = [r for r in outcome.results if r.ok and r.prompt_tokens and
            r.cached_tokens is not None and r.predicted_cached is not None]
    if len(done) < len(workload.requests()):
        failed = [r for r in outcome.results if r not in done]
        print(f"  {len(workload.requests()) - len(done)} requests not counted (failed, or "
              f"no usage / prediction), e.g. {[(r.kind, r.status, r.error) for r in failed][:3]}")
    if args.dump:
        with open(args.dump, "a") as f:
            for r in outcome.results:
                f.write(json.dumps({**r.to_dict(), "targets": len(targets)}) + "\n")
    reused = sum(r.cached_tokens or 0 for r in done)
    exact = sum(abs((r.predicted_cached or 0) - (r.cached_tokens or 0))
                <= max(16, 0.02 * (r.cached_tokens or 0)) for r in done)
    ttft = sorted(r.ttft_s or 0.0 for r in done)
    return (reused / sum(r.prompt_tokens or 0 for r in done), exact / len(done),
            sum(ttft) / len(ttft), ttft[len(ttft) // 2])


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--sessions", type=int, default=12)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--backends", type=int, default=4)
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--cache-ram-mib", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hosts", action="store_true",
                   help="backends, broker, replicas and client on hosts of their own "
                        "(network namespaces; root)")
    p.add_argument("--only", choices=MODES, help="run only this mode")
    p.add_argument("--dump", help="append every request's result here (JSON lines)")
    p.add_argument("--log", help="the replicas' log lines go to this file (--hosts: every "
                                 "process's log in this directory)")
    p.add_argument("--log-level", default="warning")
    return p.parse_args()


def report(mode: str, figures: Figures) -> None:
    reuse, exact, mean, median = figures
    print(f"{mode:24s} reused {reuse:.3f}  predicted exactly {exact:.1%}  "
          f"TTFT mean {mean:.2f} s, median {median:.2f} s", flush=True)


async def on_loopback(args: argparse.Namespace, modes: list[str]) -> dict[str, Figures]:
    log = open(args.log, "a") if args.log else None  # noqa: SIM115 (open while it runs)
    configure_logging(args.log_level, stream=log)
    port = free_port()
    broker = subprocess.Popen([hosts.nats_binary() or "nats-server", "-a", "127.0.0.1",
                               "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    results = {}
    try:
        with tempfile.TemporaryDirectory() as d:
            for mode in modes:
                nats = f"nats://127.0.0.1:{port}" if "shared" in mode else None
                results[mode] = await run(mode, args, Path(d), nats)
                report(mode, results[mode])
    finally:
        broker.terminate()
        broker.wait(10)
    return results


def on_hosts(args: argparse.Namespace, modes: list[str]) -> dict[str, Figures]:
    # SIGTERM unwinds like Ctrl-C: the hosts go, their processes with them
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results = {}
    with tempfile.TemporaryDirectory() as d:
        logs = Path(args.log or d)
        for mode in modes:
            results[mode] = run_on_hosts(mode, args, logs / mode.replace(", ", "-")
                                         .replace(" ", "-"))
            report(mode, results[mode])
    return results


async def main() -> int:
    args = parse_args()
    if hosts.nats_binary() is None:
        print("nats-server not found (apt-get install nats-server)", file=sys.stderr)
        return 2
    why = netns.unavailable() if args.hosts else None
    if why:
        print(f"--hosts: {why}", file=sys.stderr)
        return 2
    modes = [m for m in MODES if args.only in (None, m)]
    results = on_hosts(args, modes) if args.hosts else await on_loopback(args, modes)
    if args.only is None:
        one, shared = results["one replica"][0], results["two replicas, shared"][0]
        print(f"shared - one replica: {100 * (shared - one):+.1f} points of reuse")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
