"""A config of one managed backend, loaded from a file as `kvroute serve` loads it: the
backend, or the error the load refuses it with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from backends.config import ManagedBackendConfig
from proxy.config.fields import ConfigError
from proxy.config.load import load_config


def load(tmp_path: Path, backend: dict[str, Any], **kw: Any) -> ManagedBackendConfig:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"backends": [{"name": "a", **backend}]}))
    b = load_config(path, check_port=False, **kw).managed()[0]
    assert isinstance(b, ManagedBackendConfig)
    return b


def error_of(tmp_path: Path, backend: dict[str, Any], **kw: Any) -> str:
    with pytest.raises(ConfigError) as exc:
        load(tmp_path, backend, **kw)
    return str(exc.value)
