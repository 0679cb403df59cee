"""A request through the cache model alone, as the tests of its rules step it: predicted,
then applied (the two must agree), then finished with one answer token (7)."""

from __future__ import annotations

from proxy.routing.cache.lora import Lora
from proxy.routing.cache.model import BackendCache
from proxy.routing.cache.values import SLOT, Launch, Placement
from proxy.routing.tree.token_bytes import to_token_bytes


def run(c: BackendCache, prompt: list[int], lora: Lora | None, slot: int | None = 0
        ) -> Placement:
    held = c.tree.match(prompt).held
    slot_lcp = {i: n for (_, kind, i), n in held.items() if kind == SLOT}  # type: ignore[misc]
    ram_lcp = {i: n for (_, kind, i), n in held.items() if kind != SLOT}  # type: ignore[misc]
    q = to_token_bytes(prompt)
    want = c.predict(slot, slot_lcp, ram_lcp, len(prompt), lora=lora, prompt=q)
    p = c.start(slot, q, slot_lcp, ram_lcp, len(prompt), launch=Launch((), lora))
    assert p is not None and want is not None and p.reuse == want.reuse
    c.finish(p.slot, to_token_bytes([*prompt, 7]), len(prompt) + 1)
    return p
