"""Which directory of the disk tier each backend reads (proxy/disk/tier.py
`directories`), and a tier refused at start lets go of every directory it took."""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest

from backends.config import (
    BackendConfig,
    ExternalBackendConfig,
    KvDiskConfig,
    ManagedBackendConfig,
)
from proxy.config.fields import ConfigError
from proxy.disk.store import SlotStore
from proxy.disk.tier import DiskTier, _same, directories
from proxy.instance import DISK_FIX, lock
from proxy.routing.router import Router

OWN, SHARED, OTHER = Path("/kv/own"), Path("/mnt/shared"), Path("/mnt/other")


def ext(name: str, path: Path | None) -> ExternalBackendConfig:
    return ExternalBackendConfig(name=name, url="http://h:1", slot_save_path=path)


def man(name: str) -> ManagedBackendConfig:
    return ManagedBackendConfig(name=name, model=Path("/m.gguf"))


@pytest.mark.parametrize("backends,expected", [
    ([], {OWN: []}),
    ([man("a"), ext("x", None)], {OWN: ["a"]}),  # (an external declaring none: no tier)
    ([ext("x", SHARED), man("a"), ext("y", SHARED)], {OWN: ["a"], SHARED: ["x", "y"]}),
    ([ext("x", SHARED), ext("y", OTHER)], {OWN: [], SHARED: ["x"], OTHER: ["y"]}),
    ([man("a"), ext("x", OWN)], {OWN: ["a", "x"]}),  # kvroute's own: one directory
    ([ext("x", Path("/kv/own/../own"))], {OWN: ["x"]}),
])
def test_each_backend_reads_one_directory(backends: list[BackendConfig],
                                          expected: dict[Path, list[str]]) -> None:
    assert directories(KvDiskConfig(OWN), backends) == expected


def test_a_directory_is_told_by_what_it_is_not_its_path(tmp_path: Path) -> None:
    """A bind mount gives one directory two paths that resolve() keeps apart: the
    directory's device and inode tell it (a missing one: its path)."""
    (tmp_path / "d").mkdir()
    assert _same(tmp_path / "d") == _same(tmp_path / "d" / ".." / "d")
    assert _same(tmp_path / "d") != _same(tmp_path)
    assert _same(tmp_path / "gone") == tmp_path / "gone"



async def test_a_directory_is_one_kvroute_tiers_alone(tmp_path: Path) -> None:
    """Another tier (another kvroute) holds a directory a tier would read: that tier is
    refused, naming the directory, and lets go of the directories it took before it;
    the holder's close frees the directory."""
    own, shared, elsewhere = (tmp_path / n for n in ("own", "shared", "elsewhere"))
    for d in (own, shared, elsewhere):
        d.mkdir()
    async with aiohttp.ClientSession() as session:
        def tier(path: Path) -> DiskTier:
            return DiskTier(KvDiskConfig(path), [ext("x", shared)], session, [Router()],
                            lambda _: None, lambda _: None)

        first = tier(elsewhere)
        with pytest.raises(ConfigError) as refused:
            tier(own)
        assert f"{shared} is in use by another kvroute" in str(refused.value)
        await SlotStore(KvDiskConfig(own), session, Router(), lambda _: None).close()
        await first.close()
        await tier(own).close()


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def without_dac(call: Callable[[], object]) -> BaseException | None:
    """Run ``call`` in a thread of its own that the directory permissions bind as they
    bind any user (root's CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH dropped: capabilities
    are a thread's, and go with it); what it raised."""
    libc = ctypes.CDLL(None, use_errno=True)
    raised: list[BaseException] = []

    def run() -> None:
        head, data = _CapHeader(0x20080522, 0), (_CapData * 2)()  # _LINUX_CAPABILITY_VERSION_3
        assert libc.capget(ctypes.byref(head), data) == 0, ctypes.get_errno()
        data[0].effective &= ~(1 << 1 | 1 << 2)
        assert libc.capset(ctypes.byref(head), data) == 0, ctypes.get_errno()
        try:
            call()
        except BaseException as err:  # (handed to the test)
            raised.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return raised[0] if raised else None


async def test_a_directory_that_cannot_be_read_is_refused_and_nothing_kept_locked(
        tmp_path: Path) -> None:
    """A slot_save_path kvroute may write but not list: refused at start, naming the
    directory and the fix, and every directory the tier took before it, and that one,
    let go."""
    own, shared = tmp_path / "own", tmp_path / "shared"
    own.mkdir()
    shared.mkdir(mode=0o300)
    async with aiohttp.ClientSession() as session:
        got = without_dac(lambda: DiskTier(KvDiskConfig(own), [ext("x", shared)], session,
                                           [Router()], lambda _: None, lambda _: None))
    assert isinstance(got, ConfigError), got
    assert str(got) == (f"disk tier: cannot read {shared}: Permission denied (fix: give "
                        f"the user kvroute runs as read access to {shared})")
    for d in (own, shared):
        os.close(lock(d, "disk tier", DISK_FIX))
