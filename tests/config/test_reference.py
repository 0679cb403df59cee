"""docs/configuration.md against the parser: every key the parser accepts is in the
reference, every key the reference lists is accepted, and every default the reference
writes as a value is the one the parser applies.

The accepted keys are asked of the parser itself: a section given an unknown key is
refused with the list of the keys it allows. So a key added to the code (a dataclass
field, an entry of a `finish` list) fails here until it is documented, and a documented
key the code dropped fails too.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.config.agent_file import parse_agent_config
from proxy.config.agents import AGENT_KEY_ENV
from proxy.config.fields import ConfigError
from proxy.config.load import API_KEYS_ENV, parse_config

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "configuration.md"
HEADER = "| key | default | what it does |"
# no close match to any key, so the error lists them all instead of a did-you-mean
BOGUS = "qqqqqqqqqqqqqqqqqqqq"
KEY = "k" * 16  # an agent key long enough to be accepted


def _managed(**extra: Any) -> dict[str, Any]:
    return {"name": "a", "model": "demo", **extra}


def _external(**extra: Any) -> dict[str, Any]:
    return {"name": "r", "url": "http://127.0.0.1:9", **extra}


def _router(**top: Any) -> dict[str, Any]:
    return {"backends": [_managed()], **top}


def _agent(**top: Any) -> dict[str, Any]:
    return {"agent": {"key": KEY}, "backends": [_managed()], **top}


# each reference section: a document with `extra` added to that section, the parser that
# reads it, and the object holding what the parser made of the section's keys
Build = Callable[[dict[str, Any]], dict[str, Any]]
SECTIONS: dict[str, tuple[Build, str, Callable[[Any], Any]]] = {
    "Top level": (lambda x: _router(**x), "router", lambda c: c),
    "`proxy`": (lambda x: _router(proxy=x), "router",
                lambda c: _merged(c.proxy, c.proxy.settings)),
    "`proxy.health`": (lambda x: _router(proxy={"health": x}), "router",
                       lambda c: c.proxy.settings.health),
    "`routing`": (lambda x: _router(routing=x), "router",
                  lambda c: c.routing.router_settings()),
    "`backends`: managed llama-servers": (lambda x: {"backends": [_managed(**x)]}, "router",
                                          lambda c: c.backends[0]),
    "`backends`: external servers": (lambda x: {"backends": [_external(**x)]}, "router",
                                     lambda c: c.backends[0]),
    "`kv_disk`": (lambda x: _router(kv_disk={"path": "slots", **x}), "router",
                  lambda c: c.kv_disk),
    "`replicas`": (lambda x: _router(replicas={"nats": "nats://127.0.0.1:4222", **x}),
                   "router", lambda c: c.replicas),
    "`agents`": (lambda x: {"agents": [{"url": "http://10.0.0.5:8090", "key": KEY, **x}]},
                 "router", lambda c: c.agents[0]),
    "`supervision`": (lambda x: _router(supervision=x), "router", lambda c: c.supervision),
    "`demo_model`": (lambda x: _router(demo_model=x), "router", lambda c: c.demo_model),
    "An agent's file": (lambda x: _agent(**x), "agent", lambda c: c),
    "`agent`": (lambda x: _agent(agent={"key": KEY, **x}), "agent", lambda c: c.agent),
}


class _merged:
    """Attributes of the first object that has them (ProxyConfig, then ProxySettings)."""

    def __init__(self, *objs: object) -> None:
        self.objs = objs

    def __getattr__(self, name: str) -> Any:
        for o in self.objs:
            if hasattr(o, name):
                return getattr(o, name)
        raise AttributeError(name)


def _parse(kind: str, data: dict[str, Any], base: Path) -> Any:
    if kind == "agent":
        return parse_agent_config(data, base, allow_missing_demo=True)
    return parse_config(data, base, allow_missing_demo=True)


def accepted(section: str, base: Path) -> set[str]:
    """The keys the parser allows in `section`, from its refusal of an unknown one."""
    build, kind, _ = SECTIONS[section]
    with pytest.raises(ConfigError) as e:
        _parse(kind, build({BOGUS: 1}), base)
    m = re.search(rf"\b{BOGUS}: unknown key \(fix: allowed keys: ([^)]*)\)$", str(e.value))
    assert m, f"{section}: {e.value}"
    return set(m.group(1).split(", "))


def reference() -> dict[str, dict[str, str]]:
    """Each `## ` section of the reference: its table's keys and their default cells."""
    out: dict[str, dict[str, str]] = {}
    heading = None
    in_table = False
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            heading, in_table = line[3:].strip(), False
        elif line == HEADER:
            assert heading is not None and heading not in out, f"a second table: {heading}"
            out[heading], in_table = {}, True
        elif in_table and line.startswith("|") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            m = re.fullmatch(r"`([a-z_0-9]+)`", cells[0])
            assert m, f"{heading}: {line}"
            assert m.group(1) not in out[heading], f"{heading}: {m.group(1)} twice"
            out[heading][m.group(1)] = cells[1]
        elif in_table and not line.startswith("|"):
            in_table = False
    return out


