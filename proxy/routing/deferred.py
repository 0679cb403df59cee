"""The one decision whose slot model update waits (``Router.decide(defer=True)``).

The proxy calls ``decide(defer=True)`` and sends the request; the model's bookkeeping for
it (the modelled saves to RAM, the slot's new content in the tree) then runs while the
backend works, not before the request leaves. Every other call of the router applies a
waiting update first (`Deferred.apply`), so no decision ever sees the model without it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from proxy.routing.backend_state import BackendState
from proxy.routing.cache.lora import Lora
from proxy.routing.cache.values import Launch, Placement, from_disk
from proxy.routing.posting import Unposted
from proxy.routing.routed import Ledger


@dataclass(frozen=True)
class Unplaced:
    """A decision whose slot model update is deferred."""

    request_id: int
    backend: str
    pin: int | None  # the slot pinned, or None: the server's pick (predicted)
    prompt: bytes
    slot_lcp: dict[int, int]
    ram_lcp: dict[int, int]
    n: int
    predicted: Placement
    restore: bytes | None = None  # the slot is first given this sequence from disk
    user_starts: tuple[int, ...] = ()
    lora: Lora | None = None


class Deferred:
    """At most one update waiting; applying it may find another reuse than predicted (a
    save to RAM evicting other entries than modelled), which the request's record then
    says, and which its backend's load is charged for."""

    def __init__(self, backends: Mapping[str, BackendState], ledger: Ledger,
                 unposted: Unposted) -> None:
        self._backends, self._ledger, self._unposted = backends, ledger, unposted
        self._waiting: Unplaced | None = None

    def defer(self, u: Unplaced) -> None:
        self._waiting = u

    def forget_restore(self, rid: int) -> bool:
        """``rid``'s update, if it waits with a disk restore, is applied now on an empty
        slot instead (the restore failed: the server cleared the slot). False when it is
        not waiting."""
        u = self._waiting
        if u is None or u.request_id != rid or u.restore is None:
            return False
        self._waiting = replace(u, restore=b"")  # an empty slot: start reuses nothing
        self.apply()  # (which charges the prefill it adds)
        return True

    def apply(self) -> None:
        u, self._waiting = self._waiting, None
        if u is None:
            return
        f = self._ledger.get(u.request_id)
        st = self._backends.get(u.backend)
        if f is None or st is None:
            return
        if u.restore is not None and u.pin is not None:
            st.cache.restore(u.pin, u.restore)
            p = from_disk(st.cache.start(u.pin, u.prompt, u.slot_lcp, u.ram_lcp, u.n,
                                          launch=Launch(u.user_starts, u.lora)))
        else:
            p = st.cache.start(u.pin, u.prompt, u.slot_lcp, u.ram_lcp, u.n, u.predicted,
                               Launch(u.user_starts, u.lora))
        assert p is not None and p.slot == f.slot, "placed where predicted"
        f.wait_for(self._unposted.creator(u.request_id, u.backend, p.ram_entry))
        self._unposted.started(u.request_id, u.backend, st.cache.created, st.cache.starts)
        if (p.reuse, p.tier) != (u.predicted.reuse, u.predicted.tier):
            more = u.predicted.reuse - p.reuse  # tokens to prefill beyond the prediction
            st.work += more
            f.work += more
            st.busy_until += st.prefill_s(p.reuse, u.n) - st.prefill_s(u.predicted.reuse, u.n)
            st.expect_free(p.slot, f.started)
            f.revise(p.reuse, p.tier)
