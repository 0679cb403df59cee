"""Proxy overhead against a fake backend (a real aiohttp server on a real loopback port).

    python bench/bench_proxy.py [--quick] [--ram-mib N] [--replicas]

Three processes: the fake backend, one kvroute proxy (full pipeline: exact tokens with
the demo model's vocabulary, prefix routing, feedback, metrics, one JSON log line per
request to a file), and this client. Measured in one run:

- added median latency of a small chat request (proxied - direct, interleaved request by
  request, and in runs of requests to one target: see `added_latency`);
- added median latency of a 30k-token turn whose history was seen (both ways);
- added time to the first event of a streamed coding-agent turn (~24k tokens: tool
  schemas, tool calls and results; the last call and result new: bench/agent_turn.py);
- the proxy's CPU time per request of both kinds (the latencies move with whatever else
  the machine runs; CPU per request much less);
- requests/s through the proxy (64 concurrent clients), and requests per proxy CPU-second
  (what one core would carry: on this 2-core machine the client and the fake backend
  compete with the proxy for CPU).

--replicas measures instead what replicas sharing their view over NATS add: the same
small request and seen 30k-token turn through kvroute alone and through a replica with a
peer on a broker, interleaved in one run (bench/proxy_replicas.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# (bench/, beside this script)
from agent_turn import agent_bodies  # noqa: E402
from latency import (  # noqa: E402
    added_latency,
    cpu_seconds,
    free_port,
    long_history,
    serve_proxy,
    turns_after,
    wait_up,
)

CHAT_ANSWER = json.dumps({
    "choices": [{"finish_reason": "stop", "index": 0,
                 "message": {"role": "assistant", "content": "ok"}}],
    "created": 0, "model": "fake", "object": "chat.completion", "id": "x",
    "usage": {"completion_tokens": 1, "prompt_tokens": 10, "total_tokens": 11,
              "prompt_tokens_details": {"cached_tokens": 0}},
    "timings": {"cache_n": 0, "prompt_n": 10, "prompt_ms": 1.0, "predicted_n": 1,
                "predicted_ms": 1.0},
}).encode()
# A streamed answer: the first token, the last chunk (timings, as llama-server sends them),
# the usage chunk asked for with stream_options, [DONE].
STREAM_EVENTS = [b"data: " + json.dumps(e).encode() + b"\n\n" for e in (
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "ok"}}],
     "object": "chat.completion.chunk", "id": "x", "model": "fake", "created": 0},
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
     "object": "chat.completion.chunk", "id": "x", "model": "fake", "created": 0,
     "timings": {"cache_n": 0, "prompt_n": 10, "prompt_ms": 1.0, "predicted_n": 1,
                 "predicted_ms": 1.0}},
    {"choices": [], "object": "chat.completion.chunk", "id": "x", "model": "fake",
     "created": 0, "usage": {"completion_tokens": 1, "prompt_tokens": 10,
                             "total_tokens": 11}},
)] + [b"data: [DONE]\n\n"]
PROPS = {"total_slots": 4, "default_generation_settings": {"n_ctx": 65536},
         "model_alias": "fake", "model_path": "fake.gguf", "build_info": "fake",
         "chat_template": ""}


# ------------------------------------------------------------------------ fake backend
def run_fake(port: int) -> None:
    async def chat(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        if b'"stream":true' not in raw.replace(b" ", b""):
            return web.Response(body=CHAT_ANSWER, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for event in STREAM_EVENTS:
            await resp.write(event)
        return resp

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def props(_: web.Request) -> web.Response:
        return web.json_response(PROPS)

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    app.router.add_get("/props", props)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


# ---------------------------------------------------------------- bare aiohttp forwarder
def run_bare(port: int, backend_port: int) -> None:
    """The floor: aiohttp server + client forwarding the body and nothing else. What the
    proxy adds over this is kvroute's own pipeline; the floor itself moves with the
    machine's speed, which swings +-30% on this VM from one minute to the next."""
    async def session_ctx(app: web.Application) -> Any:
        app[SESSION] = aiohttp.ClientSession()
        yield
        await app[SESSION].close()

    async def chat(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        async with request.app[SESSION].post(
                f"http://127.0.0.1:{backend_port}/v1/chat/completions", data=raw,
                headers={"Content-Type": "application/json"}) as r:
            if r.content_type != "text/event-stream":
                return web.Response(body=await r.read(), content_type="application/json")
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            async for chunk in r.content.iter_any():  # relayed as it comes
                await resp.write(chunk)
            return resp

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application(client_max_size=64 << 20)
    app.cleanup_ctx.append(session_ctx)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


SESSION = web.AppKey("session", aiohttp.ClientSession)


# ------------------------------------------------------------------------------- proxy
def run_proxy(port: int, backend_port: int, model: Path, log_path: Path, ram_mib: int,
              nats: str | None = None, replica: str = "r0") -> None:
    """The proxy; with ``nats``, a replica named ``replica`` sharing its view there."""
    from backends.binary import cache_dir
    from backends.config import ExternalBackendConfig
    from proxy.config.load import Config, ProxyConfig, ReplicasConfig, RoutingConfig
    from proxy.observability.logging import configure_logging

    log_file = log_path.open("w")
    configure_logging("info", stream=log_file)
    cfg = Config(proxy=ProxyConfig(port=port), routing=RoutingConfig(),
                 # modelled as a managed demo backend is (by default a 1 GiB host-RAM
                 # prompt cache, 8 KiB of KV per token): the RAM tier fills as requests
                 # pass. --ram-mib 0: no RAM tier (as measured before 2026-11-23 12:00)
                 backends=(ExternalBackendConfig(
                     name="fake", url=f"http://127.0.0.1:{backend_port}",
                     kv_bytes_per_token=8192, cache_ram_mib=ram_mib),),
                 llama_server=None, cache_dir=cache_dir(), log_dir=log_path.parent,
                 replicas=ReplicasConfig(nats, replica) if nats else None)

    serve_proxy(cfg, model, port)


# ------------------------------------------------------------------------------ client
async def throughput(url: str, pid: int, seconds: float, concurrency: int) -> tuple[float,
                                                                                   float]:
    body = json.dumps({"messages": [{"role": "user", "content": "hello there"}],
                       "max_tokens": 1}).encode()
    hdr = {"Content-Type": "application/json"}
    done = 0
    stop = time.perf_counter() + seconds
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as session:
        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < stop:
                async with session.post(url + "/v1/chat/completions", data=body,
                                        headers=hdr) as r:
                    await r.read()
                done += 1

        cpu0, t0 = cpu_seconds(pid), time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed, cpu = time.perf_counter() - t0, cpu_seconds(pid) - cpu0
    return done / elapsed, done / cpu if cpu else float("nan")


async def client_main(fake: str, proxy: str, bare: str, proxy_pid: int, quick: bool
                      ) -> dict[str, Any]:
    rng = random.Random(0)
    async with aiohttp.ClientSession() as session:
        await wait_up(session, fake)
        await wait_up(session, proxy)
        await wait_up(session, bare)
        n_small = 200 if quick else 1000
        small = [json.dumps({"messages": [{"role": "user", "content": f"hi {i}"}],
                             "max_tokens": 1}).encode() for i in range(n_small)]
        sm = await added_latency(session, fake, proxy, small, 50, proxy_pid, bare)
        small_runs = [json.dumps({"messages": [{"role": "user", "content": f"ho {i}"}],
                                  "max_tokens": 1}).encode() for i in range(3 * n_small)]
        sm_steady = await added_latency(session, fake, proxy, small_runs, 150, proxy_pid,
                                        bare, block=50)

        streamed = [json.dumps({"messages": [{"role": "user", "content": f"hu {i}"}],
                                "max_tokens": 1, "stream": True}).encode()
                    for i in range(n_small)]
        st = await added_latency(session, fake, proxy, streamed, 50, proxy_pid, bare,
                                 first_event=True)

        history = long_history(rng)
        n_long = 30 if quick else 100
        long_bodies = turns_after(history, n_long + 1, rng)
        # the first one is the turn that makes the history "seen"
        lg = await added_latency(session, fake, proxy, long_bodies, 1, proxy_pid, bare)
        long_runs = turns_after(history, 3 * n_long, rng)
        lg_steady = await added_latency(session, fake, proxy, long_runs, 0, proxy_pid,
                                        bare, block=10)
        # A coding agent's turn (bench/agent_turn.py): tool schemas, tool calls and
        # results, streamed; the first body makes the history seen.
        agent = [json.dumps(b).encode() for b in agent_bodies(n_long + 1, seed=1)]
        ag = await added_latency(session, fake, proxy, agent, 1, proxy_pid, bare,
                                 first_event=True)
        async with session.get(proxy + "/kvroute/status") as r:
            status = await r.json()
        prompt_tokens = status["router"]["tree"]["resident_tokens"]
    rps, per_cpu = await throughput(proxy, proxy_pid, 3.0 if quick else 8.0, 64)
    return {"small_direct_ms": sm["direct"], "small_proxied_ms": sm["proxied"],
            "small_added_ms": sm["added"], "small_bare_added_ms": sm["bare_added"],
            "small_proxy_cpu_ms": sm["cpu"], "long_direct_ms": lg["direct"],
            "long_proxied_ms": lg["proxied"], "long_added_ms": lg["added"],
            "long_bare_added_ms": lg["bare_added"], "long_proxy_cpu_ms": lg["cpu"],
            "stream_first_event_direct_ms": st["direct"],
            "stream_first_event_added_ms": st["added"],
            "stream_first_event_bare_added_ms": st["bare_added"],
            "stream_proxy_cpu_ms": st["cpu"],
            "small_steady_added_ms": sm_steady["added"],
            "small_steady_bare_added_ms": sm_steady["bare_added"],
            "small_steady_proxy_cpu_ms": sm_steady["cpu"],
            "long_steady_added_ms": lg_steady["added"],
            "long_steady_bare_added_ms": lg_steady["bare_added"],
            "long_steady_proxy_cpu_ms": lg_steady["cpu"],
            "tree_tokens": prompt_tokens, "long_body_kib": len(long_bodies[0]) / 1024,
            "agent_first_event_direct_ms": ag["direct"],
            "agent_first_event_added_ms": ag["added"],
            "agent_first_event_bare_added_ms": ag["bare_added"], "agent_proxy_cpu_ms": ag["cpu"],
            "agent_body_kib": len(agent[0]) / 1024,
            "rps": rps, "rps_per_proxy_cpu_s": per_cpu}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=["client", "fake", "bare", "proxy"], default="client")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--backend-port", type=int, default=0)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--log", type=Path)
    ap.add_argument("--quick", action="store_true", help="fewer iterations (CI smoke)")
    ap.add_argument("--ram-mib", type=int, default=1024,
                    help="the fake backend's modelled host-RAM prompt cache (0: none)")
    ap.add_argument("--replicas", action="store_true",
                    help="only what replicas sharing their view over NATS add (off vs on)")
    ap.add_argument("--nats", help="(proxy role) a replica on this broker")
    ap.add_argument("--replica", default="r0", help="(proxy role) its name")
    args = ap.parse_args()
    if args.role == "fake":
        run_fake(args.port)
        return 0
    if args.role == "bare":
        run_bare(args.port, args.backend_port)
        return 0
    if args.role == "proxy":
        run_proxy(args.port, args.backend_port, args.model, args.log, args.ram_mib,
                  args.nats, args.replica)
        return 0

    from backends.demo_model import DemoModelParams, ensure_demo_model

    model = ensure_demo_model(DemoModelParams())
    me = [sys.executable, str(Path(__file__).resolve())]
    if args.replicas:
        import proxy_replicas  # (bench/, beside this script)

        proxy_replicas.report(proxy_replicas.run(me, model, args.quick, args.ram_mib))
        return 0
    fport, pport, bport = free_port(), free_port(), free_port()
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "proxy.log"
        fake = subprocess.Popen([*me, "--role", "fake", "--port", str(fport)])
        bare = subprocess.Popen([*me, "--role", "bare", "--port", str(bport),
                                 "--backend-port", str(fport)])
        prox = subprocess.Popen([*me, "--role", "proxy", "--port", str(pport),
                                 "--backend-port", str(fport), "--model", str(model),
                                 "--log", str(log), "--ram-mib", str(args.ram_mib)])
        try:
            res = asyncio.run(client_main(f"http://127.0.0.1:{fport}",
                                          f"http://127.0.0.1:{pport}",
                                          f"http://127.0.0.1:{bport}", prox.pid, args.quick))
            res["log_lines"] = sum(1 for _ in log.open())
            res["ram_mib"] = args.ram_mib
        finally:
            for p in (prox, bare, fake):
                p.terminate()
                p.wait(10)
    print(f"fake backend  : 4 slots, modelled host-RAM prompt cache {args.ram_mib} MiB")
    print(f"small request : direct {res['small_direct_ms']:.3f} ms, proxied "
          f"{res['small_proxied_ms']:.3f} ms, added {res['small_added_ms']:.3f} ms; proxy CPU "
          f"{res['small_proxy_cpu_ms']:.3f} ms/request; bare aiohttp forwarder adds "
          f"{res['small_bare_added_ms']:.3f} ms")
    print(f"30k-token turn: body {res['long_body_kib']:.0f} KiB, tree "
          f"{res['tree_tokens']} tokens; direct {res['long_direct_ms']:.3f} ms, proxied "
          f"{res['long_proxied_ms']:.3f} ms, added {res['long_added_ms']:.3f} ms "
          f"(target <= 3 ms: {res['long_added_ms'] / 3.0:.2f}x of budget); proxy CPU "
          f"{res['long_proxy_cpu_ms']:.3f} ms/request; bare aiohttp forwarder adds "
          f"{res['long_bare_added_ms']:.3f} ms")
    print(f"streamed small: first event direct {res['stream_first_event_direct_ms']:.3f} "
          f"ms, added {res['stream_first_event_added_ms']:.3f} ms (bare aiohttp forwarder "
          f"{res['stream_first_event_bare_added_ms']:.3f} ms); proxy CPU "
          f"{res['stream_proxy_cpu_ms']:.3f} ms/request (no target: what a Claude Code "
          "client sees)")
    print(f"agent turn    : body {res['agent_body_kib']:.0f} KiB (tools, tool calls and "
          f"results, streamed), first event direct {res['agent_first_event_direct_ms']:.3f} "
          f"ms, added {res['agent_first_event_added_ms']:.3f} ms (bare aiohttp forwarder "
          f"{res['agent_first_event_bare_added_ms']:.3f} ms); proxy CPU "
          f"{res['agent_proxy_cpu_ms']:.3f} ms/request")
    print(f"in steady use (runs of requests to one target): small added "
          f"{res['small_steady_added_ms']:.3f} ms (bare "
          f"{res['small_steady_bare_added_ms']:.3f} ms; proxy CPU "
          f"{res['small_steady_proxy_cpu_ms']:.3f} ms/request), 30k turn added "
          f"{res['long_steady_added_ms']:.3f} ms ({res['long_steady_added_ms'] / 3:.2f}x; "
          f"bare {res['long_steady_bare_added_ms']:.3f} ms; proxy CPU "
          f"{res['long_steady_proxy_cpu_ms']:.3f} ms/request)")
    # The floor moves ~2x with the VM's speed from one minute to the next: the multiple
    # of it is what compares across runs (see BENCHMARKS.md, bench/bench_wakeup.py).
    small_x = res["small_added_ms"] / res["small_bare_added_ms"]
    print(f"vs the floor  : the bare aiohttp forwarder of this run adds "
          f"{res['small_bare_added_ms']:.3f} / {res['long_bare_added_ms']:.3f} ms "
          f"(small / 30k turn); kvroute adds {small_x:.2f}x / "
          f"{res['long_added_ms'] / res['long_bare_added_ms']:.2f}x that (target for the "
          f"small request <= 1.5x: {'met' if small_x <= 1.5 else 'MISSED'})")
    print(f"throughput    : {res['rps']:.0f} req/s through one proxy process "
          f"({res['rps'] / 1500:.2f}x of 1,500), {res['rps_per_proxy_cpu_s']:.0f} req per "
          f"proxy CPU-second; {res['log_lines']} log lines written")
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                      for k, v in res.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
