"""The disk tier's failures, with real llama-servers: a kvroute restarted over an index that
does not parse, or that is older than the files (stopped between a save's file and the
index naming it), restores every conversation all the same; a save the server fails is
logged with the server's reason and the fix, and shown in /kvroute/status (whose file
count stays the files actually held) and on the status page."""

from __future__ import annotations

import dataclasses
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import structlog
from aiohttp.test_utils import TestClient
from faults import until
from proxy_client import proxy
from proxy_client import slot_files_counted as counted
from server.test_status_browser import CHROMIUM, chromium
from texts import words

from backends.config import KvDiskConfig
from backends.supervisor import Supervisor
from proxy.config.load import Config
from proxy.disk.records import INDEX, QUARANTINE
from proxy.observability.logging import configure_logging

pytestmark = pytest.mark.timeout(240)


async def turn(client: TestClient[Any, Any], messages: list[dict[str, str]]
               ) -> tuple[int, int, int]:
    """(predicted, reported reuse, prompt tokens) of one turn; a fixed answer goes into
    the history, so that what a slot holds is known exactly."""
    async with client.post("/v1/chat/completions", json={
            "model": "kvroute-demo", "max_tokens": 4, "messages": messages}) as r:
        body = await r.json()
        assert r.status == 200, body
        predicted = int(r.headers["X-Kvroute-Predicted-Cached"])
    t = body["timings"]
    messages.append({"role": "assistant", "content": "Noted."})
    return predicted, t["cache_n"], t["cache_n"] + t["prompt_n"]


def slot_files(path: Path) -> set[str]:
    return {f.name for f in path.glob("kvroute-*.bin") if f.is_file()}


@pytest.mark.parametrize("fault", ["garbage", "older than the files"])
async def test_a_restarted_kvroute_keeps_every_file_whatever_its_index(
        pool_config: Callable[..., Config], tmp_path: Path, fault: str) -> None:
    """``garbage``: the operator's bytes over the index between two runs. ``older than
    the files``: the index as it was before the last save (kvroute stopped between
    writing a file and the index)."""
    disk = KvDiskConfig(tmp_path / "slots", save_after_idle_s=0.3, min_tokens=64)
    cfg = dataclasses.replace(pool_config(n=1, slots=2, cache_ram_mib=0), kv_disk=disk)
    sessions = [[{"role": "system", "content": words(300, 130 + i)},
                 {"role": "user", "content": words(40, 140 + i)}] for i in range(2)]
    before: list[int] = []
    for run in range(2):
        sup = Supervisor(cfg)
        await sup.start()
        try:
            async with proxy(sup) as client:
                if run == 0:
                    for n, s in enumerate(sessions, start=1):
                        before.append((await turn(client, s))[2])
                        await until(lambda n=n: counted(client, "saved") >= n, 30)  # type: ignore[misc]
                        if n == 1:
                            first = (disk.path / INDEX).read_bytes()
                    saved = slot_files(disk.path)
                    assert len(saved) == 2
                else:
                    await until(lambda: counted(client, "restored") >= 2, 30)
                    assert slot_files(disk.path) == saved
                    assert not (disk.path / QUARANTINE).exists()
                    for s, previous in zip(sessions, before, strict=True):
                        s.append({"role": "user", "content": words(20, len(s))})
                        predicted, reused, _ = await turn(client, s)
                        assert reused >= 0.9 * previous and abs(predicted - reused) <= 1, \
                            (predicted, reused, previous)
        finally:
            await sup.stop()
        if run == 0:
            (disk.path / INDEX).write_bytes(b"\x00\xff\xfegarbage{{{[" if fault == "garbage"
                                            else first)


async def test_a_failed_save_is_logged_with_its_reason_and_shown(
        pool_config: Callable[..., Config], tmp_path: Path) -> None:
    """The server cannot write the file (a directory in the way of the names it is given
    next: as root, permissions would not stop it): each failed save is one warning with
    the server's error, what kvroute sees, and the fix; /kvroute/status counts it, says
    the last one, and counts only the files held. The way cleared, saves resume."""
    disk = KvDiskConfig(tmp_path / "slots", save_after_idle_s=0.3, min_tokens=64)
    cfg = dataclasses.replace(pool_config(n=1, slots=2, cache_ram_mib=0), kv_disk=disk)
    out = io.StringIO()
    saved_logging = structlog.get_config()
    configure_logging("info", stream=out)
    sup = Supervisor(cfg)
    try:
        await sup.start()
        async with proxy(sup) as client:
            in_the_way = [disk.path / f"kvroute-{i}.bin" for i in (1, 2)]
            for d in in_the_way:
                d.mkdir()
            sessions = [[{"role": "system", "content": words(300, 150 + i)},
                         {"role": "user", "content": words(40, 160 + i)}] for i in range(2)]
            await turn(client, sessions[0])
            await until(lambda: counted(client, "save_failed") >= 1, 30)
            async with client.get("/kvroute/status") as r:
                (shown,) = (await r.json())["kv_disk"]["directories"]
            assert (shown["files"], shown["saved"], shown["save_failed"]) == (0, 0, 1)
            assert slot_files(disk.path) == set()
            last = shown["last_failure"]
            assert (last["what"], last["backend"], last["file"]) == ("save", "a",
                                                                     "kvroute-1.bin")
            assert last["reason"] == ("server: Unable to save slot; not a file in the "
                                      f"way: {in_the_way[0]}")
            assert last["fix"] == f"remove {in_the_way[0]}" and last["at"] > 0

            for d in in_the_way:
                d.rmdir()
            await turn(client, sessions[1])
            await until(lambda: counted(client, "saved") >= 1, 30)
            async with client.get("/kvroute/status") as r:
                (shown,) = (await r.json())["kv_disk"]["directories"]
            assert (shown["files"], shown["saved"], shown["save_failed"]) == (1, 1, 1)
            assert len(slot_files(disk.path)) == 1
    finally:
        await sup.stop()
        structlog.configure(**saved_logging)
    lines = [json.loads(line) for line in out.getvalue().splitlines()
             if '"slot.save_failed"' in line]
    assert len(lines) == 1, lines
    assert lines[0]["level"] == "warning" and lines[0]["slot"] in (0, 1)
    assert lines[0]["reason"].startswith("server: Unable to save slot")
    assert lines[0]["fix"] == f"remove {in_the_way[0]}"


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (apt-get install chromium)")
async def test_the_status_page_shows_a_failed_save(pool_config: Callable[..., Config],
                                                   tmp_path: Path) -> None:
    disk = KvDiskConfig(tmp_path / "slots", save_after_idle_s=0.3, min_tokens=64)
    cfg = dataclasses.replace(pool_config(n=1, slots=2, cache_ram_mib=0), kv_disk=disk)
    sup = Supervisor(cfg)
    await sup.start()
    try:
        async with proxy(sup) as client, chromium(tmp_path) as page:
            (disk.path / "kvroute-1.bin").mkdir()
            await turn(client, [{"role": "system", "content": words(300, 170)},
                                {"role": "user", "content": words(40, 171)}])
            await until(lambda: counted(client, "save_failed") >= 1, 30)
            await page.call("Page.navigate", url=f"http://{client.host}:{client.port}/")
            shown = await page.wait('(t => t.includes("Unable to save slot") && t)'
                                    '(document.getElementById("disk").textContent)')
            assert not page.exceptions
    finally:
        await sup.stop()
    assert "0 saved · 1 saves failed · 0 restores failed" in shown
    assert f"fix: remove {disk.path / 'kvroute-1.bin'}" in shown
    assert f"{disk.path}: 0 files, 0 tokens" in shown
