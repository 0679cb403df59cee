"""What the supervisor is told about each backend, and the fleet as a whole.

Parsed from config.yaml (and an agent's file) by proxy/config/load.py; the supervisor
reads only what :class:`FleetSpec` names, so it does not depend on the proxy's own
configuration.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Protocol

from backends.demo_model import DemoModelParams


@dataclass(frozen=True)
class SupervisionConfig:
    startup_timeout_s: float = 120.0  # per backend, from spawn to /health 200
    health_interval_s: float = 2.0  # how often ready backends are probed
    restart_backoff_s: float = 0.5  # first restart delay; doubles per crash
    restart_backoff_max_s: float = 30.0
    stop_grace_s: float = 5.0  # SIGTERM -> SIGKILL
    # a backend that dies this often within crash_loop_window_s is in a crash loop: its
    # restarts wait from restart_backoff_max_s, doubling up to crash_loop_backoff_max_s,
    # and one is routed again once it stays up crash_loop_window_s (backends/crash_loop.py)
    crash_loop_deaths: int = 3
    crash_loop_window_s: float = 120.0
    crash_loop_backoff_max_s: float = 300.0


@dataclass(frozen=True)
class ManagedBackendConfig:
    name: str
    model: Path  # resolved GGUF path
    slots: int = 2  # llama-server -np
    ctx_per_slot: int = 8192  # -c is slots * ctx_per_slot
    threads: int = 1
    cache_ram_mib: int = 1024  # --cache-ram; 0 disables the host-RAM prompt cache
    alias: str | None = None  # -a: the model id /v1/models reports, its pool's name
    aliases: tuple[str, ...] = ()  # more names clients may send for its pool
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    is_demo: bool = False  # model is the demo model (prepare can build it)
    # what it offloads to: names `llama-server --list-devices` gives, or CUDA indices
    # (backends/devices.py); none: the build's default (all it finds)
    devices: tuple[str | int, ...] = ()
    # --mmproj: the multimodal projector (resolved path) that makes it serve images
    mmproj: Path | None = None
    # --lora: LoRA adapters (resolved paths), ids 0, 1, ... in this order, which requests
    # pick by their `lora` field and POST /lora-adapters scales for all
    lora: tuple[Path, ...] = ()


# what an external backend is
LLAMA = "llama"
OPENAI = "openai"
BACKEND_KINDS = (LLAMA, OPENAI)


@dataclass(frozen=True)
class ExternalBackendConfig:
    name: str
    url: str  # e.g. "http://10.0.0.5:8080"; kvroute health-checks it, never starts it
    api_key: str | None = field(default=None, repr=False)  # (a repr may reach a log)
    # KV bytes per token of the remote model; None: from proxy.tokenizer's GGUF (the
    # model kvroute tokenizes for is the one it serves), else EXTERNAL_KV_BYTES
    kv_bytes_per_token: int | None = None
    cache_ram_mib: int = 0  # what the remote was started with, if known
    # LLAMA: a llama-server (slots pinned by id_slot, /props, /slots). OPENAI: any server
    # of the OpenAI API (vLLM, SGLang, another kvroute): nothing of llama-server's is
    # asked or sent; its prefix cache, which it does not describe, is modelled as
    # `sequences` prompts of up to `ctx` tokens each, least recently used going first
    kind: str = LLAMA
    sequences: int = 32
    ctx: int = 131072
    # the pool it serves (the model name clients send); None: the first pool
    alias: str | None = None
    aliases: tuple[str, ...] = ()
    # the directory its --slot-save-path names, as kvroute sees it (the same on this
    # host, or where a shared file system is mounted here): the disk tier covers it
    slot_save_path: Path | None = None


BackendConfig = ManagedBackendConfig | ExternalBackendConfig
EXTERNAL_KV_BYTES = 131072  # an 8B-class f16 model: a remote model's size is unknowable


@dataclass(frozen=True)
class KvDiskConfig:
    """Slots saved to disk (llama-server --slot-save-path) and restored after a restart."""

    path: Path  # a directory of kvroute's own (0700), one file per saved slot
    max_gib: float = 8.0  # the files' budget: the oldest saves go first
    save_after_idle_s: float = 1.0  # a slot idle this long after a turn is saved
    min_tokens: int = 256  # smaller contents are cheaper to recompute than to keep

    def __post_init__(self) -> None:
        # a budget of nothing would write every save and delete it at once
        if not self.max_gib > 0:
            raise ValueError(f"kv_disk.max_gib: must be positive, got {self.max_gib}")
        if not self.save_after_idle_s >= 0:
            raise ValueError("kv_disk.save_after_idle_s: must be >= 0, got "
                             f"{self.save_after_idle_s}")
        if self.min_tokens < 0:
            raise ValueError(f"kv_disk.min_tokens: must be >= 0, got {self.min_tokens}")


@dataclass(frozen=True)
class AgentLink:
    """An agent (`kvroute agent` on another host) a router takes backends from."""

    name: str  # its backends are "<name>/<backend>" here (default: the URL's host:port)
    url: str  # e.g. "http://10.0.0.5:8090"
    key: str = field(repr=False)  # what it asks of routers (Authorization: Bearer)
    poll_interval_s: float = 2.0  # how often its /backends is asked


@dataclass(frozen=True)
class AgentSettings:
    """Where an agent listens, and where routers reach the llama-servers it starts."""

    key: str = field(repr=False)  # routers present it as Bearer to GET /backends
    host: str = "127.0.0.1"  # the agent and its llama-servers listen here
    port: int = 8090
    advertise: str = "127.0.0.1"  # the host name or address routers reach them at


@dataclass(frozen=True)
class AgentConfig:
    """An agent's file: the managed backends of its host (the FleetSpec it supervises)."""

    agent: AgentSettings
    backends: tuple[ManagedBackendConfig, ...]
    llama_server: str | None
    log_dir: Path
    demo_model: DemoModelParams = field(default_factory=DemoModelParams)
    supervision: SupervisionConfig = field(default_factory=SupervisionConfig)
    source: Path | None = None
    # what a FleetSpec has that an agent does not: a slot saved on the agent's disk could
    # not be seen by the routers that restore it, nor can an agent have agents
    kv_disk: KvDiskConfig | None = None
    tokenizer: Path | None = None
    agents: tuple[AgentLink, ...] = ()

    def managed(self) -> tuple[ManagedBackendConfig, ...]:
        return self.backends

    def gguf_of(self, backend: str) -> Path | None:
        return next((b.model for b in self.backends if b.name == backend), None)


class FleetSpec(Protocol):
    """The configuration a Supervisor runs from (proxy.config.load.Config is one)."""

    @property
    def backends(self) -> tuple[BackendConfig, ...]: ...
    @property
    def llama_server(self) -> str | None: ...
    @property
    def log_dir(self) -> Path: ...
    @property
    def supervision(self) -> SupervisionConfig: ...
    @property
    def tokenizer(self) -> Path | None: ...
    @property
    def kv_disk(self) -> KvDiskConfig | None: ...
    @property
    def agents(self) -> tuple[AgentLink, ...]: ...
    def managed(self) -> tuple[ManagedBackendConfig, ...]: ...
    def gguf_of(self, backend: str) -> Path | None:
        """The GGUF of the model ``backend`` serves, as far as the configuration says."""
        ...
