"""kvroute's configuration: config.yaml -> frozen dataclasses, validated on load.

Every error is a `ConfigError` whose message names the field and says how to fix it,
e.g. ``backends[1].slots: expected a positive integer, got 'two' (fix: ...)``.
Unknown keys are rejected (a typo must not silently fall back to a default).
"""

from __future__ import annotations

import errno
import importlib.util
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from backends.binary import cache_dir as default_cache_dir
from backends.config import (
    AgentLink,
    BackendConfig,
    KvDiskConfig,
    ManagedBackendConfig,
    SupervisionConfig,
)
from backends.demo_model import DemoModelParams
from proxy.config.agents import agent_links
from proxy.config.backend_list import backend_list, demo_params, llama_server, supervision
from proxy.config.disk import check_shared, kv_disk
from proxy.config.fields import (  # ConfigError is re-exported: imported from here
    ConfigError,
    _knobs,
    _path,
    _Section,
    _show,
)
from proxy.config.pools import PoolSpec, derive_pools
from proxy.config.settings import HealthSettings, ProxySettings
from proxy.observability.tracing import OTEL_MISSING, OTEL_MODULES
from proxy.routing.policies import POLICIES
from proxy.routing.settings import RouterSettings


@dataclass(frozen=True)
class ProxyConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    policy: str = "prefix"  # one of POLICIES
    settings: ProxySettings = field(default_factory=ProxySettings)  # the other proxy: keys


@dataclass(frozen=True)
class RoutingConfig:
    """Knobs passed through to `proxy.routing.settings.RouterSettings(**settings)`."""

    settings: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def router_settings(self) -> RouterSettings:
        return RouterSettings(**self.settings)


# (the broker's one-way latency is ~1 ms on one host, less on a LAN: the window must
# exceed it and the replicas' clock skew, and adds itself to a new conversation's wait)
CLAIM_WINDOW_S = 0.005


@dataclass(frozen=True)
class ReplicasConfig:
    """Replicas sharing their view of the backends (proxy/replicas/bus.py)."""

    nats: str  # the broker, e.g. nats://10.0.0.9:4222
    replica: str  # this replica's name among them (default: host name and port)
    # a new conversation's request is held this long for another replica's claim of its
    # slot (proxy/replicas/claims.py); 0: sent at once
    claim_window_s: float = CLAIM_WINDOW_S


@dataclass(frozen=True)
class Config:
    proxy: ProxyConfig
    routing: RoutingConfig
    backends: tuple[BackendConfig, ...]
    llama_server: str | None  # binary path; None = PATH, else build from the sdist
    cache_dir: Path
    log_dir: Path
    demo_model: DemoModelParams = field(default_factory=DemoModelParams)
    supervision: SupervisionConfig = field(default_factory=SupervisionConfig)
    kv_disk: KvDiskConfig | None = None  # slots saved to disk; None: off
    replicas: ReplicasConfig | None = None  # other replicas' view shared; None: alone
    agents: tuple[AgentLink, ...] = ()  # hosts whose agents run more backends
    source: Path | None = None  # the file it was loaded from (None: built-in defaults)

    def managed(self) -> tuple[ManagedBackendConfig, ...]:
        return tuple(b for b in self.backends if isinstance(b, ManagedBackendConfig))

    def pools(self) -> tuple[PoolSpec, ...]:
        return derive_pools(self.backends)

    def pool_gguf(self, spec: PoolSpec) -> Path | None:
        """What a pool is tokenized with: its first managed backend's GGUF, else (external
        backends only) proxy.tokenizer."""
        return spec.managed.model if spec.managed is not None else self.tokenizer

    def gguf_of(self, backend: str) -> Path | None:
        spec = next((p for p in self.pools() if backend in p.backends), None)
        return None if spec is None else self.pool_gguf(spec)

    @property
    def tokenizer(self) -> Path | None:
        """The GGUF given as proxy.tokenizer, if any."""
        return self.proxy.settings.tokenizer


# The built-in default is the shipped config.yaml itself (this package's default.yaml links
# to it, and a wheel carries it as package data).
DEFAULT_PATH = Path(__file__).with_name("default.yaml")


# proxy: keys that are not ProxySettings knobs, or not plain scalars
_HEALTH_ZERO_OFF = frozenset({"stall_timeout_s"})
_PROXY_OWN = ("host", "port", "policy", "api_keys", "health", "tokenizer", "max_tokens_cap")
# Client API keys may come from the environment, so they need not sit in a file.
API_KEYS_ENV = "KVROUTE_API_KEYS"


