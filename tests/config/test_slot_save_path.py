"""An external backend's `slot_save_path` (the directory its --slot-save-path names, as
kvroute sees it): taken when kvroute can use it, else refused at load, naming the fix."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from backends.config import ExternalBackendConfig
from proxy.config.disk import MAX_DIRECTORIES
from proxy.config.fields import ConfigError
from proxy.config.load import load_config

DISK = {"path": "own"}


def load(tmp_path: Path, backend: dict[str, Any], **top: Any) -> Any:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"backends": [
        {"name": "plain", "url": "http://127.0.0.1:9"},
        {"name": "x", "url": "http://127.0.0.1:10", **backend}], **top}))
    return load_config(path, check_port=False)


def test_a_declared_directory_is_taken_relative_to_the_config(tmp_path: Path) -> None:
    (tmp_path / "shared").mkdir()
    cfg = load(tmp_path, {"slot_save_path": "shared"}, kv_disk=DISK)
    plain, x = cfg.backends
    assert isinstance(x, ExternalBackendConfig) and x.slot_save_path == tmp_path / "shared"
    assert isinstance(plain, ExternalBackendConfig) and plain.slot_save_path is None


@pytest.mark.parametrize("backend,top,expected", [
    ({"slot_save_path": "missing"}, {"kv_disk": DISK},
     "backends[1].slot_save_path: no such directory: {tmp}/missing (fix: the directory "
     "the server's --slot-save-path names"),
    ({"slot_save_path": "a-file"}, {"kv_disk": DISK},
     "backends[1].slot_save_path: not a directory: {tmp}/a-file"),
    ({"slot_save_path": ""}, {"kv_disk": DISK},
     "backends[1].slot_save_path: expected a non-empty string"),
    ({"slot_save_path": "shared"}, {},
     "backends[1].slot_save_path: needs the disk tier on (fix: add kv_disk:"),
    ({"slot_save_path": "shared", "kind": "openai"}, {"kv_disk": DISK},
     "backends[1].slot_save_path: only a llama-server saves slots, this backend is kind: "
     "openai (fix: remove slot_save_path)"),
    ({"slot_save_path": "shared"}, {"kv_disk": DISK, "replicas": {"nats": "nats://h:4222"}},
     "backends[1].slot_save_path: not with replicas"),
])
def test_what_a_declared_directory_needs(tmp_path: Path, backend: dict[str, Any],
                                         top: dict[str, Any], expected: str) -> None:
    (tmp_path / "shared").mkdir()
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ConfigError) as exc:
        load(tmp_path, backend, **top)
    assert expected.format(tmp=tmp_path) in str(exc.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to any directory")
def test_a_directory_kvroute_cannot_write_to_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o500)
    with pytest.raises(ConfigError, match="kvroute cannot read and write in"):
        load(tmp_path, {"slot_save_path": "shared"}, kv_disk=DISK)


def test_directories_past_what_the_tier_numbers_are_refused(tmp_path: Path) -> None:
    """kv_disk.path and every declared directory get a number below MAX_DIRECTORIES."""
    def config(n: int) -> Path:
        backends = []
        for i in range(n):
            (tmp_path / f"d{i}").mkdir(exist_ok=True)
            backends.append({"name": f"x{i}", "url": f"http://127.0.0.1:{10 + i}",
                             "slot_save_path": f"d{i}"})
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump({"backends": backends, "kv_disk": DISK}))
        return path

    assert len(load_config(config(MAX_DIRECTORIES - 1), check_port=False).backends) \
        == MAX_DIRECTORIES - 1
    with pytest.raises(ConfigError, match=f"at most {MAX_DIRECTORIES - 1}"):
        load_config(config(MAX_DIRECTORIES), check_port=False)
