"""A router's side of an agent (backends/remote.py) without processes: what an agent's
answer may hold, and the Supervisor events its backends cause as they come and go."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest

from backends.binary import cache_dir
from backends.config import AgentLink, ExternalBackendConfig
from backends.info import BackendInfo
from backends.remote import AgentWatch, BadReport, parse_answer
from backends.supervisor import Supervisor
from proxy.config.load import Config, ProxyConfig, RoutingConfig

LINK = AgentLink(name="box1", url="http://127.0.0.1:9", key="agent-key-" + "x" * 16)
READY: dict[str, Any] = {
    "name": "a", "state": "ready", "restarts": 0, "error": None,
    "url": "http://10.0.0.5:41000", "api_key": "backend-key-1", "n_slots": 2,
    "slot_ctx": 4096, "ram_cache_bytes": 1 << 30, "kv_bytes_per_token": 8192,
    "model": "kvroute-demo", "memory": {"n_swa": 0, "recurrent": False, "n_batch": 2048,
                                        "kv_bytes_per_token": None}}


def answer(*backends: dict[str, Any]) -> dict[str, Any]:
    return {"backends": [copy.deepcopy(b) for b in backends]}


def test_a_ready_backend_becomes_an_external_llama_backend_of_the_agent() -> None:
    (r,) = parse_answer(LINK, answer(READY))
    assert r.ready and r.agent == "box1"
    assert (r.cfg.name, r.cfg.url, r.cfg.api_key, r.cfg.alias) == (
        "box1/a", "http://10.0.0.5:41000", "backend-key-1", "kvroute-demo")
    assert (r.n_slots, r.slot_ctx, r.ram_cache_bytes, r.kv_bytes_per_token) == (
        2, 4096, 1 << 30, 8192)
    assert r.memory.n_batch == 2048 and r.memory.kv_bytes_per_token is None
    assert "backend-key-1" not in repr(r)
    assert r.modalities == frozenset()  # (an agent before them says none)
    (r,) = parse_answer(LINK, answer({**READY, "modalities": ["video", "vision"]}))
    assert r.modalities == {"vision", "video"}
    assert (r.lora, r.media_marker) == ((), "")  # (nor adapters, nor a marker)
    (r,) = parse_answer(LINK, answer({**READY, "lora": [1, 0.5], "media_marker": "<m>"}))
    assert (r.lora, r.alora, r.media_marker) == ((1.0, 0.5), (), "<m>")
    (r,) = parse_answer(LINK, answer({**READY, "lora": [1, 0], "alora": [[], [7, 8]]}))
    assert r.alora == ((), (7, 8))  # (adapter 1 an aLoRA invoked by tokens 7 8)


def test_a_backend_not_ready_carries_no_address() -> None:
    (r,) = parse_answer(LINK, answer({"name": "a", "state": "down", "restarts": 3,
                                      "error": "llama-server exited" * 100}))
    assert not r.ready and r.cfg.url == "" and r.restarts == 3
    assert r.error is not None and len(r.error) == 500


@pytest.mark.parametrize(("change", "says"), [
    ({"n_slots": 0}, "backends[0].n_slots: expected an integer >= 1"),
    ({"n_slots": True}, "backends[0].n_slots: expected int"),
    ({"slot_ctx": "4096"}, "backends[0].slot_ctx: expected int"),
    ({"api_key": "two\nlines"}, "backends[0].api_key: expected a short printable string"),
    ({"url": "file:///etc/passwd"}, "backends[0].url: expected an http(s) URL"),
    ({"memory": [1]}, "backends[0].memory: expected an object"),
    ({"memory": {"n_swa": -1}}, "backends[0].memory.n_swa: expected an integer >= 0"),
    ({"name": ""}, "backends[0].name: expected a short printable string"),
    ({"modalities": "vision"}, "backends[0].modalities: expected a list of media kinds"),
    ({"modalities": [1]}, "backends[0].modalities: expected a list of media kinds"),
    ({"lora": [True]}, "backends[0].lora: expected a list of adapter scales"),
    ({"lora": {"0": 1}}, "backends[0].lora: expected a list of adapter scales"),
    ({"alora": [7, 8]}, "backends[0].alora: expected a list of token id lists"),
    ({"alora": [[True]]}, "backends[0].alora: expected a list of token id lists"),
    ({"alora": [[-2]]}, "backends[0].alora: expected a list of token id lists"),
])
def test_a_wrong_answer_is_refused_naming_the_field(change: dict[str, Any], says: str) -> None:
    with pytest.raises(BadReport, match=re.escape(says)):
        parse_answer(LINK, answer({**READY, **change}))


@pytest.mark.parametrize("body", [None, [], {"backends": {}}, {"backends": [1]},
                                  {"backends": [READY] * 300}, answer(READY, READY)])
def test_an_answer_that_is_not_an_agents_is_refused(body: object) -> None:
    with pytest.raises(BadReport):
        parse_answer(LINK, body)


@pytest.fixture
def supervisor(tmp_path: Path) -> Supervisor[Config]:
    cfg = Config(proxy=ProxyConfig(port=1), routing=RoutingConfig(), backends=(),
                 llama_server=None, cache_dir=cache_dir(), log_dir=tmp_path)
    tmp_path.mkdir(exist_ok=True)
    return Supervisor(cfg)


def watch(sup: Supervisor[Config]) -> tuple[AgentWatch, list[tuple[str, BackendInfo | None]]]:
    events: list[tuple[str, BackendInfo | None]] = []
    sup.subscribe(lambda name, info: events.append((name, info)))
    return AgentWatch(LINK, None, sup), events  # type: ignore[arg-type]  (no polls here)


def test_backends_follow_what_the_agent_says(supervisor: Supervisor[Config]) -> None:
    w, events = watch(supervisor)
    w.apply(parse_answer(LINK, answer(READY)))
    w.apply(parse_answer(LINK, answer(READY)))  # the same: nothing happens
    (name, info), = events
    assert name == "box1/a" and info is not None and info.api_key == "backend-key-1"
    assert not info.managed and info.url == "http://10.0.0.5:41000"
    assert "backend-key-1" not in repr(info)
    # restarted by its agent: a new port and key, an empty cache: down, then up anew
    w.apply(parse_answer(LINK, answer({**READY, "url": "http://10.0.0.5:41001",
                                       "api_key": "backend-key-2", "restarts": 1})))
    assert [(n, i and i.api_key) for n, i in events[1:]] == [
        ("box1/a", None), ("box1/a", "backend-key-2")]
    status = supervisor.statuses()[0]
    assert (status["agent"], status["restarts"], status["state"]) == ("box1", 1, "ready")
    assert "backend-key" not in str(supervisor.statuses())


def test_an_agent_away_takes_its_backends_down_and_back(supervisor: Supervisor[Config]
                                                        ) -> None:
    w, events = watch(supervisor)
    w.apply(parse_answer(LINK, answer(READY)))
    w.apply("/backends: ClientConnectorError")
    w.apply("/backends: ClientConnectorError")
    assert [i is None for _, i in events] == [False, True]
    status = supervisor.statuses()[0]
    assert status["state"] == "down" and status["healthy"] is False
    assert str(status["last_error"]).startswith("agent box1 unreachable: /backends")
    w.apply(parse_answer(LINK, answer(READY)))
    assert [i is None for _, i in events] == [False, True, False]
    assert supervisor.statuses()[0]["state"] == "ready"


def test_a_backend_the_agent_drops_leaves(supervisor: Supervisor[Config]) -> None:
    w, events = watch(supervisor)
    w.apply(parse_answer(LINK, answer(READY, {**READY, "name": "b"})))
    w.apply(parse_answer(LINK, answer({**READY, "name": "b"})))
    assert [(n, i is None) for n, i in events] == [
        ("box1/a", False), ("box1/b", False), ("box1/a", True)]
    assert [s["name"] for s in supervisor.statuses()] == ["box1/b"]
    w.apply(parse_answer(LINK, answer({"name": "b", "state": "starting", "restarts": 1})))
    assert events[-1] == ("box1/b", None)
    assert supervisor.statuses()[0]["state"] == "starting"


def test_a_configured_backend_keeps_its_name(tmp_path: Path) -> None:
    cfg = Config(proxy=ProxyConfig(port=1), routing=RoutingConfig(),
                 backends=(ExternalBackendConfig(name="box1/a", url="http://127.0.0.1:9"),),
                 llama_server=None, cache_dir=cache_dir(), log_dir=tmp_path)
    sup = Supervisor(cfg)
    w, events = watch(sup)
    w.apply(parse_answer(LINK, answer(READY)))
    assert events == [] and sup.statuses()[0]["agent"] is None
    # the agent away, then no longer listing it: the configured backend is not its own
    w.apply("/backends: ClientConnectorError")
    w.apply(parse_answer(LINK, answer()))
    assert events == []
    assert [(s["name"], s["agent"]) for s in sup.statuses()] == [("box1/a", None)]
    assert sup.statuses()[0]["last_error"] is None
