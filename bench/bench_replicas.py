"""Two kvroute replicas behind a round-robin balancer, sharing their view over NATS,
against one replica alone and against two that share nothing.

    python bench/bench_replicas.py [--conversations 4] [--turns 5]

Fresh llama-servers (demo model, 2 x 2 slots, no RAM tier) for each of three runs; the
replicas see them as `url:` backends. Conversations (a system prompt of their own, then
short turns) go out one request at a time, every other request to the other replica.
Printed per run: reused / prompt tokens, and the share of requests predicted within
max(16, 2%) of the reported reuse. Targets: shared reuse within 3 points of one replica's,
prediction >= 97%.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backends.process import free_port  # noqa: E402
from backends.supervisor import Supervisor  # noqa: E402
from loadtest.fleet import Cluster, external_config, fresh_servers  # noqa: E402
from loadtest.workloads import words  # noqa: E402
from proxy.app import create_app  # noqa: E402
from proxy.config.load import ReplicasConfig, load_config  # noqa: E402


async def start_replica(cfg_path: Path, nats: str | None, name: str
                        ) -> tuple[web.AppRunner, Supervisor, str]:
    cfg = load_config(cfg_path, check_port=False)
    if nats is not None:
        cfg = dataclasses.replace(cfg, replicas=ReplicasConfig(nats, name))
    sup = Supervisor(cfg)
    await sup.start()
    runner = web.AppRunner(create_app(cfg, sup), handler_cancellation=True, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, sup, f"http://127.0.0.1:{port}"


async def run(mode: str, args: argparse.Namespace, tmp: Path, nats: str | None
              ) -> tuple[float, float]:
    cluster = Cluster(backends=2, slots=2, cache_ram_mib=0)
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


async def conversations(targets: list[str], args: argparse.Namespace) -> tuple[float, float]:
    convs: list[list[dict[str, str]]] = [
        [{"role": "system", "content": words(random.Random(10 + i), 400)}]
        for i in range(args.conversations)]
    reused = total = exact = sent = 0
    async with aiohttp.ClientSession() as http:
        for t in range(args.turns):
            for i, conv in enumerate(convs):
                conv.append({"role": "user",
                             "content": words(random.Random(1000 * i + t), 25)})
                target = targets[sent % len(targets)]
                sent += 1
                async with http.post(f"{target}/v1/chat/completions", json={
                        "model": "kvroute-demo", "max_tokens": 4, "messages": conv}) as r:
                    body: Any = await r.json()
                    assert r.status == 200, body
                    predicted = int(r.headers["X-Kvroute-Predicted-Cached"])
                conv.append({"role": "assistant", "content": "Noted."})
                got, n = body["timings"]["cache_n"], body["usage"]["prompt_tokens"]
                reused += got
                total += n
                exact += abs(predicted - got) <= max(16, 0.02 * got)
    return reused / total, exact / sent


async def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=5)
    args = p.parse_args()
    binary = shutil.which("nats-server")
    if binary is None:
        print("nats-server not found (apt-get install nats-server)", file=sys.stderr)
        return 2
    port = free_port()
    broker = subprocess.Popen([binary, "-a", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with tempfile.TemporaryDirectory() as d:
            results = {}
            for mode, nats in (("one replica", None),
                               ("two replicas, shared", f"nats://127.0.0.1:{port}"),
                               ("two replicas, alone", None)):
                results[mode] = await run(mode, args, Path(d), nats)
                print(f"{mode:24s} reused {results[mode][0]:.3f}  "
                      f"predicted exactly {results[mode][1]:.1%}", flush=True)
    finally:
        broker.terminate()
        broker.wait(10)
    one, shared = results["one replica"][0], results["two replicas, shared"][0]
    print(f"shared - one replica: {100 * (shared - one):+.1f} points of reuse")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
