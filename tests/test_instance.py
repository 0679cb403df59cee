"""The locks that keep a second kvroute off a running one's directories. flock locks of
two open files conflict within one process as between two, so a second Instance here
stands for a second kvroute (tests/test_cli.py runs two real ones)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from proxy.config.fields import ConfigError
from proxy.instance import DISK_FIX, Instance, InUse, adopt, lock


def test_a_second_instance_on_the_log_dir_is_refused_naming_the_holder(
        tmp_path: Path) -> None:
    first = Instance(tmp_path / "logs", ())
    try:
        with pytest.raises(InUse) as err:
            Instance(tmp_path / "logs", (), own_disk=tmp_path / "slots")
        assert f"log_dir: {tmp_path / 'logs'} is in use by another kvroute, pid " \
            f"{os.getpid()}" in str(err.value)
        assert "fix: one kvroute per log_dir" in str(err.value)
        assert not (tmp_path / "slots").exists()  # (refused before it made anything)
    finally:
        first.release()
    Instance(tmp_path / "logs", ()).release()  # free again


def test_a_disk_directory_held_elsewhere_is_refused_and_nothing_stays_locked(
        tmp_path: Path) -> None:
    d1, d2 = tmp_path / "d1", tmp_path / "d2"
    d1.mkdir()
    d2.mkdir()
    holder = Instance(tmp_path / "l1", (d2,))
    try:
        with pytest.raises(InUse, match=f"disk tier: {d2} is in use by another kvroute"):
            Instance(tmp_path / "l2", (d1, d2))
        # what the refused one had taken (its log_dir, d1) is free
        Instance(tmp_path / "l2", (d1,)).release()
        assert adopt(d1) is None
    finally:
        holder.release()


def test_one_directory_in_two_roles_is_locked_once(tmp_path: Path) -> None:
    both = tmp_path / "state"
    inst = Instance(both, (both,), own_disk=both)
    try:
        fd = adopt(both)
        assert fd is not None
        os.close(fd)
    finally:
        inst.release()


def test_an_adopted_lock_outlives_the_store_until_the_instance_lets_go(
        tmp_path: Path) -> None:
    slots = tmp_path / "slots"
    inst = Instance(tmp_path / "logs", (slots,), own_disk=slots)
    assert (slots.stat().st_mode & 0o777) == 0o700
    fd = adopt(slots)
    assert fd is not None
    os.close(fd)  # (the store closes its descriptor when the app stops)
    with pytest.raises(InUse):
        lock(slots, "disk tier", DISK_FIX)
    inst.release()
    assert adopt(slots) is None
    os.close(lock(slots, "disk tier", DISK_FIX))


def test_a_directory_that_cannot_hold_a_lock_file_says_so(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"disk tier: cannot create .*kvroute\.lock"):
        Instance(tmp_path / "logs", (tmp_path / "file",))
    Instance(tmp_path / "logs", ()).release()
