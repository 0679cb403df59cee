"""Vulkan headers new enough for the pinned ggml-vulkan, where the system's are not.

Debian 12's libvulkan-dev (headers 1.3.239) lacks VK_EXT_layer_settings, which the pinned
ggml-vulkan.cpp uses; Debian 13's (1.4.309) has it. Its package is fetched from the
Debian archive (`apt-get download` with a sources list of its own: nothing is installed,
the system's packages are untouched), unpacked into the cache, and laid out as a
VULKAN_SDK for CMake's FindVulkan: its headers, and the system's own loader
(libvulkan.so.1) to link against. Newer headers over an older loader are enough: ggml
finds every Vulkan function through vkGetInstanceProcAddr (its vulkan.hpp dispatcher is
dynamic), and the driver, not the loader, implements them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SUITE = "trixie"
MIRROR = "http://deb.debian.org/debian"
PACKAGE = "libvulkan-dev"
LOADERS = ("/usr/lib/x86_64-linux-gnu/libvulkan.so.1", "/usr/lib/aarch64-linux-gnu/libvulkan.so.1",
           "/usr/lib64/libvulkan.so.1", "/usr/lib/libvulkan.so.1")
TIMEOUT_S = 300.0


class NoSdk(RuntimeError):
    """The headers could not be had: the message says why and what to do."""


def sdk_dir(cache: Path) -> Path:
    return cache / f"vulkan-sdk-{SUITE}"


def _loader() -> str | None:
    return next((p for p in LOADERS if Path(p).exists()), None)


def debian_sdk(cache: Path) -> Path:
    """A VULKAN_SDK directory with Debian ``SUITE``'s Vulkan headers (fetched once)."""
    sdk = sdk_dir(cache)
    if (sdk / "include" / "vulkan" / "vulkan_core.h").is_file():
        return sdk
    loader = _loader()
    if loader is None:
        raise NoSdk("the Vulkan loader libvulkan.so.1 is not installed (fix: apt install "
                    "libvulkan1 mesa-vulkan-drivers glslc)")
    if not (shutil.which("apt-get") and shutil.which("dpkg-deb")):
        raise NoSdk("no apt-get to fetch newer Vulkan headers with (fix: install the "
                    "Vulkan SDK, https://vulkan.lunarg.com/sdk/home, and set VULKAN_SDK)")
    with tempfile.TemporaryDirectory(prefix="kvroute-vulkan-") as tmp:
        root = _fetch(Path(tmp))
        fresh = sdk.with_name(sdk.name + ".new")
        shutil.rmtree(fresh, ignore_errors=True)
        (fresh / "lib").mkdir(parents=True)
        shutil.copytree(root / "usr" / "include", fresh / "include")
        (fresh / "lib" / "libvulkan.so").symlink_to(loader)
        shutil.rmtree(sdk, ignore_errors=True)
        os.replace(fresh, sdk)
    return sdk


def _fetch(tmp: Path) -> Path:
    """The package unpacked under ``tmp``; its root."""
    (tmp / "lists" / "partial").mkdir(parents=True)
    (tmp / "sources.list").write_text(f"deb {MIRROR} {SUITE} main\n")
    opts = ["-o", f"Dir::Etc::sourcelist={tmp / 'sources.list'}",
            "-o", "Dir::Etc::sourceparts=-", "-o", f"Dir::State::Lists={tmp / 'lists'}",
            "-o", f"Dir::Cache::archives={tmp}", "-o", "APT::Sandbox::User=root", "-qq"]
    for cmd in (["apt-get", *opts, "update"], ["apt-get", *opts, "download", f"{PACKAGE}/{SUITE}"]):
        r = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=TIMEOUT_S,
                           check=False)
        if r.returncode != 0:
            raise NoSdk(f"{' '.join(cmd[:1] + cmd[-2:])} failed: {r.stderr.strip()[-300:]} "
                        f"(fix: reach {MIRROR}, or install the Vulkan SDK and set VULKAN_SDK)")
    deb = next(tmp.glob(f"{PACKAGE}_*.deb"))
    subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp / "root")], check=True,
                   timeout=TIMEOUT_S)
    return tmp / "root"
