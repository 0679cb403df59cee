"""Async load generator: plays a Workload against one URL and measures every request.

Every request streams, so time to first token (TTFT) is the arrival of the first event
carrying generated text; end-to-end latency is the last byte. Reused tokens are what the
backend reports: ``timings.cache_n`` (llama.cpp, any endpoint), else OpenAI
``usage.prompt_tokens_details.cached_tokens``, else Anthropic
``usage.cache_read_input_tokens``. kvroute's response headers add the backend, the slot
and the router's predicted reuse.

Bounded: at most ``max_requests`` are sent and nothing runs past ``time_limit_s`` (requests
still in flight then are cancelled and counted as cut). Only loopback targets are
accepted, and the hosts loadtest/netns.py made, from a thread inside them: this tool
generates load, and must not be pointed at someone else's service.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from loadtest.workloads import Request, Session, Workload
from proxy.reporting.outcome import reported_reuse

Progress = Callable[[int, int, int], None]  # (done, total, errors)


# the requests of a coding agent's session: its turns and side calls
_AGENT_KINDS = frozenset({"main", "title", "summary"})


@dataclass
class Result:
    id: str
    session: str
    turn: int
    kind: str
    sent_s: float  # since the start of the run
    ttft_s: float | None = None
    e2e_s: float = 0.0
    ok: bool = False
    status: int = 0
    error: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None
    backend: str | None = None  # X-Kvroute-Backend (or the runner's label when direct)
    slot: int | None = None
    predicted_cached: int | None = None
    predicted_tier: str | None = None  # X-Kvroute-Tier

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RunOutcome:
    results: list[Result] = field(default_factory=list)
    wall_s: float = 0.0
    cut: int = 0  # requests cancelled by the time limit
    skipped: int = 0  # requests never sent (request or time budget exhausted)


def check_loopback(url: str) -> str:
    """The URL without a trailing slash or ``/v1``; ValueError unless it is loopback, or
    a host of loadtest.netns's that the calling thread is inside."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.scheme not in ("http", "https") or not host:
        raise ValueError(f"{url!r}: expected http://127.0.0.1:PORT")
    try:
        loop = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loop = host == "localhost"
    if not loop:
        # (imported here: it loads libc through ctypes, Linux only, and the load client
        # runs elsewhere against 127.0.0.1)
        from loadtest import netns
        if not netns.reachable(host):
            raise ValueError(f"{url!r}: refusing a non-loopback target (load tests run "
                             "locally, or from inside hosts loadtest.netns made)")
    base = url.rstrip("/")
    return base[:-3] if base.endswith("/v1") else base


def endpoint(req: Request) -> str:
    if req.api == "anthropic":
        return "/v1/messages"
    if req.api == "llama":
        return "/completion"
    return "/v1/completions" if "prompt" in req.body else "/v1/chat/completions"


