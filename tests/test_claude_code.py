"""The real Claude Code CLI, headless, through kvroute to 2 real backends.

Three concurrent `claude -p` sessions (the demo model never stops, so Claude Code keeps
sending "continue" turns: each run is a real multi-turn session). On every turn after a
session's first, the backend must report `cache_read_input_tokens` >= 90% of the
prompt. Turns are observed at the proxy: a middleware tags each request with its
`X-Claude-Code-Session-Id`, and the Forwarder's Recorder (subclassed, still doing its
job) notes what the backend reported.

Skipped when the CLI is not installed; `npm install --prefix ~/.cache/kvroute/npm
@anthropic-ai/claude-code` installs it where this test looks (as does PATH and a
project-local node_modules/.bin).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import shutil
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.app import FORWARDER, create_app
from proxy.feedback import Outcome, Recorder
from proxy.router import Decision

REPO = Path(__file__).resolve().parent.parent


def find_claude() -> Path | None:
    found = shutil.which("claude")
    if found:
        return Path(found)
    for base in (REPO, Path.home() / ".cache" / "kvroute" / "npm"):
        p = base / "node_modules" / ".bin" / "claude"
        if p.exists():
            return p
    return None


CLAUDE = find_claude()
pytestmark = [
    pytest.mark.claude_code,
    pytest.mark.skipif(CLAUDE is None, reason="Claude Code CLI not installed (npm install "
                       "--prefix ~/.cache/kvroute/npm @anthropic-ai/claude-code)"),
    pytest.mark.timeout(720),
]

SESSIONS = 3
TURNS = 3            # turns observed per session before it is stopped (>= 2 required)
DEADLINE_S = 540.0   # whole run; cold prompts are ~20k tokens at ~1,500 tok/s per core

_session: contextvars.ContextVar[str | None] = contextvars.ContextVar("cc_session",
                                                                       default=None)


@dataclass(frozen=True)
class Turn:
    session: str | None
    endpoint: str
    status: int
    complete: bool      # the backend finished it (not abandoned by the client)
    prompt_tokens: int
    reported_cached: int | None
    backend: str
    at: float


class TurnRecorder(Recorder):
    """The proxy's own Recorder, plus a list of what each routed request reported."""

    def __init__(self, inner: Recorder) -> None:
        super().__init__(inner.metrics, inner.log)
        self.turns: list[Turn] = []

    def end(self, endpoint: str, decision: Decision, outcome: Outcome, started: float, *,
            stream: bool, backend_busy: bool = False) -> None:
        super().end(endpoint, decision, outcome, started, stream=stream,
                    backend_busy=backend_busy)
        self.turns.append(Turn(_session.get(), endpoint, outcome.status,
                               outcome.complete, decision.prompt_tokens, outcome.reported_cached,
                               decision.backend, time.monotonic()))


@web.middleware
async def tag_session(request: web.Request, handler: Any) -> web.StreamResponse:
    _session.set(request.headers.get("X-Claude-Code-Session-Id"))
    return await handler(request)


def claude_env(base_url: str, home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE"))}
    env.update({
        "HOME": str(home),  # no user settings, credentials or history leak in or out
        "ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_API_KEY": "dummy",
        "DISABLE_TELEMETRY": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "48",
        # a cold ~20k-token prefill on a busy CPU can take minutes: no client-side retry
        "API_TIMEOUT_MS": "600000",
    })
    return env


async def stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(proc.wait(), 5)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()


async def test_claude_code_sessions_reuse_the_backend_kv(backend_pool: Any,
                                                         tmp_path: Path) -> None:
    assert CLAUDE is not None
    # 32k per slot: Claude Code's first prompt is ~20k tokens on the demo vocabulary
    sup = await backend_pool(n=2, slots=2, ctx_per_slot=32768, fresh=True)
    app = create_app(sup.config, sup)
    app.middlewares.append(tag_session)
    server = TestServer(app, handler_cancellation=True)
    await server.start_server()
    recorder = TurnRecorder(app[FORWARDER].recorder)
    app[FORWARDER].recorder = recorder
    base_url = str(server.make_url("")).rstrip("/")
    procs: dict[str, asyncio.subprocess.Process] = {}
    try:
        for i in range(SESSIONS):
            home = tmp_path / f"home{i}"
            work = tmp_path / f"work{i}"
            home.mkdir()
            work.mkdir()
            (work / "notes.txt").write_text(f"project {i}: a list of things to do\n")
            sid = str(uuid.uuid4())  # sent back as X-Claude-Code-Session-Id
            procs[sid] = (await asyncio.create_subprocess_exec(
                str(CLAUDE), "-p", f"Summarise notes.txt for project {i} in one line.",
                "--session-id", sid,
                cwd=work, env=claude_env(base_url, home), start_new_session=True,
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE))
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            per = _by_session(recorder.turns)
            for sid, ts in per.items():
                if len(ts) >= TURNS and sid in procs:
                    await stop(procs[sid])  # done: leave the CPU to the others
            if all(len(per.get(sid, ())) >= TURNS for sid in procs):
                break
            if all(p.returncode is not None for p in procs.values()):
                break
            await asyncio.sleep(1)
    finally:
        for p in procs.values():
            await stop(p)
        await server.close()
    errs = [((await p.stdout.read()) + (await p.stderr.read())).decode(errors="replace")[-2000:]
            for p in procs.values() if p.stderr is not None and p.stdout is not None]

    per = _by_session(recorder.turns)
    report = {s: [(t.prompt_tokens, t.reported_cached, t.backend) for t in ts]
              for s, ts in per.items()}
    print("claude code turns (prompt, cache_read, backend):", report)
    assert set(per) == set(procs), (report, errs)
    for s, ts in per.items():
        assert len(ts) >= 2, (s, report, errs)
        assert ts[0].prompt_tokens > 5000, report  # the real system prompt and tools
        for t in ts[1:]:
            assert t.reported_cached is not None and \
                t.reported_cached >= 0.9 * t.prompt_tokens, (s, report)


def _by_session(turns: list[Turn]) -> dict[str, list[Turn]]:
    """Completed `/v1/messages` turns per Claude Code session, in order (a request the
    client gave up on, e.g. a cold prefill on a loaded host, is not a turn)."""
    out: dict[str, list[Turn]] = {}
    for t in sorted(turns, key=lambda t: t.at):
        if t.session and t.endpoint == "messages" and t.status == 200 and t.complete:
            out.setdefault(t.session, []).append(t)
    return out
