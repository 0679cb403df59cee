"""Process helpers shared by the tests that start and kill real processes."""

from __future__ import annotations


def gone(pid: int) -> bool:
    """True when no process (zombies count as gone) has this pid."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
