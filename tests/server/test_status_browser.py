"""The status page in a real browser: headless Chromium opens it on a running kvroute with
real backends (the admin key given as HTTP Basic credentials, as an operator's browser
sends them), chat requests follow, and the page shows them without a reload. Driven over
the DevTools protocol (a websocket) to watch the live update; a screenshot is kept under
the test's tmp_path. Skipped where no Chromium is installed (`make test` installs it
where apt can)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import PoolFactory
from proxy_client import proxy

from backends.process import free_port
from proxy.config.settings import ProxySettings

pytestmark = pytest.mark.timeout(240)

KEY = "browser-key-5e0b"
CANARY = "walrus-canary-77c1"
HOSTILE = '<img src=x onerror="document.title=1">'
def _chromium() -> str | None:
    """A Chromium that runs (a snap's stub of one without snapd does not)."""
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path is not None and subprocess.run([path, "--version"], capture_output=True,
                                               timeout=30, check=False).returncode == 0:
            return path
    return None


CHROMIUM = _chromium()


class Page:
    """One browser tab over the DevTools protocol: commands and the page's exceptions."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.ids = itertools.count(1)
        self.exceptions: list[Any] = []

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        n = next(self.ids)
        await self.ws.send_json({"id": n, "method": method, "params": params})
        while True:
            msg = json.loads(await asyncio.wait_for(self.ws.receive_str(), 30))
            if msg.get("method") == "Runtime.exceptionThrown":
                self.exceptions.append(msg["params"])
            if msg.get("id") == n:
                assert "error" not in msg, msg
                return msg["result"]

    async def eval(self, expression: str) -> Any:
        got = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return got["result"].get("value")

    async def wait(self, expression: str, timeout: float = 30) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = await self.eval(expression)
            if value:
                return value
            assert time.monotonic() < deadline, f"never true: {expression}"
            await asyncio.sleep(0.2)


@contextlib.asynccontextmanager
async def chromium(tmp: Path) -> AsyncIterator[Page]:
    assert CHROMIUM is not None
    port = free_port()
    log = (tmp / "chromium.log").open("wb")
    proc = await asyncio.create_subprocess_exec(
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
        "--no-default-browser-check", "--disable-dev-shm-usage", "--window-size=1400,1400",
        f"--user-data-dir={tmp / 'profile'}", f"--remote-debugging-port={port}",
        "about:blank", stdout=log, stderr=log)
    try:
        async with aiohttp.ClientSession() as s:
            target = await _page_target(s, port)
            async with s.ws_connect(target, max_msg_size=0) as ws:
                page = Page(ws)
                await page.call("Runtime.enable")
                await page.call("Page.enable")
                yield page
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        await proc.wait()
        log.close()


async def _page_target(s: aiohttp.ClientSession, port: int) -> str:
    deadline = time.monotonic() + 30
    while True:
        with contextlib.suppress(aiohttp.ClientError):
            async with s.get(f"http://127.0.0.1:{port}/json/list") as r:
                pages = [t for t in await r.json() if t["type"] == "page"]
                if pages:
                    return str(pages[0]["webSocketDebuggerUrl"])
        assert time.monotonic() < deadline, "chromium's DevTools never answered"
        await asyncio.sleep(0.2)


STATE = """JSON.stringify({
  conn: document.getElementById("conn").dataset.state,
  snapshots: Number(document.getElementById("updated").dataset.snapshots),
  backends: [...document.querySelectorAll("#backends tbody tr")].map(r => r.dataset.backend),
  slots: document.querySelectorAll("#caches .slot").length,
  sessions: [...document.querySelectorAll("#caches .session")].map(e => e.textContent),
  decisions: [...document.querySelectorAll("#decisions tbody tr")].map(
    r => [...r.cells].map(c => c.textContent)),
  totals: document.getElementById("totals").textContent,
  text: document.body.innerText,
  imgs: document.querySelectorAll("img").length,
  title: document.title,
})"""


def state(condition: str) -> str:
    """A JS expression: ``condition`` on the page's STATE, as ``s``."""
    return f"(s => {condition})(JSON.parse({STATE}))"


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (apt-get install chromium; "
                    "`make test` does where apt is available)")
async def test_the_page_updates_live_in_a_browser(backend_pool: PoolFactory,
                                                   tmp_path: Path) -> None:
    sup = await backend_pool()
    auth = {"Authorization": f"Bearer {KEY}"}
    async with proxy(sup, ProxySettings(api_keys=(KEY,))) as c, chromium(tmp_path) as page:
        await page.call("Page.navigate", url=f"http://operator:{KEY}@{c.host}:{c.port}/")
        await page.wait(state("s.conn === 'live' && s.snapshots >= 1"))
        before = json.loads(await page.eval(STATE))
        assert before["backends"] == ["a", "b"] and before["slots"] == 4

        # a conversation and its next turn (reuse), then another session's first turn
        first = [{"role": "user", "content": f"{CANARY}: tell me about slots"}]
        turns = (("ops-1", first),
                 ("ops-1", [*first, {"role": "assistant", "content": "They hold KV."},
                            {"role": "user", "content": "And the RAM tier?"}]),
                 (HOSTILE, [{"role": "user", "content": f"{CANARY}: a new question"}]))
        for session, messages in turns:
            body = {"model": "kvroute-demo", "max_tokens": 4, "temperature": 0,
                    "messages": messages}
            async with c.post("/v1/chat/completions", json=body,
                              headers={**auth, "X-Session-Id": session}) as r:
                assert r.status == 200, await r.text()

        # no reload: the decisions arrive over the open stream, the snapshots go on
        n = len(before["decisions"])
        await page.wait(state(f"s.decisions.length >= {n + 3}"))
        await page.wait(state(f"s.snapshots >= {before['snapshots'] + 2}"))
        await page.wait(state(f"s.sessions.some(t => t.includes({json.dumps(HOSTILE)}))"))
        after = json.loads(await page.eval(STATE))
        shot = tmp_path / "status-page.png"
        got = await page.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        shot.write_bytes(base64.b64decode(got["data"]))
        print(f"status page screenshot: {shot}")

    newest = after["decisions"][0]  # time, request, endpoint, backend, slot, tier, ...
    assert newest[2] == "chat" and newest[3] in {"a", "b"} and newest[10] == "200"
    assert "last minute: 3 requests" in after["totals"]
    assert after["conn"] == "live" and not page.exceptions
    # the hostile session id is shown as text, never parsed as markup
    assert any(HOSTILE in s for s in after["sessions"])
    assert after["imgs"] == 0 and after["title"] == "kvroute status"
    assert CANARY not in after["text"]
    assert shot.stat().st_size > 10_000
