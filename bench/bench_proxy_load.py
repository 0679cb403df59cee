"""The proxy under load: 16, 64 and 256 concurrent clients, 8 fake backends x 4 slots.

    python bench/bench_proxy_load.py [--clients 16,64,256] [--seconds 20] [--warmup 5]
                                     [--base-ms 60] [--per-1k-ms 4] [--agent-share 0.5]

Three processes on loopback: the fake backends (one process, 8 aiohttp servers), one
kvroute proxy (as bench_proxy.py's: exact tokens with the demo model's vocabulary, prefix
routing, feedback, Prometheus, one JSON log line per request to a file; each backend
modelled with a 1 GiB host-RAM prompt cache), and this client.

The fake backend is a llama-server in what the proxy sees of it: /health, /props (4
slots, n_ctx 65536 each), /slots, and completions pinned by `id_slot` (a slot busy on
arrival makes the request wait there, as llama-server's own queue does). It keeps, per
slot, the prompt the slot holds and, per server, an LRU of prompts displaced from slots
(its RAM cache, as many tokens as the proxy models); a request reuses its longest common
prefix with either, holds its slot for ``base-ms + per-1k-ms x new tokens / 1000``,
streams "ok" and a last chunk with `timings` (cache_n, prompt_n, prompt_ms): the proxy's
feedback path runs on every answer. Tokens are estimated from bytes (BYTES_PER_TOKEN of
the body's prompt part), so its cache_n is near the proxy's prediction, not equal to it.

The client mixes small chat requests (unrelated, 10-150 words, not streamed) and coding
agents' turns (streamed, bench/agent_turn.py's shapes): 64 agent sessions share one
system prompt and 18 tool schemas (~15k tokens); each starts with a history of its own
(40 tool calls and results, ~30k tokens in all), and each turn adds one call and its
result; after 12 turns the session starts a new history. Two turns of one session in
flight at once are siblings (one history, each its own last call). Each client sends
its next request as soon as its last one is answered.

Per level, after a warm-up, for a bounded time: requests/s, the proxy's CPU per request
(from /proc of its pid; the mix: small and agent turns are not told apart in one run),
and the time a request spent in kvroute beyond what the order of its slot required. No
header or metric of the proxy says that (kvroute_slot_wait_seconds is the whole hold,
most of it the slot's service), so the fake backend records, per request (an id in the
body), when it arrived and when the slot it was sent to was last freed; the client, when
it sent it. Beyond-order time = arrival - max(sent, slot freed): for a request held for
its slot, the hand-off (the slot freed -> kvroute sent the next one); for one that found
its slot idle, the proxy's own forwarding time. Printed: p50/p99 over all requests and
over the held ones only. Also the share of requests the proxy held for a slot and their
mean hold (from /metrics), and the client's latency p50/p99 (in the JSON line also per
kind). The ratio CPU per request at the most clients / at the fewest is the figure the
target wants within 1.3x.

Bounded: each level stops sending at its end (in-flight requests finish, each within a
60 s timeout); every child process is stopped on exit, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# (bench/, beside this script)
from agent_turn import _call, _words, tools  # noqa: E402
from latency import cpu_seconds, free_port, serve_proxy, wait_up  # noqa: E402

BACKENDS, SLOTS, N_CTX = 8, 4, 65536
RAM_MIB, KV_BYTES = 1024, 8192  # the proxy's model of each backend's host-RAM cache
RAM_TOKENS = (RAM_MIB << 20) // KV_BYTES  # ... and the fake's, in its estimated tokens
BYTES_PER_TOKEN = 5.0  # the demo vocabulary on these bodies' JSON (near enough)
SESSIONS, HISTORY_CALLS, TURNS_PER_HISTORY = 64, 40, 12
MAX_REQUESTS = 200_000  # per level, whatever its length


# ------------------------------------------------------------------------ fake backend
def _lcp(a: bytes, b: bytes) -> int:
    """Longest common prefix of two byte strings, compared 4 KiB at a time."""
    n, i, step = min(len(a), len(b)), 0, 4096
    while i < n and a[i:i + step] == b[i:i + step]:
        i += step
    if i >= n:
        return n
    lo, hi = i, min(i + step, n)  # the first difference is in [lo, hi)
    while lo < hi:
        mid = (lo + hi) // 2
        if a[i:mid + 1] == b[i:mid + 1]:
            lo = mid + 1
        else:
            hi = mid
    return lo


_SLOT_RE = re.compile(rb'"id_slot"\s*:\s*(-?\d+)')
_RID_RE = re.compile(rb'"kvbench_rid"\s*:\s*(\d+)')
_USAGE_RE = re.compile(rb'"include_usage"\s*:\s*true')


@dataclass
class _Slot:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    prompt: bytes = b""
    freed_at: float = 0.0


class FakeServer:
    """One fake llama-server: SLOTS slots, their prompts, an LRU of displaced prompts."""

    def __init__(self, index: int, records: dict[int, tuple[Any, ...]], base_s: float,
                 per_token_s: float) -> None:
        self.index, self.records = index, records
        self.base_s, self.per_token_s = base_s, per_token_s
        self.slots = [_Slot() for _ in range(SLOTS)]
        self.ram: list[bytes] = []  # oldest first
        self.ram_tokens = 0

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_get("/health", self.health)
        app.router.add_get("/props", self.props)
        app.router.add_get("/slots", self.slots_page)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/bench/records", self.take_records)
        return app

    async def health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def props(self, _: web.Request) -> web.Response:
        return web.json_response({
            "total_slots": SLOTS, "default_generation_settings": {"n_ctx": N_CTX},
            "model_alias": "fake", "model_path": "fake.gguf", "build_info": "fake",
            "chat_template": ""})

    async def slots_page(self, _: web.Request) -> web.Response:
        return web.json_response([
            {"id": i, "n_ctx": N_CTX, "is_processing": s.lock.locked(),
             "n_prompt_tokens": int(len(s.prompt) / BYTES_PER_TOKEN)}
            for i, s in enumerate(self.slots)])

    async def take_records(self, _: web.Request) -> web.Response:
        out = {str(k): v for k, v in self.records.items()}
        self.records.clear()
        return web.Response(body=orjson.dumps(out), content_type="application/json")

    def _reuse(self, slot: _Slot, prompt: bytes) -> int:
        """Bytes of ``prompt`` the slot reuses (its own prompt or a RAM entry, as
        llama-server's prompt cache loads the better one); the slot's old prompt goes to
        RAM when the new one does not extend it."""
        own = _lcp(slot.prompt, prompt)
        best, best_i = own, -1
        for i, p in enumerate(self.ram):
            n = _lcp(p, prompt)
            if n > best:
                best, best_i = n, i
        if best_i >= 0:  # loaded from RAM: the entry is used again (LRU)
            self.ram.append(self.ram.pop(best_i))
        if own < len(slot.prompt) and len(slot.prompt) > 4096:
            self.ram.append(slot.prompt)
            self.ram_tokens += len(slot.prompt) / BYTES_PER_TOKEN
            while self.ram_tokens > RAM_TOKENS and self.ram:
                self.ram_tokens -= len(self.ram.pop(0)) / BYTES_PER_TOKEN
        return best

    async def chat(self, request: web.Request) -> web.StreamResponse:
        arrived = time.monotonic()
        raw = await request.read()
        m = _SLOT_RE.search(raw, 0, 200)
        want = int(m.group(1)) if m else -1
        m = _RID_RE.search(raw, max(0, len(raw) - 200))
        rid = int(m.group(1)) if m else -1
        # the prompt: from the first of tools/messages to the end of messages (the
        # client puts the rest after them)
        starts = [i for i in (raw.find(b'"tools"'), raw.find(b'"messages"')) if i >= 0]
        end = raw.rfind(b'"max_tokens"')
        prompt = raw[min(starts, default=0):end if end > 0 else len(raw)]
        if 0 <= want < SLOTS:
            slot_id = want
        else:  # no pin: an idle slot, the one holding most of the prompt; else slot 0
            idle = [i for i, s in enumerate(self.slots) if not s.lock.locked()]
            slot_id = max(idle, key=lambda i: _lcp(self.slots[i].prompt, prompt),
                          default=0)
        slot = self.slots[slot_id]
        async with slot.lock:
            started = time.monotonic()
            prev_freed = slot.freed_at
            reused = self._reuse(slot, prompt)
            slot.prompt = prompt
            cache_n = int(reused / BYTES_PER_TOKEN)
            n_prompt = max(1, int(len(prompt) / BYTES_PER_TOKEN))
            new = max(1, n_prompt - cache_n)
            prompt_s = self.per_token_s * new
            await asyncio.sleep(self.base_s + prompt_s)
            timings = {"cache_n": cache_n, "prompt_n": new, "prompt_ms": prompt_s * 1000,
                       "predicted_n": 1, "predicted_ms": self.base_s * 1000}
            usage = {"completion_tokens": 1, "prompt_tokens": n_prompt,
                     "total_tokens": n_prompt + 1,
                     "prompt_tokens_details": {"cached_tokens": cache_n}}
            if b'"stream":true' not in raw[:300].replace(b" ", b""):
                resp: web.StreamResponse = web.Response(body=orjson.dumps({
                    "choices": [{"finish_reason": "stop", "index": 0,
                                 "message": {"role": "assistant", "content": "ok"}}],
                    "created": 0, "model": "fake", "object": "chat.completion",
                    "id": "x", "usage": usage, "timings": timings}),
                    content_type="application/json")
            else:
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                head = {"object": "chat.completion.chunk", "id": "x", "model": "fake",
                        "created": 0}
                events = [
                    {**head, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                "content": "ok"}}]},
                    {**head, "choices": [{"index": 0, "delta": {},
                                          "finish_reason": "stop"}], "timings": timings}]
                if _USAGE_RE.search(raw, 0, 300):
                    events.append({**head, "choices": [], "usage": usage})
                await resp.write(b"".join(b"data: " + orjson.dumps(e) + b"\n\n"
                                          for e in events) + b"data: [DONE]\n\n")
            slot.freed_at = freed = time.monotonic()
        self.records[rid] = (arrived, started, prev_freed, freed, self.index, slot_id,
                             cache_n, new)
        return resp


def run_fakes(ports: list[int], base_ms: float, per_1k_ms: float) -> None:
    records: dict[int, tuple[Any, ...]] = {}

    async def main() -> None:
        runners = []
        for i, port in enumerate(ports):
            fake = FakeServer(i, records, base_ms / 1000, per_1k_ms / 1e6)
            runner = web.AppRunner(fake.app(), access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            runners.append(runner)
        await asyncio.Event().wait()

    asyncio.run(main())


# ------------------------------------------------------------------------------- proxy
def run_proxy(port: int, backend_ports: list[int], model: Path, log_path: Path) -> None:
    from backends.binary import cache_dir
    from backends.config import ExternalBackendConfig
    from proxy.config.load import Config, ProxyConfig, RoutingConfig
    from proxy.observability.logging import configure_logging

    configure_logging("info", stream=log_path.open("w"))
    cfg = Config(proxy=ProxyConfig(port=port), routing=RoutingConfig(),
                 backends=tuple(ExternalBackendConfig(
                     name=f"fake{i}", url=f"http://127.0.0.1:{p}",
                     kv_bytes_per_token=KV_BYTES, cache_ram_mib=RAM_MIB)
                     for i, p in enumerate(backend_ports)),
                 llama_server=None, cache_dir=cache_dir(), log_dir=log_path.parent)

    serve_proxy(cfg, model, port)


# ------------------------------------------------------------------------------ client
class Workload:
    """Small chats and agent turns (see the module's docstring); bodies as bytes, the
    request id last, the prompt (tools, then messages) first."""

    def __init__(self, seed: int, agent_share: float) -> None:
        self.rng = random.Random(seed)
        self.agent_share = agent_share
        base = random.Random(1)
        self.tools = tools(base)
        self.system = {"role": "system", "content": "You are a coding agent. "
                       + _words(2500, base)}
        self.history = [self._fresh(s) for s in range(SESSIONS)]
        self.turns = [0] * SESSIONS
        self.calls = 0

    def _fresh(self, s: int) -> list[dict[str, Any]]:
        rng = random.Random(self.rng.random())
        msgs: list[dict[str, Any]] = [self.system,
                                      {"role": "user", "content": f"task {s}: "
                                       + _words(200, rng)}]
        for i in range(HISTORY_CALLS):
            msgs += _call(i, rng)
        return msgs

    def next(self, rid: int) -> tuple[str, bytes, int, list[dict[str, Any]] | None]:
        """(kind, body, session, the history after this turn: None for a small chat)."""
        if self.rng.random() >= self.agent_share:
            body = {"messages": [{"role": "user", "content": _words(
                self.rng.randint(10, 150), self.rng)}], "max_tokens": 1,
                "kvbench_rid": rid}
            return "small", orjson.dumps(body), -1, None
        s = self.rng.randrange(SESSIONS)
        if self.turns[s] >= TURNS_PER_HISTORY:  # a new task: a new history
            self.history[s], self.turns[s] = self._fresh(s), 0
        self.calls += 1
        msgs = [*self.history[s], *_call(1000 + self.calls, self.rng)]
        body = {"tools": self.tools, "messages": msgs, "max_tokens": 1, "stream": True,
                "kvbench_rid": rid}
        return "agent", orjson.dumps(body), s, msgs

    def answered(self, s: int, msgs: list[dict[str, Any]]) -> None:
        self.history[s] = msgs
        self.turns[s] += 1


@dataclass
class Sent:
    kind: str
    sent: float
    done: float = 0.0
    status: int = 0
    predicted: int = -1


async def scrape(session: aiohttp.ClientSession, proxy: str) -> dict[str, float]:
    """kvroute_slot_wait_seconds summed over backends: its count and sum."""
    async with session.get(proxy + "/metrics") as r:
        text = await r.text()
    out = {"count": 0.0, "sum": 0.0}
    for line in text.splitlines():
        if line.startswith("kvroute_slot_wait_seconds_count"):
            out["count"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("kvroute_slot_wait_seconds_sum"):
            out["sum"] += float(line.rsplit(" ", 1)[1])
    return out


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def level(proxy: str, fake: str, pid: int, work: Workload, clients: int,
                warmup: float, seconds: float) -> dict[str, Any]:
    hdr = {"Content-Type": "application/json"}
    conn = aiohttp.TCPConnector(limit=clients)
    timeout = aiohttp.ClientTimeout(total=60)
    sent: dict[int, Sent] = {}
    rid = 0
    t_start = time.monotonic()
    t0 = t_start + warmup
    t1 = t0 + seconds
    window: dict[str, float] = {}
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session, \
            aiohttp.ClientSession(timeout=timeout) as side:  # (not behind the clients)
        async def mark() -> None:
            # the window: CPU read at its start and end, requests answered within it
            # counted (what was under way at either edge is outside, alike at both)
            await asyncio.sleep(max(0.0, t0 - 0.05 - time.monotonic()))
            window.update({f"m0_{k}": v for k, v in (await scrape(side, proxy)).items()})
            await asyncio.sleep(max(0.0, t0 - time.monotonic()))
            window["cpu0"], window["w0"] = cpu_seconds(pid), time.monotonic()
            await asyncio.sleep(max(0.0, t1 - time.monotonic()))
            window["cpu1"], window["w1"] = cpu_seconds(pid), time.monotonic()

        async def worker() -> None:
            nonlocal rid
            while time.monotonic() < t1 and rid < MAX_REQUESTS:
                rid += 1
                me = rid
                kind, body, s, msgs = work.next(me)
                rec = Sent(kind, time.monotonic())
                try:
                    async with session.post(proxy + "/v1/chat/completions", data=body,
                                            headers=hdr) as r:
                        await r.read()
                        rec.status = r.status
                        rec.predicted = int(r.headers.get("X-Kvroute-Predicted-Cached",
                                                          -1))
                except (TimeoutError, aiohttp.ClientError):
                    rec.status = -1
                rec.done = time.monotonic()
                sent[me] = rec
                if msgs is not None and rec.status == 200:
                    work.answered(s, msgs)

        marker = asyncio.create_task(mark())
        await asyncio.gather(*(worker() for _ in range(clients)))
        await marker
        m1 = await scrape(session, proxy)
        async with session.get(fake + "/bench/records") as r:
            records = orjson.loads(await r.read())
        async with session.get(proxy + "/kvroute/status") as r:
            status = await r.json()
    w0, w1 = window["w0"], window["w1"]
    done_in = [v for v in sent.values() if v.status == 200 and w0 <= v.done < w1]
    n = len(done_in)
    elapsed = w1 - w0
    cpu = window["cpu1"] - window["cpu0"]
    # the hand-off measure: requests sent in the window
    ok = {k: v for k, v in sent.items() if v.status == 200 and w0 <= v.sent < w1}
    beyond, beyond_held, service, reuse_err = [], [], [], []
    for k, v in ok.items():
        rec = records.get(str(k))
        if rec is None:
            continue
        arrived, started, prev_freed, freed, _, _, cache_n, _ = rec
        x = arrived - max(v.sent, prev_freed)
        beyond.append(x * 1000)
        if prev_freed > v.sent:
            beyond_held.append(x * 1000)
        service.append((freed - started) * 1000)
        if v.predicted >= 0 and v.kind == "agent":
            reuse_err.append(cache_n / max(1, v.predicted))
    kinds = [v.kind for v in done_in]
    held = m1["count"] - window["m0_count"]
    answered_since = sum(1 for v in sent.values() if v.status == 200 and v.done >= w0)
    return {
        "clients": clients, "requests": n,
        "errors": sum(1 for v in sent.values() if v.status != 200),
        "agent_share": kinds.count("agent") / max(1, n),
        "rps": n / elapsed, "cpu_ms": cpu * 1000 / max(1, n),
        "cpu_share": cpu / elapsed,
        "beyond_p50": _pct(beyond, 0.5), "beyond_p99": _pct(beyond, 0.99),
        "held_p50": _pct(beyond_held, 0.5), "held_p99": _pct(beyond_held, 0.99),
        "n_held_fake": len(beyond_held), "service_ms": statistics.fmean(service or [0]),
        "held_share": held / max(1, answered_since),
        "mean_hold_ms": (m1["sum"] - window["m0_sum"]) * 1000 / max(1.0, held),
        "latency_p50": _pct([(v.done - v.sent) * 1000 for v in done_in], 0.5),
        "latency_p99": _pct([(v.done - v.sent) * 1000 for v in done_in], 0.99),
        **{f"latency_{q}_{k}": _pct([(v.done - v.sent) * 1000 for v in done_in
                                     if v.kind == k], x)
           for k in ("small", "agent") for q, x in (("p50", 0.5), ("p99", 0.99))},
        "reuse_ratio": statistics.median(reuse_err) if reuse_err else float("nan"),
        "mispredictions": status["router"].get("mispredictions"),
        "completed": status["router"].get("completed"),
    }


async def client_main(proxy: str, fake_urls: list[str], pid: int, levels: list[int],
                      warmup: float, seconds: float, agent_share: float
                      ) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as session:
        for u in fake_urls:
            await wait_up(session, u)
        await wait_up(session, proxy)
        # every backend routable before the first request
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            async with session.get(proxy + "/kvroute/status") as r:
                st = await r.json()
            if len(st["router"]["backends"]) == BACKENDS:
                break
            await asyncio.sleep(0.2)
    work = Workload(0, agent_share)
    out = []
    for c in levels:
        res = await level(proxy, fake_urls[0], pid, work, c, warmup, seconds)
        print(f"  {c} clients: {res['requests']} requests, {res['rps']:.0f} req/s, proxy "
              f"CPU {res['cpu_ms']:.3f} ms/request", flush=True)
        out.append(res)
    return out


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"\n{BACKENDS} fake backends x {SLOTS} slots, service {args.base_ms:g} ms + "
          f"{args.per_1k_ms:g} ms per 1k new tokens; {args.agent_share:.0%} agent turns "
          f"(~30k tokens, {SESSIONS} sessions), the rest small chats; "
          f"{args.warmup:g} s warm-up + {args.seconds:g} s per level")
    print("| clients | req/s | proxy CPU ms/req | proxy CPU share | held by kvroute | "
          "mean hold | beyond slot order p50 / p99 (all) | p50 / p99 (held) | "
          "latency p50 / p99 | errors |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['clients']} | {r['rps']:.0f} | {r['cpu_ms']:.3f} | "
              f"{r['cpu_share']:.0%} | {r['held_share']:.0%} | {r['mean_hold_ms']:.1f} ms | "
              f"{r['beyond_p50']:.2f} / {r['beyond_p99']:.2f} ms | "
              f"{r['held_p50']:.2f} / {r['held_p99']:.2f} ms | "
              f"{r['latency_p50']:.0f} / {r['latency_p99']:.0f} ms | {r['errors']} |")
    lo, hi = results[0], results[-1]
    ratio = hi["cpu_ms"] / lo["cpu_ms"]
    print(f"\nCPU per request, {hi['clients']} / {lo['clients']} clients: {ratio:.2f}x "
          f"(target <= 1.3x: {'met' if ratio <= 1.3 else 'MISSED'})")
    def each(key: str, fmt: str) -> str:
        return ", ".join(format(r[key], fmt) for r in results)
    print(f"(agent share of answered requests: {each('agent_share', '.0%')}; the fake's "
          f"reuse / the proxy's prediction, median over agent turns: "
          f"{each('reuse_ratio', '.2f')}; the fake's mean service "
          f"{each('service_ms', '.0f')} ms)")
    print(orjson.dumps(results).decode())


def _interrupted(*_: object) -> None:
    raise KeyboardInterrupt


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=["client", "fake", "proxy"], default="client")
    ap.add_argument("--ports", default="")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--log", type=Path)
    ap.add_argument("--clients", default="16,64,256")
    ap.add_argument("--seconds", type=float, default=20.0, help="measured, per level")
    ap.add_argument("--warmup", type=float, default=5.0, help="before each level")
    ap.add_argument("--base-ms", type=float, default=150.0,
                    help="a fake slot's time per request (decode, overhead)")
    ap.add_argument("--per-1k-ms", type=float, default=4.0,
                    help="... and per 1k new (uncached) prompt tokens")
    ap.add_argument("--agent-share", type=float, default=0.5)
    args = ap.parse_args()
    ports = [int(p) for p in args.ports.split(",") if p]
    if args.role == "fake":
        run_fakes(ports, args.base_ms, args.per_1k_ms)
        return 0
    if args.role == "proxy":
        run_proxy(args.port, ports, args.model, args.log)
        return 0

    from backends.demo_model import DemoModelParams, ensure_demo_model

    model = ensure_demo_model(DemoModelParams())
    me = [sys.executable, str(Path(__file__).resolve())]
    fports = [free_port() for _ in range(BACKENDS)]
    pport = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    # SIGTERM (as SIGINT) unwinds through the finally below
    signal.signal(signal.SIGTERM, _interrupted)
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "proxy.log"
        try:
            procs.append(subprocess.Popen([
                *me, "--role", "fake", "--ports", ",".join(map(str, fports)),
                "--base-ms", str(args.base_ms), "--per-1k-ms", str(args.per_1k_ms)]))
            procs.append(subprocess.Popen([
                *me, "--role", "proxy", "--port", str(pport),
                "--ports", ",".join(map(str, fports)), "--model", str(model),
                "--log", str(log)]))
            print(f"proxy pid {procs[1].pid}", flush=True)
            results = asyncio.run(client_main(
                f"http://127.0.0.1:{pport}", [f"http://127.0.0.1:{p}" for p in fports],
                procs[1].pid, [int(c) for c in args.clients.split(",")], args.warmup,
                args.seconds, args.agent_share))
        finally:
            with contextlib.suppress(KeyboardInterrupt):
                _stop(procs)
    report(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
