"""Anthropic `/v1/messages`: forward to the backend's `/v1/messages` (a) or translate to
its `/v1/chat/completions` with a pinned slot (b)? Measures both on the same workload.

    .venv/bin/python bench/bench_anthropic.py [--turns 4] [--system-words 3000]

Workload: 3 concurrent Claude-Code-like sessions (billing line with a rotating `cch`, one
system prompt and tool list shared by all sessions, per-session history growing by a
tool_use / tool_result pair per turn, streaming) over 2 fresh backends x 2 slots. From
the third turn on, each turn is accompanied by a concurrent side call that shares the
session's prefix up to its first turn and then diverges (as Claude Code's
title/summary/sub-agent calls do). Reported per mode: reuse on turns after the first
(backend-reported `cache_read_input_tokens` / prompt), side-call reuse, TTFT (client-side,
to the first content_block_delta), tokens prefilled in total.

Mode (a) is served by a bench-only handler doing what kvroute would do without a pin:
decide a backend, forward the body to its `/v1/messages` (the server picks the slot by
LCP similarity), feed the reported reuse back to the router with the slot unknown.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from backends.binary import cache_dir, find_llama_server
from backends.config import ManagedBackendConfig, SupervisionConfig
from backends.demo_model import DemoModelParams, demo_model_path
from backends.supervisor import Supervisor
from proxy.anthropic.routes import chat_body
from proxy.app import create_app
from proxy.config.load import Config, ProxyConfig, RoutingConfig
from proxy.forwarding.answer import JSON, Relay
from proxy.forwarding.send import Exchange, Target, send
from proxy.reporting.outcome import Outcome
from proxy.routing.decision import Report
from proxy.server.handlers import read_json
from proxy.server.keys import FORWARDER, TOKENIZING

WORDS = ("amber", "falcon", "harbor", "meadow", "quartz", "saddle", "tundra", "velvet",
         "walnut", "yonder", "lantern", "pepper", "copper", "dune", "ember", "glacier",
         "orbit", "prism", "raven", "signal", "timber", "vessel", "willow", "zenith")
TOOLS = [{"name": n, "description": f"The {n} tool. " * 20, "input_schema": {
    "type": "object", "properties": {"arg": {"type": "string"}}, "required": ["arg"]}}
    for n in ("Bash", "Read", "Edit", "Write", "Grep", "Glob")]


def words(n: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


class UsageTap(Relay):
    """Mode (a): relays the backend's Anthropic answer as is, noting usage and text."""

    def __init__(self) -> None:
        self.cached: int | None = None
        self.text: list[str] = []
        self.stopped = False

    def body(self, obj: JSON) -> JSON | None:
        self.cached = obj.get("usage", {}).get("cache_read_input_tokens")
        self.text += [b.get("text", "") for b in obj.get("content", []) if b.get("type") == "text"]
        self.stopped = True
        return None

    def event(self, obj: JSON) -> list[bytes] | None:
        if obj.get("type") == "message_start":
            self.cached = obj["message"]["usage"].get("cache_read_input_tokens")
        elif obj.get("type") == "content_block_delta" and obj["delta"].get("type") == "text_delta":
            self.text.append(obj["delta"]["text"])
        elif obj.get("type") == "message_stop":
            self.stopped = True
        return None


