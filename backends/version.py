"""Which llama.cpp a llama-server binary and the proxy's tokenizer come from, and whether
they differ: another llama.cpp may tokenize or render templates differently, so the
prompt ids kvroute routes by would not be the ones the server caches.

``llama-server --version`` prints (to stderr) ``version: 0.5.0-dev (build 1, commit
0c1e570)`` (older trees: ``version: 4567 (0c1e570)``). The tokenizer is libllama of the
pinned llama-cpp-python, compiled from its vendored tree: its version is that tree's
``LLAMA_VERSION`` (CMakeLists.txt) and its commit the submodule's git HEAD, which the
sdist ships (read here without git).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from backends.binary import find_llama_cpp_source, llama_cpp_python_version

# The vendored tree of each pin, for when its sdist is not extracted yet (llama-server
# taken from PATH or the config is never built). Checked against the tree by the tests.
KNOWN_PINS = {"0.3.36": ("0.5.0-dev", "0c1e570")}

_LINE = re.compile(r"version:\s*(\S+)(?:\s*\((.*)\))?")
_COMMIT = re.compile(r"commit\s+([0-9a-f]{7,40})\b")
_BARE_COMMIT = re.compile(r"\s*([0-9a-f]{7,40})\s*")
_BUILD = re.compile(r"build\s+(\d+)")


@dataclass(frozen=True)
class LlamaCppVersion:
    version: str  # "0.5.0-dev", or an older tree's build number "4567"
    commit: str | None = None  # abbreviated hash; None when the build did not know it
    build: int | None = None

    def __str__(self) -> str:
        return f"{self.version} (commit {self.commit or 'unknown'})"

    def same_as(self, other: LlamaCppVersion) -> bool:
        """Same tree, as far as both know: the commits when both have one (abbreviations
        may differ in length), else the version."""
        if self.commit and other.commit:
            a, b = sorted((self.commit, other.commit), key=len)
            return b.startswith(a)
        return self.version == other.version


def parse_version(line: str) -> LlamaCppVersion | None:
    """``llama-server --version``'s first line, or None when it is not one."""
    m = _LINE.search(line)
    if m is None:
        return None
    inner = m.group(2) or ""
    # "build N, commit X" (X is "unknown" when built without git), or just the hash
    commit = _COMMIT.search(inner) if "commit" in inner else _BARE_COMMIT.fullmatch(inner)
    build = _BUILD.search(inner)
    return LlamaCppVersion(m.group(1), commit.group(1) if commit else None,
                           int(build.group(1)) if build else None)


def _cmake_version(tree: Path) -> str | None:
    text = (tree / "CMakeLists.txt").read_text(errors="replace")
    parts = [re.search(rf"set\(LLAMA_VERSION_{p}\s+(\d+)\)", text) for p in
             ("MAJOR", "MINOR", "PATCH")]
    if not all(parts):
        return None
    base = ".".join(m.group(1) for m in parts if m)
    dev = re.search(r'option\(LLAMA_BUILD_IS_DEV\s+"[^"]*"\s+(ON|OFF)\)', text)
    return base + ("-dev" if dev is None or dev.group(1) == "ON" else "")


def _git_head(tree: Path) -> str | None:
    """The commit checked out in ``tree`` (a submodule's ``.git`` is a file naming its
    git dir), read from the git dir's files."""
    dot_git = tree / ".git"
    git_dir = dot_git
    if dot_git.is_file():
        ref = dot_git.read_text().strip().removeprefix("gitdir:").strip()
        git_dir = (tree / ref).resolve()
    try:
        head = (git_dir / "HEAD").read_text().strip()
        if head.startswith("ref:"):
            name = head.removeprefix("ref:").strip()
            loose = git_dir / name
            head = loose.read_text().strip() if loose.is_file() else next(
                line.split()[0] for line in (git_dir / "packed-refs").read_text().splitlines()
                if line.endswith(" " + name))
    except (OSError, StopIteration):
        return None
    return head[:7] if re.fullmatch(r"[0-9a-f]{40}", head) else None


def vendored_version(tree: Path) -> LlamaCppVersion | None:
    """The llama.cpp of a source tree (vendor/llama.cpp of the sdist)."""
    version = _cmake_version(tree)
    return LlamaCppVersion(version, _git_head(tree)) if version else None


def tokenizer_version() -> LlamaCppVersion | None:
    """The llama.cpp the proxy's tokenizer is built from (None: not known)."""
    root = find_llama_cpp_source()
    found = vendored_version(root / "vendor" / "llama.cpp") if root else None
    if found is not None:
        return found
    pin = KNOWN_PINS.get(llama_cpp_python_version())
    return LlamaCppVersion(*pin) if pin else None


def version_warning(path: Path, version_line: str) -> str | None:
    """Why the binary at ``path`` (whose ``--version`` is ``version_line``) may not match
    the tokenizer; None when it matches or either version is unknown."""
    server, ours = parse_version(version_line), tokenizer_version()
    if server is None or ours is None or server.same_as(ours):
        return None
    return (f"llama-server {path} is llama.cpp {server}, but the tokenizer "
            f"(llama-cpp-python {llama_cpp_python_version()}) is llama.cpp {ours}: prompts "
            "may be tokenized or templated differently, and cache reuse mispredicted "
            "(fix: remove llama_server from the config, or llama-server from PATH, to use "
            "the one built from the tokenizer's tree; or use a llama-server of that commit)")
