"""`BackendInfo`: a ready backend, as the proxy needs it."""

from __future__ import annotations

from dataclasses import dataclass, field

from backends.config import LLAMA
from backends.dialect import Dialect, dialect_of
from backends.memory import DENSE, MemoryKind

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
    # media kinds it takes (vision, audio, video: /props modalities); none without --mmproj
    modalities: frozenset[str] = frozenset()
    # the global scale of each LoRA adapter (/lora-adapters) when it became ready
    lora: tuple[float, ...] = ()
    # each adapter's aLoRA invocation tokens (() for a plain adapter), by id
    alora: tuple[tuple[int, ...], ...] = ()
    media_marker: str = ""  # where its completion prompts put media (/props; "": unknown)

    @property
    def dialect(self) -> Dialect:
        """What it accepts and answers (backends/dialect.py)."""
        return dialect_of(self.kind)