@pytest.fixture(autouse=True)
def _no_env_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEYS_ENV, raising=False)
    monkeypatch.delenv(AGENT_KEY_ENV, raising=False)


def test_every_section_of_the_parser_has_a_table() -> None:
    assert sorted(reference()) == sorted(SECTIONS)


@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_the_reference_lists_exactly_the_accepted_keys(section: str, tmp_path: Path) -> None:
    documented = set(reference()[section])
    allowed = accepted(section, tmp_path)
    assert allowed - documented == set(), f"{section}: keys not in docs/configuration.md"
    assert documented - allowed == set(), f"{section}: documented keys the parser refuses"


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_defaults_written_as_values_are_the_parsers(section: str, tmp_path: Path) -> None:
    """A default cell that is one code span is a YAML value: the one a document without
    the key gets. (Prose defaults, such as "required" or "unset", are not checked.)"""
    literal = {key: yaml.safe_load(m.group(1)) for key, cell in reference()[section].items()
               if (m := re.fullmatch(r"`([^`]+)`", cell))}
    if key_env := literal.pop("key_env", None):  # not kept: the key it names is (below)
        assert key_env == AGENT_KEY_ENV
    if not literal:
        return
    build, kind, made = SECTIONS[section]
    parsed = made(_parse(kind, build({}), tmp_path))
    for key, want in literal.items():
        assert _plain(getattr(parsed, key)) == want, f"{section}: {key}"


def test_key_env_default_is_where_the_key_is_read(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    """`key_env`'s documented default, for a router's agents and an agent alike."""
    default = yaml.safe_load(reference()["`agents`"]["key_env"].strip("`"))
    assert default == yaml.safe_load(reference()["`agent`"]["key_env"].strip("`"))
    monkeypatch.setenv(default, "e" * 16)
    cfg = parse_config({"agents": [{"url": "http://10.0.0.5:8090"}]}, tmp_path)
    assert cfg.agents[0].key == "e" * 16
    agent = parse_agent_config({"agent": {}, "backends": [_managed()]}, tmp_path,
                               allow_missing_demo=True)
    assert agent.agent.key == "e" * 16


def test_the_shipped_config_uses_documented_keys_only() -> None:
    """Every key config.yaml sets, down to each backend's, is in the reference."""
    ref = reference()
    shipped = yaml.safe_load((REPO / "config.yaml").read_text())
    assert set(shipped) <= set(ref["Top level"])
    assert set(shipped["proxy"]) <= set(ref["`proxy`"])
    assert set(shipped["proxy"]["health"]) <= set(ref["`proxy.health`"])
    assert set(shipped["supervision"]) <= set(ref["`supervision`"])
    assert set(shipped["demo_model"]) <= set(ref["`demo_model`"])
    for b in shipped["backends"]:
        assert set(b) <= set(ref["`backends`: managed llama-servers"])
