"""Fixes to the vendored llama.cpp tree, applied before llama-server is configured.

Each backends/patches/*.patch is a git-style diff relative to vendor/llama.cpp whose
leading text says what it fixes and why it is not upstream. A patch is applied once: a
tree where it reverses cleanly holds it already. The set's digest marks the tree (a tree
of another set, a patch since changed or dropped, is extracted anew) and is part of the
build's recipe, so a binary built before a patch changed is rebuilt.
"""

from __future__ import annotations

import hashlib
import subprocess
from collections.abc import Callable
from pathlib import Path

PATCH_DIR = Path(__file__).with_name("patches")
MARKER = ".kvroute-patches"  # in the tree: the digest of the set it holds


class PatchError(RuntimeError):
    """A patch applies neither forwards nor backwards: the tree is not the pinned one."""


def patches() -> list[Path]:
    return sorted(PATCH_DIR.glob("*.patch"))


def digest() -> str:
    """What the patch set is, for the configure stamp."""
    h = hashlib.sha256()
    for p in patches():
        text = p.read_bytes()
        # the diff only: rewording a patch's explanation rebuilds nothing
        h.update(p.name.encode() + b"\0" + text[text.find(b"\n--- ") + 1:])
    return h.hexdigest()[:16]


def _git_apply(tree: Path, patch: Path, *flags: str) -> bool:
    # git apply works outside a repository (as patch(1) does) and checks the whole
    # patch before it changes a file
    cmd = ["git", "apply", *flags, str(patch)]
    try:
        return subprocess.run(cmd, cwd=tree, capture_output=True, check=False).returncode == 0
    except OSError as e:
        raise PatchError(f"git, which applies kvroute's fixes to llama.cpp, cannot run: {e} "
                         "(fix: install git)") from e


def is_applied(tree: Path, patch: Path) -> bool:
    return _git_apply(tree, patch, "--reverse", "--check")


def applied(tree: Path) -> str | None:
    """The digest of the patch set ``tree`` was patched with (None: never patched)."""
    marker = tree / MARKER
    return marker.read_text().strip() if marker.is_file() else None


def apply_all(tree: Path, progress: Callable[[str], None]) -> None:
    """Apply every patch not yet in ``tree`` (vendor/llama.cpp), and mark it with the set's
    digest: a tree patched with another set is extracted anew (binary.py)."""
    for patch in patches():
        if is_applied(tree, patch):
            continue
        if not _git_apply(tree, patch):
            raise PatchError(
                f"{patch.name} does not apply to {tree} (fix: delete {tree.parent.parent} "
                "so the pinned sdist is extracted again)")
        progress(f"==> patched the llama.cpp tree: {patch.name}")
    (tree / MARKER).write_text(digest() + "\n")
