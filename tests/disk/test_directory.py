"""The parts of a directory of the disk tier that its files and its start share
(proxy/disk/directory.py), each on its own, without a server: the account of the run
(`Tally`), what keeps a file from being written (`diagnose`), the quarantine and the
index."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from proxy.disk.directory import Index, Quarantine, Tally, diagnose
from proxy.disk.records import INDEX, QUARANTINE, Saved, read_index

pytestmark = pytest.mark.timeout(30)


def entry(i: int) -> Saved:
    return Saved(i, "a", 0, bytes(4 * i), float(i), "m1", size=100, n=i, count=i)


@pytest.mark.parametrize(("failures", "counts"), [
    ([], {}),
    (["save"], {"save_failed": 1}),
    (["restore", "restore", "remove"], {"restore_failed": 2, "remove_failed": 1}),
    (["index"], {"index_failed": 1}),
    (["spill"], {}),  # (a failure the status does not count: the last one all the same)
])
def test_a_tally_counts_each_failure_and_keeps_the_last(tmp_path: Path, failures: list[str],
                                                        counts: dict[str, int]) -> None:
    tally = Tally(tmp_path)
    tally.count("saved")
    with capture_logs() as logs:
        for what in failures:
            tally.failed(what, f"{what} went wrong", "the fix", file="f")
    assert tally.counts == {"saved": 1, "save_failed": 0, "restore_failed": 0, "removed": 0,
                            "remove_failed": 0, "index_failed": 0} | counts
    assert [e["event"] for e in logs] == [f"slot.{w}_failed" for w in failures]
    assert all(e["log_level"] == "warning" and e["path"] == str(tmp_path) for e in logs)
    last = tally.last_failure
    if failures:
        assert last is not None
        assert (last["what"], last["reason"], last["fix"], last["file"]) == (
            failures[-1], f"{failures[-1]} went wrong", "the fix", "f")
    else:
        assert last is None


@pytest.mark.parametrize(("setup", "file", "need", "reason"), [
    ("fine", "kvroute-1.bin", 0, None),
    ("missing", "kvroute-1.bin", 0, "directory missing"),
    ("in the way", "kvroute-1.bin", 0, "not a file in the way"),
    ("fine", "kvroute-1.bin", 1 << 62, "disk full"),
    ("read-only", "kvroute-1.bin", 0, "directory not writable"),
])
def test_diagnose_names_what_keeps_a_file_from_being_written(
        tmp_path: Path, setup: str, file: str, need: int, reason: str | None) -> None:
    path = tmp_path / "dir"
    if setup != "missing":
        path.mkdir()
    if setup == "in the way":
        (path / file).mkdir()
    if setup == "read-only":
        if os.geteuid() == 0:
            pytest.skip("root writes to a read-only directory")
        path.chmod(0o500)
    got = diagnose(path, file, need)
    if reason is None:
        assert got is None
    else:
        assert got is not None and got[0].startswith(reason) and got[1]


def test_the_quarantine_moves_a_file_and_its_sidecar_aside_and_counts_them(
        tmp_path: Path) -> None:
    """A file put aside keeps its name (a suffix when one of that name is there already),
    its sidecar goes with it; `count` follows the slot files in, out, and as they are
    found."""
    tally = Tally(tmp_path)
    aside = Quarantine(tmp_path, tally)
    for name in ("kvroute-1.bin", "kvroute-1.json", "kvroute-2.bin", "theirs.bin"):
        (tmp_path / name).write_bytes(b"x" * 10)
    with capture_logs() as logs:
        assert aside.put("kvroute-1.bin", "not what its record says") == [
            "kvroute-1.bin", "kvroute-1.json"]
        (tmp_path / "kvroute-1.bin").write_bytes(b"y")  # (a later file of that name)
        assert aside.put("kvroute-1.bin", "again") == ["kvroute-1.bin.1"]
        assert aside.put("theirs.bin", "nothing describes it") == ["theirs.bin"]
    assert [e["reason"] for e in logs if e["event"] == "slot.file_quarantined"] == [
        "not what its record says", "again", "nothing describes it"]
    assert aside.count == 3
    assert sorted(p.name for p, _, _ in aside.files()) == [
        "kvroute-1.bin", "kvroute-1.bin.1", "kvroute-1.json", "theirs.bin"]
    assert (tmp_path / "kvroute-2.bin").is_file()

    assert aside.remove(tmp_path / QUARANTINE / "kvroute-1.bin.1", "over the budget")
    assert aside.remove(tmp_path / QUARANTINE / "kvroute-1.json", "over the budget")
    assert aside.count == 2 and tally.counts["removed"] == 2
    (tmp_path / QUARANTINE / "theirs.bin").unlink()  # (the operator)
    aside.recount()
    assert aside.count == 1


def test_a_file_that_cannot_be_put_aside_is_a_failed_removal(tmp_path: Path) -> None:
    (tmp_path / QUARANTINE).write_text("a file where the quarantine goes")
    (tmp_path / "kvroute-1.bin").write_bytes(b"x")
    tally = Tally(tmp_path)
    aside = Quarantine(tmp_path, tally)
    assert aside.put("kvroute-1.bin", "why") == []
    assert aside.count == 0 and tally.counts["remove_failed"] == 1
    assert tally.last_failure is not None and tally.last_failure["file"] == "kvroute-1.bin"
    assert (tmp_path / "kvroute-1.bin").is_file()


async def test_the_index_is_written_whole_in_the_order_asked(tmp_path: Path) -> None:
    """Commits asked one after the other land in that order, each whole; `settle` returns
    once none is under way."""
    told: list[str] = []
    index = Index(tmp_path, Tally(tmp_path), told.append)
    saved = {i: entry(i) for i in (1, 2, 3)}
    first = asyncio.create_task(index.commit({1: saved[1]}))
    second = asyncio.create_task(index.commit(saved))
    await index.settle()
    await asyncio.gather(first, second)
    assert read_index(tmp_path / INDEX) == (saved, None)
    index.write_now([saved[2]])
    assert read_index(tmp_path / INDEX) == ({2: saved[2]}, None)
    assert told == []


@pytest.mark.parametrize("when", ["now", "committed"])
async def test_an_index_that_cannot_be_written_is_told(tmp_path: Path, when: str) -> None:
    """The directory is gone: counted `index_failed`, a warning with the fix, the status's
    last failure; nothing raised (the files serve the run all the same)."""
    told: list[str] = []
    gone = tmp_path / "gone"
    tally = Tally(gone)
    index = Index(gone, tally, told.append)
    with capture_logs() as logs:
        if when == "now":
            index.write_now([entry(1)])
        else:
            await index.commit({1: entry(1)})
            await index.settle()
    assert told == ["index_failed"] and tally.counts["index_failed"] == 1
    (warning,) = [e for e in logs if e["event"] == "slot.index_failed"]
    assert "directory missing" not in warning["reason"] and warning["fix"].startswith("create")
    assert tally.last_failure is not None and tally.last_failure["what"] == "index"
