"""An agent's file (`kvroute agent --config agent.yaml`): its `agent:` section, and
`backends:` as in config.yaml (parsed by the same code), managed ones only: an agent
starts what it serves.
"""

from __future__ import annotations

from pathlib import Path

from backends.config import AgentConfig, AgentSettings, ManagedBackendConfig
from proxy.config.agents import AGENT_KEY_ENV, AGENT_PORT, agent_key
from proxy.config.backend_list import backend_list, demo_params, llama_server, supervision
from proxy.config.fields import ConfigError, _path, _Section, _show
from proxy.config.load import _read_yaml

_WILDCARDS = ("0.0.0.0", "::", "")


def agent_settings(raw: object) -> AgentSettings:
    """An agent's own `agent:` section."""
    if raw is None:
        raise ConfigError("agent: missing (fix: e.g. agent: {host: 0.0.0.0, port: 8090, "
                          f"advertise: 10.0.0.5, key_env: {AGENT_KEY_ENV}}})")
    sec = _Section(raw, "agent.")
    host = sec.get_str("host", "127.0.0.1", "0.0.0.0")
    assert host is not None
    port = sec.get_int("port", AGENT_PORT, hi=65535)
    advertise = sec.get_str("advertise", None, "10.0.0.5")
    if advertise is None:
        if host in _WILDCARDS:
            raise ConfigError(f"agent.advertise: required with host {host!r} (fix: the "
                              "address or name routers reach this host at, e.g. "
                              "advertise: 10.0.0.5)")
        advertise = host
    if advertise in _WILDCARDS or "/" in advertise:
        raise ConfigError(f"agent.advertise: {_show(advertise)} is not an address routers "
                          "can reach (fix: this host's address or name, e.g. 10.0.0.5)")
    settings = AgentSettings(key=agent_key(sec), host=host, port=port, advertise=advertise)
    sec.finish(["host", "port", "advertise", "key_env", "key"])
    return settings


def parse_agent_config(data: object, base: Path, *, allow_missing_demo: bool = False,
                       source: Path | None = None) -> AgentConfig:
    """An agent's file: `agent:`, and `backends:` as in config.yaml, managed ones only
    (an agent starts what it serves), with the keys of config.yaml that they use."""
    top = _Section(data, "")
    settings = agent_settings(top._get("agent"))
    demo = demo_params(top._get("demo_model"))
    backends = backend_list(top, base, demo, allow_missing_demo)
    for i, b in enumerate(backends):
        if not isinstance(b, ManagedBackendConfig):
            raise ConfigError(f"backends[{i}]: an agent runs its backends: give 'model', not "
                              "'url' (fix: list external backends in the routers' config)")
    cfg = AgentConfig(
        agent=settings, backends=tuple(b for b in backends
                                       if isinstance(b, ManagedBackendConfig)),
        llama_server=llama_server(top, base),
        log_dir=_path(base, top.get_str("log_dir", "logs", "logs") or "logs"),
        demo_model=demo, supervision=supervision(top._get("supervision")),
        source=source)
    top.finish(["agent", "backends", "llama_server", "log_dir", "demo_model", "supervision"])
    return cfg


def load_agent_config(path: Path, *, allow_missing_demo: bool = False) -> AgentConfig:
    """Load and validate an agent's file (`kvroute agent --config`)."""
    data, base = _read_yaml(path)
    return parse_agent_config(data, base, allow_missing_demo=allow_missing_demo,
                              source=Path(path).resolve())