def mode_a_middleware(app: web.Application) -> Any:
    @web.middleware
    async def forward_messages(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path != "/v1/messages":
            return await handler(request)
        raw, body = await read_json(request)
        chat = chat_body(body)
        tokens = app[TOKENIZING].prompt.chat_tokens(chat)  # type: ignore[union-attr]
        fwd = app[FORWARDER]
        hint = request.headers.get("X-Claude-Code-Session-Id") or chat.get("user")
        decision = fwd.router.decide(tokens, session=hint, now=time.monotonic())
        info = fwd.backends[decision.backend]  # type: ignore[union-attr]
        tap = UsageTap()
        outcome = Outcome(started=time.perf_counter())
        done = False
        try:
            target = Target(info, None, decision.predicted_cached)
            resp = await send(Exchange(fwd.upstream, request, target, "/v1/messages",
                                       raw, outcome, relay=tap))
            if tap.stopped and outcome.status < 400:
                out = app[TOKENIZING].output_tokens("".join(tap.text))  # type: ignore[union-attr]
                fwd.router.complete(  # type: ignore[union-attr]
                    decision, Report(output_tokens=out, reported_cached=tap.cached),
                    now=time.monotonic())
                done = True
            return resp
        finally:
            if not done:
                fwd.router.abort(decision)  # type: ignore[union-attr]
    return forward_messages


def config(log_dir: Path, ctx: int) -> Config:
    bin_ = find_llama_server()
    assert bin_ is not None, "run `python -m backends prepare` first"
    return Config(
        proxy=ProxyConfig(port=0), routing=RoutingConfig(),
        backends=tuple(ManagedBackendConfig(
            name=n, model=demo_model_path(DemoModelParams()), slots=2, ctx_per_slot=ctx,
            threads=1, cache_ram_mib=1024, alias="kvroute-demo", is_demo=True)
            for n in ("a", "b")),
        llama_server=str(bin_.path), cache_dir=cache_dir(), log_dir=log_dir,
        supervision=SupervisionConfig(startup_timeout_s=60.0))


async def stream(http: aiohttp.ClientSession, url: str, body: JSON, session: str
                 ) -> dict[str, Any]:
    t0 = time.perf_counter()
    ttft = None
    usage: dict[str, Any] = {}
    text: list[str] = []
    async with http.post(f"{url}/v1/messages?beta=true", json={**body, "stream": True},
                         headers={"X-Claude-Code-Session-Id": session}) as r:
        assert r.status == 200, await r.text()
        predicted = int(r.headers["X-Kvroute-Predicted-Cached"])
        async for line in r.content:
            if not line.startswith(b"data:"):
                continue
            ev = json.loads(line[5:])
            if ev["type"] == "message_start":
                usage = ev["message"]["usage"]
            elif ev["type"] == "content_block_delta":
                ttft = ttft or time.perf_counter() - t0
                text.append(ev["delta"].get("text", ""))
            elif ev["type"] == "error":
                raise RuntimeError(ev)
    if not usage:
        # llama-server's own /v1/messages stream omits message_start when the first token
        # is an incomplete UTF-8 sequence (no partial result for n_decoded == 1): an
        # Anthropic SDK client fails on such a stream. Counted, no usage known.
        return {"prompt": None, "cached": None, "ttft": ttft, "predicted": predicted,
                "text": "".join(text), "no_message_start": 1}
    prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
    return {"prompt": prompt, "cached": usage["cache_read_input_tokens"], "ttft": ttft,
            "predicted": predicted, "text": "".join(text)}


async def session(http: aiohttp.ClientSession, url: str, i: int, system_words: int,
                  turns: int, rows: list[dict[str, Any]]) -> None:
    shared = random.Random(0)
    system_text = "You are a coding agent. " + words(system_words, shared)
    rng = random.Random(100 + i)
    sid = f"session-{i}"
    msgs: list[JSON] = [{"role": "user", "content": f"<env>cwd /work/p{i}</env> "
                         + words(400, rng)}]
    prev = 0
    for turn in range(turns):
        cch = f"{rng.randrange(16**5):05x}"
        body = {"model": "m", "max_tokens": 16, "tools": TOOLS, "messages": msgs,
                "system": [{"type": "text", "text": "x-anthropic-billing-header: "
                            f"cc_version=2.1.197.abc; cc_entrypoint=cli; cch={cch};"},
                           {"type": "text", "text": system_text}]}
        calls = [stream(http, url, body, sid)]
        if turn >= 2:  # a side call: the prefix up to the first turn, then its own tail
            side = {**body, "max_tokens": 8, "messages": [
                *msgs[:1], {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "Write a title. " + words(300, rng)}]}
            calls.append(stream(http, url, side, sid))
        results = await asyncio.gather(*calls)
        got = results[0]
        lost = None if got["cached"] is None else max(0, prev - got["cached"])
        rows.append({"kind": "turn", "session": i, "turn": turn, "lost": lost, **got})
        prev = got["prompt"] or prev  # history the backend had to redo: `lost`
        if len(results) > 1:
            rows.append({"kind": "side", "session": i, "turn": turn, **results[1]})
        msgs += [{"role": "assistant", "content": [
                      {"type": "text", "text": results[0]["text"]},
                      {"type": "tool_use", "id": f"t{turn}", "name": "Bash",
                       "input": {"arg": f"ls {turn}"}}]},
                 {"role": "user", "content": [
                     {"type": "tool_result", "tool_use_id": f"t{turn}",
                      "content": words(300, rng)}]}]


async def run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    cfg = config(Path(tempfile.mkdtemp(prefix=f"bench-anth-{mode}-")), args.ctx)
    sup = Supervisor(cfg)
    await sup.start()
    app = create_app(cfg, sup)
    if mode == "a":
        app.middlewares.append(mode_a_middleware(app))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    url = f"http://127.0.0.1:{port}"
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    try:
        timeout = aiohttp.ClientTimeout(total=900)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            await asyncio.gather(*(session(http, url, i, args.system_words, args.turns, rows)
                                   for i in range(3)))
    finally:
        await runner.cleanup()
        await sup.stop()
    wall = time.perf_counter() - t0
    broken = sum(r.get("no_message_start", 0) for r in rows)
    rows = [r for r in rows if r["prompt"] is not None]
    later = [r for r in rows if r["kind"] == "turn" and r["turn"] > 0]
    side = [r for r in rows if r["kind"] == "side"]
    first = [r for r in rows if r["kind"] == "turn" and r["turn"] == 0]
    return {
        "mode": mode, "wall_s": round(wall, 1), "streams_without_message_start": broken,
        "later_turns": len(later),
        "later_reuse_mean": round(statistics.mean(r["cached"] / r["prompt"] for r in later), 3),
        "later_reuse_min": round(min(r["cached"] / r["prompt"] for r in later), 3),
        "later_lost_tokens": sum(r["lost"] for r in later),
        "later_turns_full_reuse": sum(r["lost"] == 0 for r in later),
        "mispredicted": sum(abs(r["predicted"] - r["cached"]) > max(16, 0.02 * r["prompt"])
                            for r in rows),
        "later_ttft_median_s": round(statistics.median(r["ttft"] for r in later), 3),
        "later_ttft_max_s": round(max(r["ttft"] for r in later), 3),
        "side_reuse_mean": round(statistics.mean(r["cached"] / r["prompt"] for r in side), 3),
        "side_ttft_median_s": round(statistics.median(r["ttft"] for r in side), 3),
        "first_prompt_tokens": first[0]["prompt"],
        "prefilled_tokens": sum(r["prompt"] - r["cached"] for r in rows),
        "prompt_tokens": sum(r["prompt"] for r in rows),
        "rows": [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
                  if k != "text"} for r in rows],
    }


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-words", type=int, default=3000)
    p.add_argument("--ctx", type=int, default=16384)
    p.add_argument("--modes", default="ab")
    args = p.parse_args()
    for mode in args.modes:
        res = await run_mode(mode, args)
        rows = res.pop("rows")
        print(json.dumps(res))
        print(json.dumps(rows), file=sys.stderr)


if __name__ == "__main__":
    asyncio.run(main())
