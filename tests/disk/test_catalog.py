"""A directory's saved slots as its store and the routers know them (proxy/disk/catalog.py
`Catalog`), without a server: which save of a slot is the latest, which files each router
offers to which backends, what a drop and the budget remove, and the ids new saves get.
The routers here record what they are told."""

from __future__ import annotations

import json
import struct
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from proxy.config.disk import MAX_DIRECTORIES
from proxy.disk.catalog import Catalog
from proxy.disk.files import SlotFiles
from proxy.disk.records import INDEX, MAGIC, QUARANTINE, Saved, encode

pytestmark = pytest.mark.timeout(30)


def tokens(i: int) -> bytes:
    return array("i", range(100 * i, 100 * i + 50)).tobytes()


def whole(i: int) -> bytes:
    return struct.pack("<III", MAGIC, 3, 50) + tokens(i) + bytes(300)


# id: (backend, slot, model, saved_at)
ENTRIES = {1: ("a", 0, "m1", 10.0), 2: ("a", 0, "m1", 20.0), 3: ("a", 1, "m1", 5.0),
           4: ("a", 0, "m2", 30.0), 5: ("b", 0, "m2", 1.0)}


def record(i: int) -> Saved:
    backend, slot, model, at = ENTRIES[i]
    return Saved(i, backend, slot, tokens(i), at, model, len(whole(i)), count=50)


def directory(path: Path, ids: list[int]) -> None:
    """Files ``ids`` of ENTRIES, described and indexed."""
    for i in ids:
        (path / f"kvroute-{i}.bin").write_bytes(whole(i))
        (path / f"kvroute-{i}.json").write_text(json.dumps(encode(record(i))))
    (path / INDEX).write_text(json.dumps([encode(record(i)) for i in ids]))


class Disk:
    """What a router's DiskIndex is told: entry -> (file, backends)."""

    def __init__(self) -> None:
        self.entries: dict[int, tuple[str, frozenset[str]]] = {}

    def add(self, entry: int, file: str, _sequence: bytes, backends: frozenset[str]) -> None:
        self.entries[entry] = (file, backends)

    def drop(self, entry: int) -> None:
        self.entries.pop(entry, None)


class Routed:
    def __init__(self) -> None:
        self.disk = Disk()


Open = Callable[..., tuple[Catalog, list[Routed]]]


@pytest.fixture
def open_catalog(tmp_path: Path) -> Iterator[Open]:
    """A catalog of ``tmp_path`` (its ENTRIES ``ids`` written first) for ``routers``
    recording routers, backend i's router the one ``router_of`` names."""
    opened: list[SlotFiles] = []

    def make(ids: list[int], routers: int = 1, router_of: dict[str, int] | None = None,
             max_gib: float = 1.0, number: int = 0) -> tuple[Catalog, list[Routed]]:
        directory(tmp_path, ids)
        files = SlotFiles(tmp_path, lambda _: None)
        opened.append(files)
        rs = [Routed() for _ in range(routers)]
        of = None if router_of is None else (
            lambda name: rs[router_of[name]] if name in router_of else None)
        catalog = Catalog(files, max_gib, rs, of, number)  # type: ignore[arg-type]
        return catalog, rs

    yield make
    for files in opened:
        files.release()


@pytest.mark.parametrize(("backend", "slot", "model", "latest", "has", "foreign"), [
    ("a", 0, "m1", 2, True, 1),  # (entry 4: slot 0 of a, by m2)
    ("a", 1, "m1", 3, True, 1),
    ("a", 0, "m2", 4, True, 3),
    ("a", 1, "m2", None, True, 3),
    ("b", 0, "m1", None, False, 1),
    ("c", 0, "m1", None, False, 0),
])
def test_the_latest_save_of_a_slot_and_a_backends_saves_by_model(
        open_catalog: Open, backend: str, slot: int, model: str, latest: int | None,
        has: bool, foreign: int) -> None:
    catalog, _ = open_catalog(list(ENTRIES))
    got = catalog.latest(backend, slot, model)
    assert (got.id if got else None) == latest
    assert catalog.has(backend, model) is has
    assert catalog.foreign(backend, model) == foreign
    assert catalog.named("kvroute-3.bin") == record(3) and catalog.named("x.bin") is None


def key(entry: int) -> int:
    return entry * MAX_DIRECTORIES + 3  # (the catalog's number: 3)


@pytest.mark.parametrize(("models", "offered"), [
    ({}, [{}, {}]),
    ({"a": "m1"}, [{key(1): {"a"}}, {}]),
    ({"a": "m1", "b": "m1", "c": "m2"}, [{key(1): {"a"}}, {key(1): {"b"}, key(5): {"c"}}]),
    ({"a": "m3", "d": "m1"}, [{}, {}]),  # (d: a backend of no router)
])
def test_each_router_offers_a_file_to_its_backends_of_the_files_model(
        open_catalog: Open, models: dict[str, str],
        offered: list[dict[int, set[str]]]) -> None:
    """ENTRIES 1 (by m1) and 5 (by m2); backend a is router 0's, b and c router 1's. A
    file is offered to the backends that run its model, wherever it was saved from."""
    catalog, routers = open_catalog([1, 5], routers=2,
                                    router_of={"a": 0, "b": 1, "c": 1}, number=3)
    catalog.offer({"a": "m2", "b": "m2"})  # (what they ran before: offered, then not)
    catalog.offer(models)
    assert [{k: set(b) for k, (_, b) in r.disk.entries.items()} for r in routers] == offered


def test_a_drop_forgets_the_entry_and_removes_or_quarantines_its_file(
        open_catalog: Open, tmp_path: Path) -> None:
    catalog, (router,) = open_catalog([1, 2, 3])
    catalog.offer({"a": "m1"})
    with capture_logs() as logs:
        catalog.drop(1, "replaced")
        catalog.drop(2, "restore failed: refused", lost=True)
        catalog.drop(3, "not what its record says", lost=True, aside=True)
        catalog.drop(9, "not there")  # (dropped already: nothing)
    assert catalog.saved == {} and router.disk.entries == {}
    assert sorted(f.name for f in tmp_path.glob("kvroute-*.*")) == [INDEX]
    assert sorted(f.name for f in (tmp_path / QUARANTINE).iterdir()) == [
        "kvroute-3.bin", "kvroute-3.json"]
    assert [(e["event"], e["log_level"], e["reason"]) for e in logs] == [
        ("slot.file_removed", "info", "replaced"),
        ("slot.file_removed", "warning", "restore failed: refused"),
        ("slot.file_quarantined", "warning", "not what its record says")]


def test_a_new_save_ages_the_oldest_out_of_the_budget(open_catalog: Open,
                                                      tmp_path: Path) -> None:
    """Room for two files: a third, new, takes the place of the oldest; its id is past
    every id the directory named (the quarantine's too)."""
    (tmp_path / QUARANTINE).mkdir()
    (tmp_path / QUARANTINE / "kvroute-8.json").write_text("{}")
    catalog, (router,) = open_catalog([1, 2], max_gib=2.5 * len(whole(1)) / (1 << 30))
    new = catalog.new_id()
    assert (new, catalog.new_id()) == (9, 10)
    (tmp_path / f"kvroute-{new}.bin").write_bytes(whole(1))
    entry = Saved(new, "a", 1, tokens(9), 99.0, "m1", len(whole(1)), count=50)
    catalog.add(entry, {"a": "m1"})
    assert sorted(catalog.saved) == [2, new]
    assert set(router.disk.entries) == {new * MAX_DIRECTORIES}
    assert not (tmp_path / "kvroute-1.bin").exists()
