"""Process helpers shared by the tests that start and kill real processes."""

from __future__ import annotations

import urllib.error
import urllib.request


def gone(pid: int) -> bool:
    """True when no process (zombies count as gone) has this pid."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def healthy(url: str) -> bool:
    """Does a llama-server at ``url`` answer /health with 200?"""
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False
