"""Newer Vulkan headers from the Debian archive, where the system's are too old for the
pinned ggml-vulkan (a real download: the archive is one of the registries reached)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from backends.gpu import vulkan_headers_problem
from backends.vulkan_sdk import NoSdk, _loader, debian_sdk, sdk_dir


def test_the_sdk_made_has_headers_the_tree_compiles_with(tmp_path: Path) -> None:
    if shutil.which("apt-get") is None:
        pytest.skip("no apt-get: not a Debian-like machine")
    if _loader() is None:
        with pytest.raises(NoSdk, match="apt install libvulkan1"):
            debian_sdk(tmp_path)
        return
    sdk = debian_sdk(tmp_path)
    assert sdk == sdk_dir(tmp_path)
    assert vulkan_headers_problem({"VULKAN_SDK": str(sdk)}) is None
    assert (sdk / "include" / "vulkan" / "vulkan.hpp").is_file()
    assert (sdk / "lib" / "libvulkan.so").resolve().is_file()
    assert debian_sdk(tmp_path) == sdk  # (fetched once)
