"""The traces kept in the repository: what traces/README.md says of them holds, and a
compressed trace reads as the plain one does."""

from __future__ import annotations

import hashlib
import json
import lzma
import re
from pathlib import Path

import pytest

from loadtest.trace import TRACES, TraceRequest, load_mooncake, trace_path
from loadtest.workloads import chat_trace, group_of, sample_groups, shared_depth

README = Path(__file__).resolve().parents[2] / "loadtest" / "traces" / "README.md"


def _plain_bytes(path: Path) -> bytes:
    return lzma.decompress(path.read_bytes()) if path.suffix == ".xz" else path.read_bytes()


@pytest.mark.parametrize("name", sorted(TRACES))
def test_a_kept_trace_is_the_one_its_readme_names(name: str) -> None:
    path = TRACES[name]
    text = README.read_text()
    entry = text[text.index(f"`{path.name}`"):].split("\n- ", 1)[0]
    digest = re.search(r"sha256[^`]*`([0-9a-f]{64})`", entry)
    count = re.search(r"([\d,]+)\s+requests", entry)
    assert digest and count, f"README has no sha256 or request count for {path.name}"
    assert hashlib.sha256(_plain_bytes(path)).hexdigest() == digest.group(1)
    assert len(load_mooncake(name)) == int(count.group(1).replace(",", ""))


def test_a_name_is_a_kept_trace_and_anything_else_a_path(tmp_path: Path) -> None:
    assert trace_path("conversation") == TRACES["conversation"]
    assert trace_path(str(tmp_path / "t.jsonl")) == tmp_path / "t.jsonl"


def test_an_xz_trace_reads_as_the_plain_one(tmp_path: Path) -> None:
    rows = [{"timestamp": t, "input_length": 600, "output_length": 5, "hash_ids": [0, t + 1]}
            for t in (30, 10, 20)]
    data = "\n".join(json.dumps(r) for r in rows).encode()
    (tmp_path / "t.jsonl").write_bytes(data)
    (tmp_path / "t.jsonl.xz").write_bytes(lzma.compress(data))
    plain = load_mooncake(tmp_path / "t.jsonl")
    assert load_mooncake(tmp_path / "t.jsonl.xz") == plain
    assert [r.timestamp_ms for r in plain] == [10, 20, 30]


def test_the_conversation_trace_replays_as_chat_with_shared_histories() -> None:
    w = chat_trace(path="conversation", requests=60, rate=2.0, block=32)
    reqs = w.requests()
    assert 60 <= len(reqs) < 200
    assert w.oracle_reuse is not None and w.oracle_reuse > 0.2  # its sessions share history
    assert {len(r.body["messages"]) for r in reqs} == {1}


def _req(*ids: int) -> TraceRequest:
    return TraceRequest(0.0, len(ids) * 512, 1, ids)


@pytest.mark.parametrize("ids, depth", [
    ([(1, 2), (3, 4)], 0),
    ([(0, 2, 5), (0, 3), (0, 2)], 1),
    ([(0, 7, 1), (0, 7, 2)], 2),
    ([(0,), (0, 1)], 1),
    ([(5, 6)], 2),
])
def test_the_depth_every_request_shares(ids: list[tuple[int, ...]], depth: int) -> None:
    assert shared_depth([_req(*i) for i in ids]) == depth


def test_a_shared_system_prompt_does_not_make_the_whole_trace_one_conversation() -> None:
    full = load_mooncake("conversation")
    assert shared_depth(full) == 1  # every request starts with the same block
    picked = sample_groups(full, 200, seed=0)
    assert 200 <= len(picked) < 400
    assert len({group_of(r, 1) for r in picked}) > 20
