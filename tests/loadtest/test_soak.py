"""The soak's own judgement: which failures it expects, which removals are the tier's by
design, which files went away unexplained, and the faults it makes on a real directory
and a real proxy socket."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
from pathlib import Path

import pytest
from aiohttp import web

from loadtest.client import Result
from loadtest.soak import _routine, classify
from loadtest.soak_faults import RAW, DirWatch, Faults, Injector, read_only, removals


def _r(error: str | None, backend: str = "a", sent: float = 10.0, e2e: float = 2.0
       ) -> Result:
    return Result("r", "s", 0, "main", sent, e2e_s=e2e, error=error, backend=backend)


@pytest.mark.parametrize(("result", "kills", "cause"), [
    (_r("stream error: closed"), [(11.0, "a")], "killed_stream"),
    (_r("stream error: closed"), [(11.0, "b")], "stream error"),  # another backend's kill
    (_r("stream error: closed"), [(20.0, "a")], "stream error"),  # killed after it ended
    (_r("HTTP 502: bad gateway"), [(11.0, "a")], "http_502"),
    (_r("ClientConnectorError: refused"), [], "ClientConnectorError"),
    (_r(""), [], "unknown"),
])
def test_classify(result: Result, kills: list[tuple[float, str]], cause: str) -> None:
    assert classify(result, kills) == cause


@pytest.mark.parametrize(("reason", "routine"), [
    ("replaced by a newer save of its conversation", True),
    ("over the budget (kv_disk.max_gib 0.25)", True),
    ("written by a save given up", True),
    ("truncated: 10 of the 20 bytes the server wrote", False),
    ("restore failed: server went away", False),
])
def test_routine_removals(reason: str, routine: bool) -> None:
    assert _routine(reason) is routine


def test_a_file_gone_is_unexplained_unless_kept_somewhere(tmp_path: Path) -> None:
    watch = DirWatch(tmp_path)
    for name in ("kvroute-1.bin", "kvroute-2.bin", "kvroute-3.bin"):
        (tmp_path / name).write_bytes(b"x")
    watch.poll()
    (tmp_path / "kvroute-quarantine").mkdir()
    (tmp_path / "kvroute-1.bin").rename(tmp_path / "kvroute-quarantine" / "kvroute-1.bin")
    (tmp_path / "kvroute-2.bin").unlink()
    assert watch.gone() == {"kvroute-2.bin"}


def test_removals_reads_the_slot_lines_of_a_log(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    lines = [{"event": "slot.file_removed", "file": "kvroute-2.bin", "reason": "x"},
             {"event": "route", "backend": "a"}]
    log.write_text("\n".join(json.dumps(d) for d in lines) + "\nnot json\n")
    assert removals(log) == lines[:1]


def test_the_directory_is_unwritable_for_a_while_then_as_it_was(tmp_path: Path) -> None:
    if os.geteuid() == 0 and subprocess.run(["chattr", "+i", str(tmp_path)]).returncode:
        pytest.skip("no immutable attribute on this file system (chattr +i failed)")
    subprocess.run(["chattr", "-i", str(tmp_path)], check=False)
    mode = tmp_path.stat().st_mode
    with read_only(tmp_path), pytest.raises(PermissionError):
        (tmp_path / "kvroute-1.bin").write_bytes(b"x")
    (tmp_path / "kvroute-1.bin").write_bytes(b"x")
    assert tmp_path.stat().st_mode == mode


class _Pick(random.Random):
    """Chooses the given item."""

    def __init__(self, item: bytes) -> None:
        super().__init__(0)
        self.item = item

    def choice(self, seq: object) -> bytes:  # type: ignore[override]
        return self.item


@pytest.mark.parametrize("data", RAW)
async def test_bytes_that_are_not_http_are_judged_by_the_answer(tmp_path: Path,
                                                                data: bytes) -> None:
    """What the raw fault makes of an answer that is not the API's JSON: aiohttp's own
    text/plain one, from a server without kvroute's runner."""
    runner = web.AppRunner(web.Application())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    faults = Faults()
    inj = Injector(f"http://127.0.0.1:{port}", tmp_path, None, faults, _Pick(data), 0.0)
    try:
        await asyncio.wait_for(inj.raw(), 20)
    finally:
        await inj.close()
        await runner.cleanup()
    assert faults.malformed == {"4xx_not_json": 1}
