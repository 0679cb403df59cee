"""What a start keeps of a directory of the disk tier (SlotFiles.load), without a server:
the files, written here as llama-server writes them (a sequence-state header, the tokens,
the state), are the users' data. An index that does not parse is rebuilt from the
sidecars; entries whose file is gone are dropped; a file the index does not name is
taken back by its sidecar, or put aside; only a file no server could load is removed,
and every such change is logged with its reason."""

from __future__ import annotations

import dataclasses
import json
import shutil
import struct
import tempfile
from array import array
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from proxy.disk.files import SlotFiles
from proxy.disk.records import INDEX, MAGIC, QUARANTINE, Saved, decode, encode

pytestmark = pytest.mark.timeout(120)

BUDGET = float(1 << 30)


def tokens(i: int, n: int = 50) -> bytes:
    return array("i", range(100 * i, 100 * i + n)).tobytes()


def state_file(toks: bytes, state: int = 300) -> bytes:
    return struct.pack("<III", MAGIC, 3, len(toks) // 4) + toks + bytes(state)


def record(i: int, n: int = 50) -> Saved:
    """What is known of ``kvroute-<i>.bin`` (`state_file(tokens(i, n))`) once a start
    read it (the token count the server answered its save with is not in the file)."""
    return Saved(i, "a", i % 2, tokens(i, n), float(i), "m1",
                 len(state_file(tokens(i, n))), count=n)


def old_directory(path: Path, n: int) -> list[Saved]:
    """``n`` files and the index kvroute wrote before sidecars (and token counts)."""
    out = [record(i) for i in range(1, n + 1)]
    for e in out:
        (path / e.file).write_bytes(state_file(e.tokens))
    (path / INDEX).write_text(json.dumps([
        {k: v for k, v in encode(e).items() if k not in ("n", "count")} for e in out]))
    return out


def load(path: Path, budget: float = BUDGET) -> tuple[dict[int, Saved], list[dict[str, Any]],
                                                        SlotFiles]:
    files = SlotFiles(path, lambda _: None)
    with capture_logs() as logs:
        kept = files.load(budget)
    return kept, logs, files


def bins(path: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in path.glob("kvroute-*.bin")} \
        if path.is_dir() else {}


def events(logs: list[dict[str, Any]], event: str) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == event]


def test_a_directory_without_sidecars_keeps_its_files_and_gets_them(tmp_path: Path) -> None:
    """A directory an earlier kvroute wrote (an index, no sidecars): every file is kept,
    and described beside itself from then on, the server's token count read from its
    header."""
    saved = old_directory(tmp_path, 3)
    before = bins(tmp_path)
    kept, logs, _ = load(tmp_path)
    assert kept == {e.id: e for e in saved}
    assert bins(tmp_path) == before
    for e in saved:
        assert decode(json.loads((tmp_path / e.sidecar).read_text())) == e
    assert not [e for e in logs if e["log_level"] == "warning"]


