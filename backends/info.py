"""What the supervisor knows of one backend: `BackendInfo`, a ready backend as the proxy
needs it, and `Backend`, the runtime record its supervising task keeps."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from backends.config import LLAMA, ExternalBackendConfig, ManagedBackendConfig
from backends.crash_loop import CrashLoop
from backends.dialect import Dialect, dialect_of
from backends.memory import DENSE, MemoryKind
from backends.process import LlamaServerProcess

MiB = 1 << 20


@dataclass(frozen=True)
class BackendInfo:
    """A ready backend, as the proxy needs it."""

    name: str
    url: str  # "http://127.0.0.1:PORT" (external: as configured)
    # key the proxy must send (Authorization: Bearer); kept out of repr: never logged
    api_key: str | None = field(repr=False)
    n_slots: int  # from /props total_slots
    slot_ctx: int  # from /props default_generation_settings.n_ctx
    ram_cache_bytes: int  # --cache-ram in bytes (0 if off/unknown)
    kv_bytes_per_token: int  # from GGUF metadata (managed) or the config (external)
    model: str  # model id/alias as /v1/models reports it
    managed: bool
    memory: MemoryKind = DENSE  # what the server can cut its cache back to
    kind: str = LLAMA  # OPENAI: speaks the OpenAI API only (no id_slot, /slots, /props)

    @property
    def dialect(self) -> Dialect:
        """What it accepts and answers (backends/dialect.py)."""
        return dialect_of(self.kind)


@dataclass
class Backend:
    """Mutable runtime state of one backend (owned by its task)."""

    cfg: ManagedBackendConfig | ExternalBackendConfig
    # held: up, kept out of routing until it outlasts its crash loop (backends/crash_loop.py)
    state: str = "stopped"  # starting | held | ready | down | failed | stopped
    info: BackendInfo | None = None
    process: LlamaServerProcess | None = None
    url: str | None = None
    restarts: int = 0
    last_error: str | None = None
    ready_since: float | None = None  # time.time() of the last transition to ready
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # first ready/failed
    task: asyncio.Task[None] | None = None
    agent: str | None = None  # the agent that runs it on another host (None: ours)
    crashes: CrashLoop | None = None  # a managed one's recent deaths

    @property
    def managed(self) -> bool:
        return isinstance(self.cfg, ManagedBackendConfig)
