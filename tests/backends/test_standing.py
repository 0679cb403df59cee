"""Where a backend stands (backends/standing.py), table-driven: what the subscribers hear
of each change, what its status says, and what backends.json mirrors. No processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backends.config import OPENAI, ExternalBackendConfig, ManagedBackendConfig
from backends.info import BackendInfo
from backends.standing import MIRRORED, Listeners, Standing

INFO = BackendInfo(name="a", url="http://127.0.0.1:1", api_key="secret-key", n_slots=2,
                   slot_ctx=4096, ram_cache_bytes=0, kv_bytes_per_token=8192,
                   model="kvroute-demo", managed=True)
OTHER = BackendInfo(name="a", url="http://127.0.0.1:2", api_key="other-key", n_slots=2,
                    slot_ctx=4096, ram_cache_bytes=0, kv_bytes_per_token=8192,
                    model="kvroute-demo", managed=True)
MANAGED = ManagedBackendConfig(name="a", model=Path("m.gguf"))


class Pool:
    """One Standing, its Listeners, what the subscribers heard and how often the file
    was written."""

    def __init__(self, tmp_path: Path) -> None:
        self.heard: list[tuple[str, bool]] = []  # (name, ready)
        self.writes = 0
        self.listeners = Listeners(tmp_path / "backends.json", self._statuses)
        self.listeners.subscribe(lambda name, info: self.heard.append((name, info is not None)))
        self.standing = Standing("a", self.listeners)

    def _statuses(self) -> list[dict[str, object]]:
        self.writes += 1
        return [self.standing.status(MANAGED, pid=7, restarts=2, log_path=Path("a.log"))]


# each step: (method, argument); then what was heard, the state, the last error, writes
@pytest.mark.parametrize(("steps", "heard", "state", "error", "writes"), [
    ([("up", INFO)], [True], "ready", None, 2),  # the state, then the news
    ([("up", INFO), ("down", None)], [True, False], "ready", None, 3),
    ([("down", None)], [], "stopped", None, 0),  # not up: nothing to tell
    ([("up", INFO), ("down", None), ("down", None)], [True, False], "ready", None, 3),
    ([("up", INFO), ("up", OTHER)], [True, True], "ready", None, 4),
    ([("set", "starting"), ("set", "failed")], [], "failed", None, 2),
    ([("become", "down"), ("become", "down")], [], "down", "x", 1),  # said once
    ([("set", "down"), ("become", "down")], [], "down", "x", 2),  # (a new error: said)
    ([("up", INFO), ("stopped", None)], [True, False], "stopped", None, 3),  # not logged
])
def test_changes_and_what_is_heard(tmp_path: Path, steps: list[tuple[str, object]],
                                   heard: list[bool], state: str, error: str | None,
                                   writes: int) -> None:
    pool = Pool(tmp_path)
    s = pool.standing
    for method, arg in steps:
        if method == "become":
            s.become(str(arg), "x")
        elif arg is None:
            getattr(s, method)()
        else:
            getattr(s, method)(arg)
    assert pool.heard == [("a", r) for r in heard]
    assert (s.state, s.last_error, pool.writes) == (state, error, writes)
    assert (s.info is not None) == (state == "ready" and heard[-1:] == [True])


def test_status_says_what_the_component_adds(tmp_path: Path) -> None:
    s = Pool(tmp_path).standing
    s.moved("http://127.0.0.1:1")
    s.up(INFO)
    st = s.status(MANAGED, pid=7, restarts=2, log_path=Path("a.log"))
    assert list(st) == ["name", "managed", "kind", "state", "agent", "healthy", "url", "pid",
                        "restarts", "last_error", "ready_since", "log", "n_slots",
                        "slot_ctx", "model", "memory", "modalities", "devices", "mmproj",
                        "lora", "crash_loop"]
    assert (st["managed"], st["kind"], st["healthy"], st["pid"], st["log"], st["n_slots"]) == (
        True, "llama", True, 7, "a.log", 2)
    assert "secret-key" not in str(st)
    external = ExternalBackendConfig(name="a", url="http://x", kind=OPENAI)
    s.down()
    st = s.status(external, agent="box1")
    assert (st["managed"], st["kind"], st["agent"], st["healthy"], st["pid"], st["log"],
            st["restarts"], st["model"]) == (False, OPENAI, "box1", False, None, None, 0, None)


def test_a_failing_subscriber_is_logged_not_raised(tmp_path: Path) -> None:
    pool = Pool(tmp_path)
    pool.listeners.subscribe(lambda name, info: 1 / 0)
    after: list[str] = []
    pool.listeners.subscribe(lambda name, info: after.append(name))
    pool.standing.up(INFO)
    assert pool.heard == [("a", True)] and after == ["a"]


async def test_settled_once_told(tmp_path: Path) -> None:
    s = Pool(tmp_path).standing
    s.settle()
    await s.settled()


def test_the_file_mirrors_the_states_without_keys(tmp_path: Path) -> None:
    pool = Pool(tmp_path)
    pool.standing.up(INFO)
    doc = json.loads((tmp_path / "backends.json").read_text())
    (backend,) = doc["backends"]
    assert tuple(backend) == MIRRORED and backend["state"] == "ready"
    assert "secret-key" not in json.dumps(doc)
    pool.listeners.remove()
    assert not (tmp_path / "backends.json").exists()
