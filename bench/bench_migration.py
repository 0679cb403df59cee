"""A conversation moved to another backend by a restore from disk, against a cold prefill.

    python bench/bench_migration.py [--tokens 10000] [--external]

`kvroute serve` with two managed demo backends (1 slot each, no RAM tier) and the disk
tier on; with `--external`, two llama-servers the bench starts itself, reached by URL,
sharing one --slot-save-path that their entries declare (`slot_save_path`). A ~10k-token
conversation runs on one backend and is saved when its slot goes idle; that backend is
then stopped (SIGSTOP: the proxy's breaker takes it out), so the next turn goes to the
other one, whose slot is first given the conversation from disk.
Printed: that turn's time to first token against a cold prefill of a prompt of the same
size on the same backend, measured in the same run. Target: <= 0.2x.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backends.binary import find_llama_server  # noqa: E402
from backends.demo_model import DemoModelParams, demo_model_path  # noqa: E402
from backends.process import LlamaServerProcess, ServerSpec, free_port  # noqa: E402
from loadtest.workloads import words  # noqa: E402


def config(tmp: Path, port: int, ctx: int, external: dict[str, str]) -> Path:
    """kvroute's config: managed backends a and b, else the ``external`` {name: url}."""
    cfg: dict[str, Any] = {
        "proxy": {"host": "127.0.0.1", "port": port, "policy": "prefix",
                  "health": {"probe_interval_s": 0.3, "probe_timeout_s": 0.5,
                             "breaker_failures": 2}},
        "log_dir": str(tmp / "logs"),
        "kv_disk": {"path": str(tmp / "slots"), "save_after_idle_s": 0.3, "min_tokens": 64},
        "backends": [{"name": n, "model": "demo", "slots": 1, "ctx_per_slot": ctx,
                      "threads": 2, "cache_ram_mib": 0} for n in ("a", "b")],
    }
    if external:
        cfg["proxy"]["tokenizer"] = str(demo_model_path(DemoModelParams()))
        cfg["backends"] = [{"name": n, "url": u, "slot_save_path": str(tmp / "shared")}
                           for n, u in external.items()]
    path = tmp / "kvroute.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


async def ask(http: aiohttp.ClientSession, url: str, messages: list[dict[str, str]]
              ) -> tuple[float, dict[str, str], tuple[int, int]]:
    """(client-measured TTFT, kvroute's headers, (tokens reused, prompt tokens))."""
    t0 = time.perf_counter()
    ttft = None
    reused = (-1, -1)
    async with http.post(f"{url}/v1/chat/completions", json={
            "model": "demo", "max_tokens": 4, "stream": True, "timings_per_token": True,
            "messages": messages}) as r:
        assert r.status == 200, await r.text()
        headers = dict(r.headers)
        async for line in r.content:
            if ttft is None and line.startswith(b"data: {"):
                ttft = time.perf_counter() - t0
            if line.startswith(b"data: {") and b'"timings"' in line:
                t = json.loads(line[6:])["timings"]
                reused = (t["cache_n"], t["cache_n"] + t["prompt_n"])
    assert ttft is not None
    return ttft, headers, reused


async def until(check: Any, timeout: float) -> None:
    end = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > end:
            raise TimeoutError("gave up waiting")
        await asyncio.sleep(0.2)


def servers(tmp: Path, ctx: int) -> dict[str, LlamaServerProcess]:
    """Two llama-servers on the demo model, saving slots in ``tmp``/shared, as an
    operator starts them."""
    found = find_llama_server()
    assert found is not None, "run `python -m backends prepare` first"
    (tmp / "shared").mkdir()
    out = {}
    for name in ("x", "y"):
        out[name] = LlamaServerProcess(ServerSpec(
            binary=found.path, model=demo_model_path(DemoModelParams()), port=free_port(),
            slots=1, ctx_per_slot=ctx, threads=2, cache_ram_mib=0,
            slot_save_path=tmp / "shared"), tmp / f"{name}.log")
        out[name].spawn()
    return out


async def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=10_000, help="the conversation's size")
    ap.add_argument("--external", action="store_true",
                    help="external servers sharing a declared --slot-save-path")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        ctx = 1 << (args.tokens + 2048).bit_length()
        outside = servers(tmp, ctx) if args.external else {}
        proc = subprocess.Popen([sys.executable, "-m", "proxy.cli", "serve", "--config",
                                 str(config(tmp, port, ctx, {n: p.spec.url for n, p in
                                                             outside.items()}))],
                                cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        stopped = None
        try:
            async with aiohttp.ClientSession(
                    timeout=aiohttp.ClientTimeout(total=900)) as http:
                async def ready() -> bool:
                    try:
                        async with http.get(f"{url}/health") as r:
                            return r.status == 200 and (await r.json())["backends_ready"] == 2
                    except aiohttp.ClientError:
                        return False
                await until(ready, 300)

                async def status() -> dict[str, Any]:
                    async with http.get(f"{url}/kvroute/status") as r:
                        return dict(await r.json())

                rng = random.Random(1)
                convo = [{"role": "system", "content": words(rng, args.tokens - 200)},
                         {"role": "user", "content": words(rng, 150)}]
                _, h, _ = await ask(http, url, convo)
                first = h["X-Kvroute-Backend"]
                convo.append({"role": "assistant", "content": "Noted."})

                async def saved() -> bool:
                    async with http.get(f"{url}/metrics") as r:
                        text = await r.text()
                    return 'kvroute_slot_files_total{event="saved"} 1.0' in text
                await until(saved, 120)
                pid = outside[first].pid if outside else next(
                    b["pid"] for b in (await status())["backends"] if b["name"] == first)
                assert pid is not None
                os.kill(pid, signal.SIGSTOP)
                stopped = pid

                async def out() -> bool:
                    return not any(b["name"] == first and b["routed"]
                                   for b in (await status())["backends"])
                await until(out, 60)

                convo.append({"role": "user", "content": words(rng, 30)})
                moved, h, reused = await ask(http, url, convo)
                assert h["X-Kvroute-Backend"] != first, h
                tier = h.get("X-Kvroute-Tier")
                cold_convo = [{"role": "system", "content": words(random.Random(2),
                                                                  args.tokens - 200)},
                              {"role": "user", "content": words(rng, 180)}]
                cold, h2, cold_reused = await ask(http, url, cold_convo)
        finally:
            if stopped is not None:
                os.kill(stopped, signal.SIGCONT)
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
            for server in outside.values():
                await server.stop()
    print(f"conversation of ~{args.tokens} tokens moved from {first} to "
          f"{h['X-Kvroute-Backend']} (tier {tier}, reused {reused[0]} of {reused[1]}, "
          f"predicted {h.get('X-Kvroute-Predicted-Cached')})")
    print(f"TTFT migrated {moved:.3f} s, cold prefill of the same size {cold:.3f} s "
          f"(reused {cold_reused[0]} of {cold_reused[1]}) on {h2['X-Kvroute-Backend']}")
    ratio = moved / cold
    print(f"ratio {ratio:.3f}  (target <= 0.2: {'met' if ratio <= 0.2 else 'missed'})")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