@pytest.mark.parametrize("fault", ["garbage", "truncated", "not a list", "empty"])
def test_an_index_that_does_not_parse_is_rebuilt_from_the_sidecars(
        tmp_path: Path, fault: str) -> None:
    """``garbage``: the bytes an operator wrote over it; ``truncated``: cut short (a full
    disk before the index was written whole)."""
    saved = old_directory(tmp_path, 5)
    load(tmp_path)  # (the sidecars written)
    before = bins(tmp_path)
    index = tmp_path / INDEX
    index.write_bytes({"garbage": b"\x00\xff\xfegarbage{{{[",
                       "truncated": index.read_bytes()[:len(index.read_bytes()) // 2],
                       "not a list": b'{"1": {}}', "empty": b""}[fault])
    kept, logs, files = load(tmp_path)
    assert kept == {e.id: e for e in saved}
    assert bins(tmp_path) == before
    (rebuilt,) = events(logs, "slot.index_rebuilt")
    assert (rebuilt["kept"], rebuilt["quarantined"], rebuilt["removed"]) == (5, 0, 0)
    assert rebuilt["log_level"] == "warning"
    assert sorted(decode(d).id for d in json.loads(index.read_text())) == [1, 2, 3, 4, 5]
    assert files.highest == 5


def test_files_nothing_describes_are_put_aside_never_deleted(tmp_path: Path) -> None:
    """The operator's case with a directory of an earlier kvroute (no sidecars): an
    unreadable index leaves the files undescribed. They are moved aside whole, each
    logged; a later start leaves them there."""
    old_directory(tmp_path, 3)
    before = bins(tmp_path)
    (tmp_path / INDEX).write_bytes(b"\x00\xff\xfegarbage{{{[")
    kept, logs, files = load(tmp_path)
    assert kept == {} and bins(tmp_path) == {}
    assert bins(tmp_path / QUARANTINE) == before
    aside = events(logs, "slot.file_quarantined")
    assert sorted(e["file"] for e in aside) == sorted(before)
    assert all(e["reason"] == "no index entry, and no sidecar" for e in aside)
    (rebuilt,) = events(logs, "slot.index_rebuilt")
    assert (rebuilt["kept"], rebuilt["quarantined"]) == (0, 3)
    assert files.status()["quarantined"] == 3

    kept, logs, files = load(tmp_path)
    assert kept == {} and bins(tmp_path / QUARANTINE) == before
    assert files.status()["quarantined"] == 3 and files.highest == 3
    assert not events(logs, "slot.file_removed")


def test_entries_whose_file_is_gone_are_dropped_and_logged(tmp_path: Path) -> None:
    saved = old_directory(tmp_path, 4)
    load(tmp_path)
    for e in saved[1:3]:
        (tmp_path / e.file).unlink()
    kept, logs, _ = load(tmp_path)
    assert sorted(kept) == [1, 4]
    dropped = events(logs, "slot.entry_dropped")
    assert [(e["file"], e["reason"]) for e in dropped] == [
        ("kvroute-2.bin", "its file is gone"), ("kvroute-3.bin", "its file is gone")]
    assert sorted(p.name for p in tmp_path.glob("kvroute-*.json")) == [
        "kvroute-1.json", "kvroute-4.json", INDEX]
    assert sorted(decode(d).id for d in json.loads((tmp_path / INDEX).read_text())) == [1, 4]


def test_files_the_index_does_not_name(tmp_path: Path) -> None:
    """A save whose file and sidecar were written but not the index (kvroute stopped
    between the two) is taken back. A file without a sidecar, or with one that does not
    parse, or under a name kvroute does not give, is put aside; the operator's own files
    are not touched."""
    saved = old_directory(tmp_path, 2)
    files = SlotFiles(tmp_path, lambda _: None)
    files.load(BUDGET)
    late = record(3)
    (tmp_path / late.file).write_bytes(state_file(late.tokens))
    assert files.describe(late) is None  # (as a save does, before the index)
    for name in ("kvroute-9.bin", "kvroute-10.bin", "kvroute-index.bin"):
        (tmp_path / name).write_bytes(state_file(tokens(9)))
    (tmp_path / "kvroute-10.json").write_text('{"id": 10, "backend"')
    theirs = {"a.bin": b"kv", "index.json": b"{}"}
    for name, data in theirs.items():
        (tmp_path / name).write_bytes(data)

    kept, logs, files = load(tmp_path)
    assert kept == {e.id: e for e in [*saved, late]}
    assert [e["file"] for e in events(logs, "slot.file_adopted")] == [late.file]
    assert sorted(bins(tmp_path / QUARANTINE)) == [
        "kvroute-10.bin", "kvroute-9.bin", "kvroute-index.bin"]
    assert not (tmp_path / QUARANTINE / INDEX).exists()  # (not the sidecar of a file)
    reasons = {e["file"]: e["reason"] for e in events(logs, "slot.file_quarantined")}
    assert reasons["kvroute-9.bin"] == "no index entry, and no sidecar"
    assert reasons["kvroute-10.bin"].startswith("no index entry, and its sidecar is "
                                                "unreadable")
    assert (tmp_path / QUARANTINE / "kvroute-10.json").is_file()  # (moved with it)
    assert {n: (tmp_path / n).read_bytes() for n in theirs} == theirs
    assert sorted(decode(d).id for d in json.loads((tmp_path / INDEX).read_text())) == [
        1, 2, 3]
    assert files.highest == 10  # (the next save is kvroute-11.bin)


def test_only_a_file_no_server_could_load_is_removed(tmp_path: Path) -> None:
    """Shorter than the server wrote it (a server aborts on one), or no sequence-state
    header: removed, each logged with its reason. Longer than the server wrote it, or
    holding another token count than recorded: whole, but not what its record says, so
    put aside."""
    saved = old_directory(tmp_path, 6)
    load(tmp_path)
    whole = {e.id: state_file(e.tokens) for e in saved}
    (tmp_path / "kvroute-1.bin").write_bytes(whole[1][:100])
    (tmp_path / "kvroute-2.bin").write_bytes(bytes(len(whole[2])))
    (tmp_path / "kvroute-3.bin").write_bytes(whole[3][:8])
    (tmp_path / "kvroute-4.bin").write_bytes(whole[4] + b"more")
    (tmp_path / "kvroute-5.bin").write_bytes(state_file(tokens(5, 49), state=304))
    kept, logs, _ = load(tmp_path)
    assert sorted(kept) == [6]
    removed = {e["file"]: e["reason"] for e in events(logs, "slot.file_removed")}
    assert removed == {
        "kvroute-1.bin": f"truncated: 100 of the {len(whole[1])} bytes the server wrote",
        "kvroute-2.bin": "header: not a llama.cpp sequence state (magic 00000000)",
        "kvroute-3.bin": "header: 8 bytes: shorter than a header"}
    assert all(e["log_level"] == "warning" for e in events(logs, "slot.file_removed"))
    assert sorted(bins(tmp_path / QUARANTINE)) == ["kvroute-4.bin", "kvroute-5.bin"]
    assert not (tmp_path / "kvroute-1.json").exists()


def test_the_budget_at_start_takes_the_quarantine_first(tmp_path: Path) -> None:
    """A budget lowered between two runs: the files put aside go first (oldest first),
    then the oldest saves; each logged."""
    saved = old_directory(tmp_path, 4)
    load(tmp_path)
    for name in ("kvroute-8.bin", "kvroute-9.bin"):
        (tmp_path / name).write_bytes(state_file(tokens(9)))
    load(tmp_path)
    size = saved[0].size
    kept, logs, files = load(tmp_path, budget=2.5 * size)
    assert sorted(kept) == [3, 4]
    assert bins(tmp_path / QUARANTINE) == {}
    assert [(e["file"], e["reason"]) for e in events(logs, "slot.file_removed")] == [
        (f"{QUARANTINE}/kvroute-8.bin", "over the budget"),
        (f"{QUARANTINE}/kvroute-9.bin", "over the budget"),
        ("kvroute-1.bin", "over the budget"), ("kvroute-2.bin", "over the budget")]
    assert (files.status()["removed"], files.status()["quarantined"]) == (4, 0)


def test_the_files_a_start_puts_aside_are_not_removed_by_that_start(
        tmp_path: Path) -> None:
    """Files nothing describes, more than the budget holds: the start that puts them
    aside keeps them (the operator has its warning first), and neither do they cost a
    saved file its place. The next start brings the quarantine within the budget, each
    removal a warning naming the file."""
    saved = old_directory(tmp_path, 2)
    load(tmp_path)
    strays = {f"kvroute-{i}.bin": state_file(tokens(i)) for i in (7, 8, 9)}
    for name, data in strays.items():
        (tmp_path / name).write_bytes(data)
    budget = 2.5 * saved[0].size
    kept, logs, files = load(tmp_path, budget)
    assert sorted(kept) == [1, 2]
    assert bins(tmp_path / QUARANTINE) == strays
    assert not events(logs, "slot.file_removed") and files.status()["quarantined"] == 3

    kept, logs, files = load(tmp_path, budget)
    assert sorted(kept) == [1, 2] and bins(tmp_path / QUARANTINE) == {}
    removed = events(logs, "slot.file_removed")
    assert sorted((e["file"], e["reason"], e["log_level"]) for e in removed) == [
        (f"{QUARANTINE}/{name}", "over the budget", "warning") for name in strays]
    assert all(e["was"] == str(tmp_path / e["file"]) for e in removed)
    assert files.status()["quarantined"] == 0


def test_an_id_the_index_names_is_not_given_again(tmp_path: Path) -> None:
    """A file removed, and the index not rewritten after (a full disk): the next start
    gives no save that file's id, which the index still names."""
    old_directory(tmp_path, 3)
    load(tmp_path)
    (tmp_path / "kvroute-3.bin").unlink()  # (as a removal leaves it: the index not
    (tmp_path / "kvroute-3.json").unlink()  # rewritten after)
    _, _, files = load(tmp_path)
    assert files.highest == 3


@pytest.mark.parametrize("n,kept", [(30, True), (70, True), (-30, False)])
def test_a_save_its_index_entry_is_older_than_is_described_by_its_sidecar(
        tmp_path: Path, n: int, kept: bool) -> None:
    """An id given again by a kvroute that did not count the index's (a new save of
    ``abs(n)`` tokens under an id whose entry, of 50, the index kept): the newer record,
    its sidecar, describes the file. One that does not fit it either (``-30``: shorter
    than its sidecar says) is put aside, not removed: its two records disagree."""
    old_directory(tmp_path, 3)
    load(tmp_path)
    new = dataclasses.replace(record(3, abs(n)), saved_at=10.0)
    data = state_file(new.tokens)
    (tmp_path / new.file).write_bytes(data if n > 0 else data[:-7])
    SlotFiles(tmp_path, lambda _: None).describe(new)
    got, logs, _ = load(tmp_path)
    assert not events(logs, "slot.file_removed")
    if kept:
        assert got[3] == new and bins(tmp_path)[new.file] == data
        assert decode(json.loads((tmp_path / INDEX).read_text())[2]) == new
    else:
        assert sorted(got) == [1, 2] and bins(tmp_path / QUARANTINE) == {new.file: data[:-7]}
        (aside,) = events(logs, "slot.file_quarantined")
        assert aside["reason"].endswith("its index entry and its sidecar disagree")


# ------------------------------------------------------------------ any directory
FILE = st.sampled_from(["whole", "none", "truncated", "zeros", "longer"])
SIDECAR = st.sampled_from(["valid", "none", "garbage", "another id"])
INDEXED = st.sampled_from(["listed", "absent", "malformed"])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(FILE, SIDECAR, INDEXED), min_size=0, max_size=6),
       st.sampled_from(["valid", "garbage", "none"]))
