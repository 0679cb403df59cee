"""Which llama.cpp a llama-server and the tokenizer come from (backends/version.py), and
the warning when they differ (what `kvroute serve` and `doctor` make of it: test_cli.py).
The other llama.cpp is a real executable that answers --version as its server would."""

from __future__ import annotations

from pathlib import Path

import pytest

from backends.binary import binary_version, llama_cpp_python_version, llama_cpp_source
from backends.version import (
    KNOWN_PINS,
    LlamaCppVersion,
    parse_version,
    tokenizer_version,
    vendored_version,
    version_warning,
)

OTHER = "version: 0.4.0-dev (build 4242, commit deadbee)"


@pytest.mark.parametrize("line, parsed", [
    ("version: 0.5.0-dev (build 1, commit 0c1e570)", LlamaCppVersion("0.5.0-dev", "0c1e570", 1)),
    ("version: 0.5.0 (build 8123, commit unknown)", LlamaCppVersion("0.5.0", None, 8123)),
    ("version: 4567 (0c1e570)", LlamaCppVersion("4567", "0c1e570")),  # older trees
    ("version: 4567 (0c1e57098bba)", LlamaCppVersion("4567", "0c1e57098bba")),
    ("version: 1 (build 1234567, commit unknown)", LlamaCppVersion("1", None, 1234567)),
    ("version: 6000", LlamaCppVersion("6000")),
    ("", None), ("llama-server 1.0", None),
])
def test_parse_version(line: str, parsed: LlamaCppVersion | None) -> None:
    assert parse_version(line) == parsed


@pytest.mark.parametrize("a, b, same", [
    (LlamaCppVersion("0.5.0-dev", "0c1e570", 1), LlamaCppVersion("0.5.0-dev", "0c1e570"), True),
    # the same commit built from a full clone: another build number, same tree
    (LlamaCppVersion("0.5.0-dev", "0c1e570", 9000), LlamaCppVersion("4567", "0c1e57098b"), True),
    (LlamaCppVersion("0.5.0-dev", "0c1e570"), LlamaCppVersion("0.5.0-dev", "deadbee"), False),
    (LlamaCppVersion("0.5.0-dev"), LlamaCppVersion("0.5.0-dev", "0c1e570"), True),
    (LlamaCppVersion("0.4.0-dev"), LlamaCppVersion("0.5.0-dev", "0c1e570"), False),
])
def test_same_as(a: LlamaCppVersion, b: LlamaCppVersion, same: bool) -> None:
    assert a.same_as(b) is same and b.same_as(a) is same


def test_the_pinned_tree_is_read_and_matches_the_known_pins() -> None:
    tree = llama_cpp_source() / "vendor" / "llama.cpp"
    found = vendored_version(tree)
    assert found is not None
    assert (found.version, found.commit) == KNOWN_PINS[llama_cpp_python_version()]
    assert tokenizer_version() == found


@pytest.mark.parametrize("head, refs, commit", [
    ("0c1e57098bba43ac29e6e3b677cdceebdd22334f\n", {}, "0c1e570"),
    ("ref: refs/heads/master\n", {"refs/heads/master": "deadbeef" * 5 + "\n"}, "deadbee"),
    ("ref: refs/heads/master\n",
     {"packed-refs": "# pack-refs\n" + "abcdef12" * 5 + " refs/heads/master\n"}, "abcdef1"),
    ("ref: refs/heads/gone\n", {}, None),
])
def test_a_submodules_commit_is_read_without_git(tmp_path: Path, head: str,
                                                 refs: dict[str, str],
                                                 commit: str | None) -> None:
    tree, git_dir = tmp_path / "sdist" / "vendor" / "llama.cpp", tmp_path / "sdist" / ".git"
    tree.mkdir(parents=True)
    (tree / "CMakeLists.txt").write_text(
        "set(LLAMA_VERSION_MAJOR 0)\nset(LLAMA_VERSION_MINOR 6)\nset(LLAMA_VERSION_PATCH 1)\n"
        'option(LLAMA_BUILD_IS_DEV "llama: dev build" OFF)\n')
    (tree / ".git").write_text("gitdir: ../../.git/modules/vendor/llama.cpp\n")
    sub = git_dir / "modules" / "vendor" / "llama.cpp"
    sub.mkdir(parents=True)
    (sub / "HEAD").write_text(head)
    for name, text in refs.items():
        (sub / name).parent.mkdir(parents=True, exist_ok=True)
        (sub / name).write_text(text)
    assert vendored_version(tree) == LlamaCppVersion("0.6.1", commit)


def test_the_built_server_is_the_tokenizers_llama_cpp(llama_server_bin: Path) -> None:
    line = binary_version(llama_server_bin)
    assert line.startswith("version:")
    assert version_warning(llama_server_bin, line) is None


def _fake_server(directory: Path, version: str = OTHER) -> Path:
    """A real executable that answers --version as another llama.cpp's server does."""
    path = directory / "llama-server"
    directory.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\necho "{version}" >&2\necho "built with cc for Linux" >&2\n')
    path.chmod(0o755)
    return path


@pytest.fixture
def other_server(tmp_path: Path) -> Path:
    return _fake_server(tmp_path / "bin")


def _names_both(warning: str | None, path: Path) -> bool:
    """The warning names the server, both llama.cpp versions and the tokenizer's pin."""
    ours = tokenizer_version()
    assert ours is not None and ours.commit is not None and warning is not None
    return all(s in warning for s in (str(path), "0.4.0-dev", "deadbee", ours.version,
                                      ours.commit, llama_cpp_python_version()))


def test_another_llama_cpp_is_named(other_server: Path) -> None:
    assert binary_version(other_server) == OTHER
    assert _names_both(version_warning(other_server, OTHER), other_server)
