"""What a start does to a directory (proxy/disk/start.py `Start`), call by call, through
the interface it is given (`Directory`: here a SlotFiles whose calls are recorded), and
the highest id it finds, without a server. What each change leaves on disk is
test_slot_recovery.py's."""

from __future__ import annotations

import json
import struct
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from proxy.disk.files import SlotFiles
from proxy.disk.records import INDEX, MAGIC, QUARANTINE, Saved, encode
from proxy.disk.start import Start

pytestmark = pytest.mark.timeout(30)

BUDGET = float(1 << 30)


def whole(i: int) -> bytes:
    toks = array("i", range(100 * i, 100 * i + 50)).tobytes()
    return struct.pack("<III", MAGIC, 3, 50) + toks + bytes(300)


def record(i: int) -> Saved:
    return Saved(i, "a", 0, array("i", range(100 * i, 100 * i + 50)).tobytes(), float(i),
                 "m1", len(whole(i)), count=50)


def described(path: Path, i: int) -> None:
    """``kvroute-<i>.bin`` whole, and its sidecar."""
    (path / f"kvroute-{i}.bin").write_bytes(whole(i))
    (path / f"kvroute-{i}.json").write_text(json.dumps(encode(record(i))))


def indexed(path: Path, *ids: int) -> None:
    (path / INDEX).write_text(json.dumps([encode(record(i)) for i in ids]))


def old(path: Path, i: int) -> None:
    """``kvroute-<i>.bin`` as a kvroute before sidecars left it: in the index alone."""
    (path / f"kvroute-{i}.bin").write_bytes(whole(i))
    (path / INDEX).write_text(json.dumps([
        {k: v for k, v in encode(record(i)).items() if k not in ("n", "count")}]))


def aside(path: Path, name: str) -> None:
    (path / QUARANTINE).mkdir(exist_ok=True)
    (path / QUARANTINE / name).write_bytes(b"x")


def _short(arg: object) -> object:
    if isinstance(arg, Saved):
        return arg.id
    if isinstance(arg, list):
        return sorted(e.id for e in arg)
    return arg


def recorded(files: SlotFiles) -> list[tuple[str, object]]:
    """The calls a start makes of ``files`` (each with its first argument, an entry by
    its id), as they are made; not those ``files`` makes of itself meanwhile."""
    calls: list[tuple[str, object]] = []
    inside: list[str] = []

    def wrap(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if not inside:
                calls.append((name, _short(args[0])))
            inside.append(name)
            try:
                return real(*args, **kwargs)
            finally:
                inside.pop()
        return call

    for owner, name in ((files, "remove"), (files, "describe"), (files, "unlink"),
                        (files.aside, "put"), (files.index, "write_now")):
        setattr(owner, name, wrap(name, getattr(owner, name)))
    return calls


LAYOUTS: dict[str, tuple[Callable[[Path], None], float, list[tuple[str, object]], int]] = {
    # name: (the directory, the budget, the calls, the highest id)
    "empty": (lambda p: None, BUDGET, [], 0),
    "an entry whose file is gone": (lambda p: indexed(p, 3), BUDGET, [("write_now", [])], 3),
    "a file nothing describes": (
        lambda p: (p / "kvroute-7.bin").write_bytes(whole(7)), BUDGET,
        [("put", "kvroute-7.bin")], 7),
    "a file no server loads": (
        lambda p: (described(p, 2), (p / "kvroute-2.bin").write_bytes(b"gg")), BUDGET,
        [("remove", "kvroute-2.bin"), ("unlink", "kvroute-2.json")], 2),  # (gone already)
    "a file its sidecar describes, no index": (
        lambda p: described(p, 4), BUDGET, [("write_now", [4])], 4),
    "an indexed file without its sidecar": (
        lambda p: old(p, 1), BUDGET, [("describe", 1), ("write_now", [1])], 1),
    "a temporary file left by a stop": (
        lambda p: (p / "kvroute-5.bin.tmp").write_bytes(b"x"), BUDGET,
        [("unlink", "kvroute-5.bin.tmp")], 5),
    "a sidecar whose file is gone": (
        lambda p: (p / "kvroute-6.json").write_text("{}"), BUDGET,
        [("unlink", "kvroute-6.json")], 6),
    "over the budget": (
        lambda p: (described(p, 1), described(p, 2), indexed(p, 1, 2)),
        len(whole(2)) + 10, [("remove", "kvroute-1.bin"), ("write_now", [2])], 2),
    "ids in the quarantine": (lambda p: aside(p, "kvroute-9.bin.1"), BUDGET, [], 9),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_start_carries_out_its_plan_through_the_directory(tmp_path: Path,
                                                            layout: str) -> None:
    make, budget, calls, highest = LAYOUTS[layout]
    make(tmp_path)
    files = SlotFiles(tmp_path, lambda _: None)
    made = recorded(files)
    start = Start(files)
    with capture_logs():
        start.load(budget)
    assert made == calls
    assert start.highest == highest


def test_a_start_counts_the_quarantine_as_it_finds_it(tmp_path: Path) -> None:
    aside(tmp_path, "kvroute-1.bin")
    aside(tmp_path, "kvroute-1.json")
    (tmp_path / "kvroute-2.bin").write_bytes(whole(2))  # (put aside by this start)
    files = SlotFiles(tmp_path, lambda _: None)
    with capture_logs():
        Start(files).load(BUDGET)
    assert files.aside.count == 2