def _proxy_settings(sec: _Section, base: Path) -> ProxySettings:
    knobs = _knobs(sec.raw, "proxy.", ProxySettings(), special=_PROXY_OWN)
    sec.used.update(knobs)
    keys = list(sec.get_str_list("api_keys"))
    keys += [k.strip() for k in os.environ.get(API_KEYS_ENV, "").split(",") if k.strip()]
    health_raw = _Section(sec._get("health"), "proxy.health.")
    health_knobs = _knobs(health_raw.raw, "proxy.health.", HealthSettings())
    for key, value in health_knobs.items():  # (0 would make the prober spin)
        if value < 0 or (value == 0 and key not in _HEALTH_ZERO_OFF):
            off = " (or 0: off)" if key in _HEALTH_ZERO_OFF else ""
            raise ConfigError(f"proxy.health.{key}: expected a positive number{off}, got "
                              f"{value!r} (fix: e.g. {key}: {getattr(HealthSettings(), key)})")
    health = HealthSettings(**health_knobs)
    tokenizer = sec.get_str("tokenizer", None, "/models/my-model.gguf")
    tok_path = _path(base, tokenizer) if tokenizer else None
    if tok_path is not None and not tok_path.is_file():
        raise ConfigError(f"proxy.tokenizer: file not found: {tok_path} (fix: the GGUF the "
                          "external backends serve, for exact tokens)")
    cap = None  # absent or null: the slot's context bounds a generation
    if sec.raw.get("max_tokens_cap") is not None:
        cap = sec.get_int("max_tokens_cap", 4096)
    sec.used.add("max_tokens_cap")
    for key, value in knobs.items():
        if isinstance(value, int | float) and not isinstance(value, bool) and value <= 0:
            raise ConfigError(f"proxy.{key}: expected a positive number, got {value!r} "
                              f"(fix: e.g. {key}: {getattr(ProxySettings(), key)})")
    if knobs.get("otel") and not all(_importable(m) for m in OTEL_MODULES):
        raise ConfigError(OTEL_MISSING)
    return ProxySettings(api_keys=tuple(keys), health=health, tokenizer=tok_path,
                         max_tokens_cap=cap, **knobs)


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # (a parent package is missing)
        return False


def _routing(raw: object) -> RoutingConfig:
    sec = _Section(raw, "routing.")
    settings = MappingProxyType(_knobs(sec.raw, "routing.", RouterSettings()))
    try:
        RouterSettings(**settings)
    except ValueError as e:  # a value out of range: the message names the knob
        raise ConfigError(f"routing.{e} (fix: see the comments on RouterSettings in "
                          "proxy/routing/settings.py)") from None
    return RoutingConfig(settings)


def parse_config(data: object, base: Path, *, allow_missing_demo: bool = False,
                 source: Path | None = None) -> Config:
    """Validate an already-parsed YAML document. `base` anchors relative paths."""
    top = _Section(data, "")
    proxy_sec = _Section(top._get("proxy"), "proxy.")
    policy = proxy_sec.get_str("policy", "prefix", "prefix")
    if policy not in POLICIES:
        raise ConfigError(f"proxy.policy: unknown policy {policy!r} "
                          f"(fix: one of {', '.join(POLICIES)})")
    proxy = ProxyConfig(
        host=proxy_sec.get_str("host", "127.0.0.1", "127.0.0.1") or "127.0.0.1",
        port=proxy_sec.get_int("port", 8080, hi=65535),
        policy=policy or "prefix",
        settings=_proxy_settings(proxy_sec, base),
    )
    proxy_sec.finish()

    disk = kv_disk(top._get("kv_disk"), base)
    demo = demo_params(top._get("demo_model"))
    agents = agent_links(top._get("agents"))
    backends = backend_list(top, base, demo, allow_missing_demo, optional=bool(agents))
    cfg = Config(
        proxy=proxy, routing=_routing(top._get("routing")), backends=backends,
        llama_server=llama_server(top, base), cache_dir=default_cache_dir(),
        log_dir=_path(base, top.get_str("log_dir", "logs", "logs") or "logs"),
        demo_model=demo, supervision=supervision(top._get("supervision")),
        kv_disk=disk, source=source, agents=agents,
        replicas=_replicas(top._get("replicas"), proxy.port),
    )
    top.finish([f.name for f in fields(Config)
                if f.name not in ("cache_dir", "source")])
    derive_pools(backends)  # (a pool of two GGUFs is refused here, before anything starts)
    check_shared(backends, disk, replicas=cfg.replicas is not None)
    return cfg


