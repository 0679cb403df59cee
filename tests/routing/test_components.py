"""The router's components on their own: the ledger, the disk index, peers' requests, the
deferred update. (Their work inside the router: test_router*.py, test_waiters.py.)"""

from __future__ import annotations

import pytest

from proxy.routing.backend_state import BackendState
from proxy.routing.cache.model import BackendCache
from proxy.routing.cache.values import DISK, SLOT, BackendCapacity, Placement
from proxy.routing.deferred import Deferred, Unplaced
from proxy.routing.disk import DiskIndex
from proxy.routing.observed import PeerRequests
from proxy.routing.posting import Unposted
from proxy.routing.routed import Inflight, Ledger
from proxy.routing.settings import RouterSettings
from proxy.routing.tree.radix import RadixTree
from proxy.routing.tree.token_bytes import to_token_bytes


def entry(backend: str = "a", slot: int | None = 0, observed: bool = False) -> Inflight:
    return Inflight(backend, slot, to_token_bytes([1, 2, 3]), 3, 3, 0.0, observed=observed)


def state(tree: RadixTree, name: str = "a", slots: int = 2) -> BackendState:
    cache = BackendCache(BackendCapacity(name, slots, 4096, 0, 8192), tree,
                         RouterSettings().rules)
    return BackendState(cache, rate=1000.0)


def test_the_ledger_gives_ids_in_order_and_ends_entries_once() -> None:
    led = Ledger()
    ids = [led.new_id() for _ in range(3)]
    assert ids == [0, 1, 2]
    a, b = led.add(0, entry("a")), led.add(1, entry("b"))
    led.add(2, entry("a", 1))
    assert [rid for rid, _ in led.on("a")] == [0, 2] and len(led) == 3
    led.end(0)
    assert not a.live and b.live and led.get(0) is None and len(led) == 2
    with pytest.raises(KeyError):
        led.end(0)


@pytest.mark.parametrize(("disk_tokens", "slot_reuse", "kind", "may", "gains"), [
    (600, 0, "dense", True, True),       # 600 more than the slot: worth a restore
    (600, 400, "dense", True, False),    # 200 more: under disk_min_gain_tokens (256)
    (600, 0, "dense", False, False),     # the backend may not restore that file
    (600, 0, "checkpointed", True, False),  # a checkpointed backend: never
    (600, 0, "adapters", True, False),   # one with LoRA adapters: never
])
def test_the_disk_index_restores_only_what_gains_enough(
        disk_tokens: int, slot_reuse: int, kind: str, may: bool, gains: bool) -> None:
    tree = RadixTree()
    st = state(tree)
    if kind == "checkpointed":
        st.cache.checkpointed = True  # type: ignore[misc]
    if kind == "adapters":
        st.cache.lora_global = (1.0,)
    disk = DiskIndex(tree, RouterSettings(), {"a": st})
    assert not disk
    seq = to_token_bytes(range(disk_tokens))
    disk.add(7, "kvroute-7.bin", seq, frozenset({"a"} if may else {"b"}))
    assert disk
    held = {("", DISK, 7): disk_tokens}
    p = Placement(0, slot_reuse, "slot", None, 0, False, 0)
    got = disk.gain(held, p, disk_tokens + 10, "a")
    assert (got == ("kvroute-7.bin", seq, disk_tokens)) if gains else got is None
    disk.drop(7)
    assert not disk and tree.match(seq).held == {}


def test_the_disk_index_says_which_backends_spill() -> None:
    disk = DiskIndex(RadixTree(), RouterSettings(), {})
    disk.spills("a")
    assert disk.spilling("a") and not disk.spilling("b")
    disk.spills("a", False)
    assert not disk.spilling("a")


class Heard:
    def __init__(self) -> None:
        self.events: list[tuple[object, ...]] = []

    def prefilled(self, backend: str, request: int) -> None:
        self.events.append(("prefilled", backend, request))

    def freed(self, backend: str, slot: int, request: int, held: bytes | None) -> None:
        self.events.append(("freed", backend, slot, request))

    def withdrawn(self, backend: str, request: int) -> None:
        self.events.append(("withdrawn", backend, request))


def test_peers_tell_the_listener_of_this_replica_s_requests_only() -> None:
    led = Ledger()
    st = state(RadixTree())
    peers = PeerRequests({"a": st}, led)
    heard = Heard()
    peers.listener = heard
    own, other = led.add(0, entry()), led.add(1, entry(observed=True))
    for f, rid in ((own, 0), (other, 1)):
        peers.told_prefilled(f, rid)
        peers.told_freed(f, 0, rid)
    peers.told_freed(own, None, 0)  # where it ended is not known: nothing to tell
    assert heard.events == [("prefilled", "a", 0), ("freed", "a", 0, 0)]


def test_peers_waiters_are_served_before_this_replica_s() -> None:
    led = Ledger()
    led.add(0, entry(slot=None))
    led.add(1, entry(slot=None, observed=True))
    led.add(2, entry(slot=None))
    peers = PeerRequests({}, led)
    assert peers.waiters_first({0: 1, 1: 1, 2: 0}) == [(1, 1), (0, 1), (2, 0)]


def test_a_deferred_update_runs_once_and_only_for_a_live_entry() -> None:
    tree = RadixTree()
    st = state(tree)
    led = Ledger()
    deferred = Deferred({"a": st}, led, Unposted())
    q = to_token_bytes(range(40))
    p = st.cache.predict(0, {}, {}, 40)
    assert p is not None
    led.add(0, Inflight("a", 0, q, 40, 40, 0.0))
    deferred.defer(Unplaced(0, "a", 0, q, {}, {}, 40, p))
    assert not tree.match(q).held
    deferred.apply()
    assert tree.match(q).held == {("a", SLOT, 0): 40}
    starts = st.cache.starts
    deferred.apply()  # nothing waits: a no-op
    assert st.cache.starts == starts
    led.end(0)
    deferred.defer(Unplaced(0, "a", 1, q, {}, {}, 40, p))
    deferred.apply()  # its request ended meanwhile: nothing to place
    assert st.cache.starts == starts
    assert not deferred.forget_restore(0)