def _int(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _first_text(obj: dict[str, Any]) -> bool:
    """Does this stream event carry generated output?"""
    if obj.get("type") == "content_block_delta":  # anthropic
        return True
    if isinstance(obj.get("content"), str) and obj["content"]:  # llama /completion
        return True
    for ch in obj.get("choices") or ():
        d = ch.get("delta") or {}
        if d.get("content") or d.get("reasoning_content") or d.get("tool_calls"):
            return True
        if ch.get("text"):  # /v1/completions
            return True
    return False


def _usage(obj: dict[str, Any], res: Result) -> None:
    """Fold whatever token counts an event (or a whole body) reports into ``res``."""
    t = obj.get("timings")
    reused, prompt = reported_reuse(obj)
    if isinstance(t, dict) and reused is not None:
        res.cached_tokens, res.prompt_tokens = reused, prompt
        res.output_tokens = _int(t.get("predicted_n")) or res.output_tokens
    msg = obj.get("message") if obj.get("type") == "message_start" else obj
    u = (msg or {}).get("usage")
    if not isinstance(u, dict):
        return
    if "cache_read_input_tokens" in u or "input_tokens" in u:  # anthropic
        if res.prompt_tokens is None and _int(u.get("input_tokens")) is not None:
            cached = _int(u.get("cache_read_input_tokens")) or 0
            res.cached_tokens = cached
            res.prompt_tokens = u["input_tokens"] + cached
        res.output_tokens = _int(u.get("output_tokens")) or res.output_tokens
        return
    res.output_tokens = _int(u.get("completion_tokens")) or res.output_tokens
    if res.cached_tokens is None:  # no llama.cpp timings: a non-llama target
        res.cached_tokens, res.prompt_tokens = reused, prompt


class LoadClient:
    def __init__(self, base_url: str | Sequence[str], api_key: str | None = None, *,
                 request_timeout_s: float = 300.0, max_requests: int = 1000,
                 time_limit_s: float = 300.0, ignore_eos: bool = True,
                 label: str | None = None, progress: Progress | None = None) -> None:
        # several: requests go to each in turn, as from a round-robin balancer in front
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        self.bases = [check_loopback(u) for u in urls]
        self.base = self.bases[0]
        self._sent = 0
        self.api_key = api_key
        self.request_timeout_s = request_timeout_s
        self.max_requests = max_requests
        self.time_limit_s = time_limit_s
        # llama.cpp extension: every request then generates exactly max_tokens, so the
        # decode work is the same for every policy (random demo weights hit EOS at random)
        self.ignore_eos = ignore_eos
        self.label = label  # backend name to record when the target sends no header
        self.progress = progress

    def _payload(self, req: Request) -> dict[str, Any]:
        body = dict(req.body, stream=True)
        if req.api == "openai":
            body["stream_options"] = {"include_usage": True}
        if self.ignore_eos and req.api != "anthropic":
            body["ignore_eos"] = True
        return body

    def _headers(self, req: Request) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if req.api == "anthropic":
            h["anthropic-version"] = "2023-06-01"
        if req.kind in _AGENT_KINDS:
            # as Claude Code names its session (X-Claude-Code-Session-Id) on every call
            h["X-Session-Id"] = req.session
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
            h["x-api-key"] = self.api_key
        return h

    async def _one(self, session: aiohttp.ClientSession, req: Request, t0: float) -> Result:
        start = time.perf_counter()
        res = Result(req.id, req.session, req.turn, req.kind, start - t0, backend=self.label)
        base = self.bases[self._sent % len(self.bases)]
        self._sent += 1
        try:
            async with session.post(base + endpoint(req), json=self._payload(req),
                                    headers=self._headers(req)) as resp:
                res.status = resp.status
                h = resp.headers
                res.backend = h.get("X-Kvroute-Backend", res.backend)
                res.slot = _int(_maybe_int(h.get("X-Kvroute-Slot")))
                res.predicted_cached = _int(_maybe_int(h.get("X-Kvroute-Predicted-Cached")))
                res.predicted_tier = h.get("X-Kvroute-Tier")
                if resp.status >= 400:
                    res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                else:
                    await self._read_stream(resp, res, start)
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            res.error = f"{type(e).__name__}: {e}"[:300]
        res.e2e_s = time.perf_counter() - start
        res.ok = res.error is None
        return res

    async def _read_stream(self, resp: aiohttp.ClientResponse, res: Result,
                           start: float) -> None:
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            obj = json.loads(data)
            if not isinstance(obj, dict):
                continue
            if obj.get("error") or obj.get("type") == "error":
                res.error = f"stream error: {json.dumps(obj)[:200]}"
                return
            if res.ttft_s is None and _first_text(obj):
                res.ttft_s = time.perf_counter() - start
            _usage(obj, res)
        if res.ttft_s is None:  # nothing generated (e.g. max_tokens 0): first == last
            res.ttft_s = time.perf_counter() - start

    async def run(self, workload: Workload) -> RunOutcome:
        """Play every session; returns when all are done or the time limit cuts them."""
        total = min(self.max_requests, len(workload.requests()))
        out = RunOutcome()
        sent = 0
        t0 = time.perf_counter()
        deadline = t0 + self.time_limit_s
        inflight: set[asyncio.Task[Result]] = set()

        def report() -> None:
            if self.progress:
                self.progress(len(out.results), total, sum(not r.ok for r in out.results))

        async def play(s: Session, http: aiohttp.ClientSession) -> None:
            nonlocal sent
            await asyncio.sleep(max(0.0, t0 + s.start_s - time.perf_counter()))
            for step in s.steps:
                await asyncio.sleep(step.delay_s)
                batch = [step.main, *step.side]
                if sent + len(batch) > self.max_requests or time.perf_counter() >= deadline:
                    return
                sent += len(batch)
                tasks = [asyncio.create_task(self._one(http, r, t0)) for r in batch]
                inflight.update(tasks)
                for done in await asyncio.gather(*tasks):
                    out.results.append(done)
                    report()
                inflight.difference_update(tasks)

        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
            players = [asyncio.create_task(play(s, http)) for s in workload.sessions]
            try:
                await asyncio.wait(players, timeout=self.time_limit_s)
            finally:  # time limit, or we were cancelled: nothing may outlive the session
                out.cut = sum(not t.done() for t in inflight)
                for t in (*players, *inflight):
                    t.cancel()
                await asyncio.gather(*players, *inflight, return_exceptions=True)
        out.wall_s = time.perf_counter() - t0
        out.skipped = len(workload.requests()) - len(out.results) - out.cut
        out.results.sort(key=lambda r: r.sent_s)
        report()
        return out


def _maybe_int(v: str | None) -> int | None:
    try:
        return int(v) if v is not None else None
    except ValueError:
        return None
