"""The cache model's value types: a slot as the model sees it, a backend's capacity, the
server's rules, how a prompt is launched, and where a request lands (`Placement`).

proxy/routing/cache/predict.py answers where a request would land, and
proxy/routing/cache/model.py applies it; both speak in these types.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from proxy.routing.cache.checkpoints import DENSE, Checkpoints, Memory
from proxy.routing.cache.lora import Invocations, Lora, Scales

SLOT = 0
RAM = 1
DISK = 3  # a slot saved to disk (router-level: the backends of its model may restore it)
# The server may not keep the last generated token(s): a prompt that matches a slot's
# sequence to within this many tokens of its end goes on from it
CONTINUATION_SLACK = 4

CacheHolder = tuple[str, int, int]  # a tree holder of this model: (backend, kind, index)


@dataclass
class Slot:
    """What the model believes one server slot holds."""

    busy: bool = False
    n_tokens: int = 0  # tokens the server holds in this slot
    last_used: int = -1  # logical clock; -1 = never used (picked first by LRU)
    ram_copy: int | None = None  # RAM entry saved from this content (valid while in RAM)
    prompt: bytes | None = None  # while busy: the prompt it started with (finish extends it)
    checkpoints: Checkpoints = ()  # context checkpoints (checkpointed memory only)
    floor: int = 0  # oldest position a restore or a RAM load left in its memory
    lora: Scales = ()  # the adapters its last request ran under (none yet: no set)


@dataclass(frozen=True)
class BackendCapacity:
    name: str
    n_slots: int
    slot_ctx: int  # tokens per slot
    ram_cache_bytes: int  # 0 = no RAM tier
    kv_bytes_per_token: int
    memory: Memory = DENSE  # how the server can cut the KV back (checkpoints)
    lora: Scales = ()  # its LoRA adapters' global scales (/lora-adapters) when it started
    alora: Invocations = ()  # each adapter's aLoRA invocation tokens (() for a plain one)

    def entry_bytes(self, n_tokens: int, n_checkpoints: int = 0) -> int:
        """Bytes of a RAM entry of ``n_tokens`` as the server counts them
        (llama_state_seq_get_size): the KV of each token, each cell's position, sequence
        count and sequence id (3 x 4 bytes), and a header (stream and cell counts, then a
        type and row size per layer and K/V: a few hundred bytes, taken as 256); on a
        sliding-window or hybrid model also the state that cannot be cut back, and as
        much again for each of the entry's context checkpoints."""
        return (n_tokens * (self.kv_bytes_per_token + 12) + 256
                + self.memory.partial_bytes * (1 + n_checkpoints))

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name: must be non-empty")
        if self.n_slots < 1:
            raise ValueError("n_slots: must be >= 1")
        if self.slot_ctx < 2:
            raise ValueError("slot_ctx: must be >= 2")
        if self.ram_cache_bytes < 0:
            raise ValueError("ram_cache_bytes: must be >= 0")
        if self.kv_bytes_per_token < 1:
            raise ValueError("kv_bytes_per_token: must be >= 1")


@dataclass(frozen=True)
class ServerRules:
    """llama-server constants this model mirrors (defaults of the pinned build)."""

    keep_threshold: float = 0.5  # below this kept fraction the slot state is saved to RAM
    ram_min_share: float = 0.25  # a RAM entry must share this fraction of its own tokens
    slot_similarity: float = 0.10  # --slot-prompt-similarity for unpinned requests
    cache_idle_slots: bool = True  # --cache-idle-slots: save idle slots when a task starts
    kv_unified: bool = False  # --kv-unified (auto -np): idle slots are cleared once saved


class Launch(NamedTuple):
    """How the server runs a prompt, beyond its ids."""

    user_starts: Sequence[int] = ()  # where its user messages start (it checkpoints there)
    lora: Lora | None = None  # the LoRA adapters it names (None: the global scales)


PLAIN = Launch()


class Placement(NamedTuple):  # not a frozen dataclass: its __init__ is ~4x slower
    """Where a request lands on one backend and what it reuses."""

    slot: int  # slot the request runs in
    reuse: int  # tokens reused (<= prompt - 1)
    tier: str  # "slot" | "ram" | "none"
    ram_entry: int | None  # RAM entry loaded into the slot, if any
    displaced: int  # tokens of the slot's previous content moved out to RAM (when saved)
    saved: bool = False  # the server saves the slot's state to RAM before using it
    destroyed: int = 0  # tokens of the previous content lost for good (held nowhere else)
    # the RAM entry it loads was made under other adapters than it runs under, into a
    # slot the server keeps (it looks at neither): sent with cache_prompt false, it
    # reuses nothing rather than run over that KV
    recompute: bool = False
    # tokens the slot held before: the displaced and destroyed ones are the last of them
    # (what they cost to prefill again depends on their positions)
    held: int = 0


def from_disk(p: Placement | None) -> Placement | None:
    """A placement in a slot just restored from disk: what it reuses came from disk."""
    return p._replace(tier="disk") if p is not None and p.tier == "slot" else p