def _replicas(raw: object, port: int) -> ReplicasConfig | None:
    if raw is None:
        return None
    sec = _Section(raw, "replicas.")
    url = sec.get_str("nats", None, "nats://127.0.0.1:4222")
    if not url or not url.startswith(("nats://", "tls://")):
        raise ConfigError(f"replicas.nats: expected a nats:// URL, got {_show(url)} "
                          "(fix: e.g. nats: nats://127.0.0.1:4222)")
    replica = sec.get_str("id", f"{socket.gethostname()}:{port}", "kvroute-1")
    window = sec.get_num("claim_window_s", CLAIM_WINDOW_S, zero=True)
    sec.finish(["nats", "id", "claim_window_s"])
    if importlib.util.find_spec("nats") is None:
        raise ConfigError("replicas: the NATS client is not installed "
                          "(fix: pip install 'kvroute[replicas]')")
    assert replica is not None
    return ReplicasConfig(url, replica, window)


def check_port_free(cfg: Config) -> None:
    """Raise ConfigError if the proxy's host:port cannot be bound right now."""
    for s in claim_port(cfg):
        s.close()


def claim_port(cfg: Config) -> list[socket.socket]:
    """Sockets bound, not yet listening, to every address proxy.host resolves to, as
    aiohttp's TCPSite binds them (a family the machine lacks, IPv6 switched off, is
    skipped as asyncio skips it); ConfigError if one cannot be bound, or none made.

    `serve` holds them from its start, so nothing takes the port while backends start
    (minutes on a first run), and a client gets "connection refused" until the proxy
    listens. Held, they let no one share their address: SO_REUSEADDR is off then (else
    another server setting it could bind and listen beside a socket that does not
    listen yet); `to_listen` turns it back on, as asyncio has it, just before."""
    host, port = cfg.proxy.host, cfg.proxy.port
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ConfigError(f"proxy.host: cannot resolve {host!r}: {e} "
                          "(fix: e.g. host: 127.0.0.1)") from None
    bound: list[socket.socket] = []
    try:
        for family, addr in dict.fromkeys((i[0], i[4]) for i in infos):
            s = _socket(family)
            if s is not None:
                bound.append(s)
                _bind(s, addr, host, port)
    except BaseException:
        for s in bound:
            s.close()
        raise
    if not bound:
        raise ConfigError(f"proxy.host: no address of {host!r} can be bound on this machine "
                          "(fix: e.g. host: 127.0.0.1)")
    return bound


def to_listen(sockets: list[socket.socket]) -> None:
    """Sockets from `claim_port`, about to listen: SO_REUSEADDR on again, as asyncio
    sets it (the connections they accept keep it, so a restart binds despite those in
    TIME_WAIT)."""
    for s in sockets:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)


def _socket(family: int) -> socket.socket | None:
    try:
        s = socket.socket(family, socket.SOCK_STREAM)
    except OSError:
        return None
    if family == socket.AF_INET6:
        try:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        except OSError:
            s.close()
            return None
    return s


def _bind(s: socket.socket, addr: Any, host: str, port: int) -> None:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free
    try:
        s.bind(addr)
    except OSError as e:
        why = "already in use" if e.errno == errno.EADDRINUSE else e.strerror
        raise ConfigError(
            f"proxy.port: {host}:{port} is {why} (fix: stop whatever listens there "
            "(another kvroute?), or pick another port with --port or proxy.port)"
        ) from None
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)  # held: shared with no one


def load_config(path: Path | None, *, check_port: bool = True,
                allow_missing_demo: bool = False, overrides: Mapping[str, Any] | None = None
                ) -> Config:
    """Load and validate `path` (None: the built-in default, same as config.yaml).

    `overrides` replaces ProxyConfig fields (the CLI's --host/--port/--policy) before the
    port check. `allow_missing_demo` lets `prepare`/`serve` load a config whose demo
    model they are about to build.
    """
    if path is None:
        data, base = yaml.safe_load(DEFAULT_PATH.read_text()), Path.cwd()
    else:
        data, base = _read_yaml(path)
    cfg = parse_config(data, base, allow_missing_demo=allow_missing_demo,
                       source=Path(path).resolve() if path else None)
    if overrides:
        merged = {k: v for k, v in overrides.items() if v is not None}
        port = merged.get("port", cfg.proxy.port)
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise ConfigError(f"--port: expected an integer in 1..65535, got {_show(port)} "
                              "(fix: e.g. --port 8080)")
        if merged.get("policy", cfg.proxy.policy) not in POLICIES:
            raise ConfigError(f"--policy: unknown policy {merged['policy']!r} "
                              f"(fix: one of {', '.join(POLICIES)})")
        cfg = replace(cfg, proxy=replace(cfg.proxy, **merged))
    if check_port:
        check_port_free(cfg)
    return cfg


def _read_yaml(path: Path) -> tuple[object, Path]:
    """The document and the directory its relative paths start from."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"--config: cannot read {path}: {e.strerror} "
                          "(fix: give an existing config file)") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e} (fix: correct the syntax)") from None
    return data, Path(path).resolve().parent

