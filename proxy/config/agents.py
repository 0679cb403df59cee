"""A router's `agents:` list, and the key an agent's section holds (here and in an
agent's own file, proxy/config/agent_file.py): read from the environment variable
`key_env` names (the documented way: a file is copied, shown and committed more readily
than an environment), or given as `key`.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit

from backends.config import AgentLink
from proxy.config.fields import ConfigError, _Section, _show, unique_names

AGENT_KEY_ENV = "KVROUTE_AGENT_KEY"
AGENT_PORT = 8090
MIN_KEY_CHARS = 16  # a guessable key would open every backend of the host
_NEW_KEY = "python3 -c 'import secrets; print(secrets.token_urlsafe(32))'"


def agent_key(sec: _Section) -> str:
    """The key ``sec`` names: ``key_env`` (default KVROUTE_AGENT_KEY), or ``key``."""
    where = sec.where
    if sec.has("key") and sec.has("key_env"):
        raise ConfigError(f"{where}key: give one of key and key_env (fix: keep key_env, "
                          "and export the key in that variable)")
    if sec.has("key"):
        key, source = sec.get_str("key", None, "<a secret>"), f"{where}key"
    else:
        env = sec.get_str("key_env", AGENT_KEY_ENV, AGENT_KEY_ENV)
        assert env is not None
        key, source = os.environ.get(env, "").strip(), f"{where}key_env"
        if not key:
            raise ConfigError(f"{source}: the environment variable {env} is not set (fix: "
                              f"export {env}=$({_NEW_KEY}), the same on agent and routers)")
    assert key is not None
    if not (key.isascii() and key.isprintable()) or " " in key:
        raise ConfigError(f"{source}: the key holds a space, control or non-ASCII "
                          "character (fix: the key alone, e.g. from secrets.token_urlsafe)")
    if len(key) < MIN_KEY_CHARS:
        raise ConfigError(f"{source}: the key is {len(key)} characters, fewer than "
                          f"{MIN_KEY_CHARS} (fix: a random one: {_NEW_KEY})")
    return key


def agent_links(raw: object) -> tuple[AgentLink, ...]:
    """A router's `agents:` list."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ConfigError(f"agents: expected a list, got {_show(raw)} (fix: e.g. agents: "
                          f"[{{url: http://10.0.0.5:{AGENT_PORT}, key_env: {AGENT_KEY_ENV}}}])")
    links = tuple(_link(item, i) for i, item in enumerate(raw))
    unique_names([link.name for link in links], "agents")
    return links


def _link(raw: object, i: int) -> AgentLink:
    where = f"agents[{i}]."
    sec = _Section(raw, where)
    url = sec.get_str("url", None, f"http://10.0.0.5:{AGENT_PORT}")
    parts = urlsplit(url or "")
    if not url or parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"{where}url: expected the agent's http(s) URL, got {_show(url)} "
                          f"(fix: e.g. url: http://10.0.0.5:{AGENT_PORT})")
    name = sec.get_str("name", parts.netloc, "gpu-box-1")
    assert name is not None
    if "/" in name:
        raise ConfigError(f"{where}name: {name!r} holds a '/' (fix: e.g. name: gpu-box-1)")
    interval = sec.get_num("poll_interval_s", 2.0)
    link = AgentLink(name=name, url=url.rstrip("/"), key=agent_key(sec), poll_interval_s=interval)
    sec.finish(["url", "name", "key_env", "key", "poll_interval_s"])
    return link