def test_any_directory_is_kept_as_the_rules_say(
        slots: list[tuple[str, str, str]], index_kind: str) -> None:
    """Files whole or damaged, sidecars right, wrong or missing, an index listing them or
    not, itself readable or not: each file ends where a direct reading of the rules puts
    it (kept with its record, put aside whole, or removed), nothing else is touched, and
    a second start changes nothing."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        entries: list[dict[str, Any]] = []
        expected: dict[int, str] = {}
        for i, (file, sidecar, indexed) in enumerate(slots, start=1):
            e = record(i)
            whole = state_file(e.tokens)
            data = {"whole": whole, "truncated": whole[:len(whole) - 7],
                    "zeros": bytes(len(whole)), "longer": whole + b"x", "none": None}[file]
            if data is not None:
                (path / e.file).write_bytes(data)
            if sidecar != "none":
                (path / e.sidecar).write_text(
                    json.dumps(encode(e)) if sidecar == "valid" else
                    json.dumps(encode(record(i + 100))) if sidecar == "another id" else "{")
            if indexed == "listed":
                entries.append(encode(e))
            elif indexed == "malformed":
                entries.append({**encode(e), "size": "big"})
            described = (index_kind == "valid" and indexed == "listed") or sidecar == "valid"
            expected[i] = ("gone" if data is None else "aside" if not described else
                           "removed" if file in ("truncated", "zeros") else
                           "aside" if file == "longer" else "kept")
        if index_kind != "none":
            (path / INDEX).write_text(json.dumps(entries) if index_kind == "valid"
                                      else "[{")
        kept, logs, files = load(path)

        got = {}
        for i in expected:
            name = f"kvroute-{i}.bin"
            got[i] = ("kept" if i in kept else "aside" if (path / QUARANTINE / name).exists()
                      else "removed" if (path / name).exists() is False and any(
                          e["file"] == name for e in events(logs, "slot.file_removed"))
                      else "gone" if not (path / name).exists() else "left")
        assert got == expected
        for i in kept:
            assert kept[i] == record(i)
            assert bins(path)[f"kvroute-{i}.bin"] == state_file(record(i).tokens)
            assert decode(json.loads((path / f"kvroute-{i}.json").read_text())) == record(i)
        assert set(bins(path)) == {f"kvroute-{i}.bin" for i in kept}
        assert files.status()["quarantined"] == sum(v == "aside" for v in expected.values())
        assert files.highest >= max((i for i, v in expected.items() if v != "gone"),
                                    default=0)

        again, logs, _ = load(path)
        assert again == kept
        assert not [e for e in logs if e["log_level"] == "warning"]
        shutil.rmtree(path / QUARANTINE, ignore_errors=True)
