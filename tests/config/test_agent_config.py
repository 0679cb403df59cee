"""An agent's file (proxy/config/agent_file.py) and a router's `agents:` list
(proxy/config/agents.py): what they accept, and errors that name the key and the fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from backends.config import AgentConfig
from proxy.config.agent_file import load_agent_config, parse_agent_config
from proxy.config.fields import ConfigError
from proxy.config.load import parse_config

KEY = "k" * 24
EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"


@pytest.fixture(autouse=True)
def agent_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVROUTE_AGENT_KEY", KEY)


def agent(**section: Any) -> dict[str, Any]:
    return {"agent": {"host": "0.0.0.0", "advertise": "10.0.0.5", **section},
            "backends": [{"name": "a", "model": "demo"}]}


def parse(data: dict[str, Any], tmp_path: Path) -> AgentConfig:
    return parse_agent_config(data, tmp_path, allow_missing_demo=True)


def error(data: dict[str, Any], tmp_path: Path) -> str:
    with pytest.raises(ConfigError) as e:
        parse(data, tmp_path)
    return str(e.value)


def test_agent_file_reads_its_section_and_the_managed_backends(tmp_path: Path) -> None:
    cfg = parse({**agent(port=9000), "supervision": {"restart_backoff_s": 1},
                 "log_dir": "agent-logs"}, tmp_path)
    a = cfg.agent
    assert (a.host, a.port, a.advertise, a.key) == ("0.0.0.0", 9000, "10.0.0.5", KEY)
    assert [b.name for b in cfg.managed()] == ["a"] and cfg.backends[0].is_demo
    assert cfg.supervision.restart_backoff_s == 1.0
    assert cfg.log_dir == tmp_path / "agent-logs"
    assert cfg.gguf_of("a") == cfg.backends[0].model and cfg.gguf_of("zz") is None
    assert cfg.agents == () and cfg.kv_disk is None
    assert KEY not in repr(cfg)  # a config printed or logged shows no key


def test_agent_advertises_its_host_when_that_is_an_address(tmp_path: Path) -> None:
    cfg = parse({"agent": {"host": "10.0.0.7"}, "backends": [{"model": "demo"}]}, tmp_path)
    assert cfg.agent.advertise == "10.0.0.7" and cfg.agent.port == 8090


@pytest.mark.parametrize(("data", "says"), [
    ({"backends": [{"model": "demo"}]}, "agent: missing (fix: e.g. agent: {host"),
    ({"agent": {"host": "0.0.0.0"}, "backends": [{"model": "demo"}]},
     "agent.advertise: required with host '0.0.0.0' (fix:"),
    (agent(advertise="0.0.0.0"), "agent.advertise: '0.0.0.0' is not an address"),
    (agent(key_env="NO_SUCH_VAR_FOR_KVROUTE"),
     "agent.key_env: the environment variable NO_SUCH_VAR_FOR_KVROUTE is not set (fix: "
     "export NO_SUCH_VAR_FOR_KVROUTE="),
    (agent(key="short"), "agent.key: the key is 5 characters, fewer than 16 (fix:"),
    (agent(key="a key with spaces in it"), "agent.key: the key holds a space"),
    (agent(key=KEY, key_env="X"), "agent.key: give one of key and key_env"),
    (agent(prot=1), "agent.prot: unknown key (fix: did you mean 'port'?)"),
    ({**agent(), "backends": [{"name": "r", "url": "http://10.0.0.9:8080"}]},
     "backends[0]: an agent runs its backends: give 'model', not 'url'"),
    ({**agent(), "proxy": {"port": 1}}, "proxy: unknown key"),
    ({**agent(), "backends": []}, "backends: expected a non-empty list"),
])
def test_agent_file_errors_name_the_key_and_the_fix(tmp_path: Path, data: dict[str, Any],
                                                     says: str) -> None:
    message = error(data, tmp_path)
    assert says in message, message
    assert KEY not in message


def test_agent_key_may_sit_in_the_file(tmp_path: Path) -> None:
    assert parse(agent(key="f" * 20), tmp_path).agent.key == "f" * 20


def test_example_agent_file_loads(tmp_path: Path, demo_model: Path) -> None:
    data = yaml.safe_load((EXAMPLES / "agent.yaml").read_text())
    for b in data["backends"]:
        b["model"] = str(demo_model)  # (the example names a model this machine lacks)
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(data))
    cfg = load_agent_config(path)
    assert [b.name for b in cfg.backends] == ["gpu0", "gpu1"]
    assert cfg.agent.advertise == "10.0.0.5" and cfg.agent.key == KEY


def router(agents: Any, **top: Any) -> dict[str, Any]:
    return {"proxy": {"port": 18080}, "agents": agents, **top}


def test_router_takes_agents_and_needs_no_backends_of_its_own(tmp_path: Path) -> None:
    cfg = parse_config(router([{"url": "http://10.0.0.5:8090/"},
                               {"url": "http://10.0.0.6:8090", "name": "box2",
                                "key": "z" * 16, "poll_interval_s": 0.5}]), tmp_path)
    one, two = cfg.agents
    assert (one.name, one.url, one.key, one.poll_interval_s) == (
        "10.0.0.5:8090", "http://10.0.0.5:8090", KEY, 2.0)
    assert (two.name, two.key, two.poll_interval_s) == ("box2", "z" * 16, 0.5)
    assert cfg.backends == () and len(cfg.pools()) == 1
    assert KEY not in repr(cfg) and "z" * 16 not in repr(cfg)


@pytest.mark.parametrize(("agents", "says"), [
    ({"url": "http://x"}, "agents: expected a list"),
    ([{"url": "10.0.0.5:8090"}], "agents[0].url: expected the agent's http(s) URL"),
    ([{"url": "http://a:1", "key_env": "NO_SUCH_VAR_FOR_KVROUTE"}],
     "agents[0].key_env: the environment variable NO_SUCH_VAR_FOR_KVROUTE is not set"),
    ([{"url": "http://a:1"}, {"url": "http://a:1"}], "agents[1].name: duplicate name 'a:1'"),
    ([{"url": "http://a:1", "name": "x/y"}], "agents[0].name: 'x/y' holds a '/'"),
    ([{"url": "http://a:1", "poll_interval_s": 0}], "agents[0].poll_interval_s: expected a "
                                                    "positive number"),
    ([{"url": "http://a:1", "keyenv": "X"}], "agents[0].keyenv: unknown key (fix: did you "
                                             "mean 'key_env'?)"),
])
def test_router_agents_errors_name_the_key_and_the_fix(tmp_path: Path, agents: Any,
                                                       says: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config(router(agents), tmp_path)
    assert says in str(e.value), str(e.value)


def test_router_without_agents_still_needs_backends(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="backends: expected a non-empty list"):
        parse_config({"proxy": {"port": 18080}}, tmp_path)
