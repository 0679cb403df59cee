"""The real Claude Code CLI, headless, through kvroute as `make run` serves it: the
shipped config.yaml and its managed backends, so a config that cannot serve Claude
Code's first prompt fails here.

Three concurrent `claude -p` sessions (the demo model never stops, so Claude Code keeps
sending "continue" turns: each run is a real multi-turn session). The last one runs
without tool search: its first prompt carries every tool schema, the largest Claude Code
sends (it falls back to that shape for a conversation after a 400). Over the turns after
each session's first, the backends must report `cache_read_input_tokens` >= 95% of the
prompt tokens. Turns are observed at the proxy: a middleware tags each request with its
`X-Claude-Code-Session-Id`, and the Forwarder's Recorder (subclassed, still doing its
job) notes what the backend reported.

Skipped when the CLI is not installed; `make claude-code` installs the release the
Makefile pins where this test looks first (~/.cache/kvroute/npm; then a project-local
node_modules/.bin, then PATH), and the test checks it runs that release.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from proxy_client import ProxyServer

from backends.supervisor import Supervisor
from proxy.app import create_app
from proxy.config.load import load_config
from proxy.reporting.outcome import Outcome
from proxy.reporting.recorder import Recorder
from proxy.routing.routed import Routed
from proxy.server.keys import FORWARDER

REPO = Path(__file__).resolve().parent.parent


def find_claude() -> Path | None:
    """The one `make claude-code` installs first (the pinned release), then others."""
    for base in (Path.home() / ".cache" / "kvroute" / "npm", REPO):
        p = base / "node_modules" / ".bin" / "claude"
        if p.exists():
            return p
    found = shutil.which("claude")
    return Path(found) if found else None


def pinned_version() -> str:
    """The release the Makefile pins (CLAUDE_CODE_VERSION): its one owner."""
    m = re.search(r"^CLAUDE_CODE_VERSION \?= (\S+)$", (REPO / "Makefile").read_text(), re.M)
    assert m, "CLAUDE_CODE_VERSION not found in the Makefile"
    return m.group(1)


CLAUDE = find_claude()
pytestmark = [
    pytest.mark.claude_code,
    pytest.mark.skipif(CLAUDE is None, reason="Claude Code CLI not installed "
                       "(`make claude-code` installs the pinned release)"),
    pytest.mark.timeout(720),
]

SESSIONS = 3
TURNS = 3            # turns observed per session before it is stopped (>= 2 required)
DEADLINE_S = 540.0   # whole run; a cold first prompt (12k-19k tokens) takes 1-2 min

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

    def end(self, endpoint: str, decision: Routed, outcome: Outcome, started: float, *,
            stream: bool, backend_busy: bool = False, media_tokens: int = 0) -> None:
        super().end(endpoint, decision, outcome, started, stream=stream,
                    backend_busy=backend_busy, media_tokens=media_tokens)
        self.turns.append(Turn(_session.get(), endpoint, outcome.status,
                               outcome.complete, decision.prompt_tokens, outcome.reported_cached,
                               decision.backend, time.monotonic()))


@web.middleware
async def tag_session(request: web.Request, handler: Any) -> web.StreamResponse:
    _session.set(request.headers.get("X-Claude-Code-Session-Id"))
    return await handler(request)


def claude_env(base_url: str, home: Path, *, tool_search: bool = True) -> dict[str, str]:
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
    if not tool_search:
        env["ENABLE_TOOL_SEARCH"] = "false"
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


async def test_claude_code_sessions_reuse_the_backend_kv(llama_server_bin: Path,
                                                         demo_model: Path,
                                                         tmp_path: Path) -> None:
    """Against the shipped config.yaml as `make run` serves it (only the log directory
    moves to the test's own), with the release the Makefile pins."""
    assert CLAUDE is not None
    version = subprocess.run([str(CLAUDE), "--version"], capture_output=True, text=True,
                             timeout=60).stdout.split()
    assert version and version[0] == pinned_version(), \
        f"Claude Code {version} is not the pinned {pinned_version()}: run `make claude-code`"
    print(f"Claude Code {version[0]} ({CLAUDE})")
    # the shipped config as is, but for where logs and backends.json go (not semantic:
    # a `make run` serving from this checkout keeps its own); the proxy listens on a
    # test port instead of proxy.port
    cfg = dataclasses.replace(load_config(REPO / "config.yaml", check_port=False),
                              log_dir=tmp_path / "logs")
    sup = Supervisor(cfg)
    await sup.start()
    assert len(sup.ready()) == len(cfg.backends), sup.statuses()
    app = create_app(cfg, sup)
    app.middlewares.append(tag_session)
    server = ProxyServer(app, handler_cancellation=True)
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
                cwd=work, env=claude_env(base_url, home, tool_search=i < SESSIONS - 1),
                start_new_session=True,
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
        await sup.stop()
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
    later = [t for ts in per.values() for t in ts[1:]]
    reused = sum(t.reported_cached or 0 for t in later) / sum(t.prompt_tokens for t in later)
    print(f"reused over later turns: {reused:.3f} of the prompt")
    assert reused >= 0.95, report


def _by_session(turns: list[Turn]) -> dict[str, list[Turn]]:
    """Completed `/v1/messages` turns per Claude Code session, in order (a request the
    client gave up on, e.g. a cold prefill on a loaded host, is not a turn)."""
    out: dict[str, list[Turn]] = {}
    for t in sorted(turns, key=lambda t: t.at):
        if t.session and t.endpoint == "messages" and t.status == 200 and t.complete:
            out.setdefault(t.session, []).append(t)
    return out
