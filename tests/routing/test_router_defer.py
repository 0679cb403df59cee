"""`Router.decide(defer=True)` + `place()`: the proxy's order (the slot model updated once
the request is written) routes exactly as deciding with the update applied at once."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from proxy.routing.cache.values import BackendCapacity
from proxy.routing.decision import Handoff, Report
from proxy.routing.routed import Routed
from proxy.routing.router import Router
from proxy.routing.settings import RouterSettings
from proxy.routing.tree.token_bytes import to_token_bytes

# (op, a, b): decide (a: conversation, b: new tokens), complete / abort (a: which live
# request), place (a: which live request)
Op = tuple[str, int, int]
OPS = st.lists(st.tuples(st.sampled_from(["decide", "decide", "complete", "abort", "place"]),
                         st.integers(0, 4), st.integers(1, 30)), min_size=1, max_size=40)
# Small RAM tiers (8 KiB per token): saves evict often, the case where `place` may find
# another reuse than `decide` predicted.
RAM_TOKENS = st.sampled_from([0, 60, 100, 250, 1 << 17])

# Found by a random search over these ops: the slot saved to make room drops a RAM entry
# that is a prefix of it, so the LRU evicts less than `decide` foresaw, and the prompt
# loads an entry predicted gone.
RECONCILED: list[Op] = [
    ("decide", 2, 15), ("decide", 1, 14), ("complete", 4, 28), ("complete", 0, 18),
    ("decide", 3, 9), ("decide", 2, 23), ("complete", 1, 4), ("decide", 1, 22),
]


class _Run:
    """One router driven by ops; `defer` routers are placed when the op (or the end) says."""

    def __init__(self, defer: bool, slots: int, ram_tokens: int,
                 settings: RouterSettings | None = None) -> None:
        self.r = Router(settings=settings)
        self.defer = defer
        for name in ("a", "b"):
            self.r.add_backend(BackendCapacity(name, slots, 4096, ram_tokens * 8192, 8192))
        self.live: list[tuple[Routed, int, list[int]]] = []
        self.history: dict[int, list[int]] = {}
        self.changed = 0  # placements that found another reuse than predicted
        self.seen: dict[int, object] = {}  # each request's prediction as last seen
        self.t = 0

    def step(self, op: Op) -> list[Handoff] | Routed | None:
        kind, a, b = op
        self.t += 1
        now = self.t * 0.1
        if kind == "decide":
            head = self.history.get(a, [1, 2, 3] + [100 + a] * (10 + 4 * a))
            prompt = head + [5000 + 97 * self.t + i for i in range(b)]
            d = self.r.decide(prompt, now=now, session=f"s{a}", defer=self.defer)
            assert isinstance(d, Routed)
            self.live.append((d, a, prompt))
            self.seen[d.request_id] = d.prediction
            return d
        if not self.live:
            return None
        i = a % len(self.live)
        d, conv, prompt = self.live[i]
        if kind == "place":
            self.live[i] = (self._place(d), conv, prompt)
            return None
        del self.live[i]
        d = self._place(d)
        if kind == "abort":
            return self.r.abort(d, now=now)
        out = [7000 + self.t, 7001, 7002]
        self.history[conv] = prompt + out
        return self.r.complete(d, Report(output_tokens=out, reported_cached=d.predicted_cached,
                                         prompt_ms=5.0, prompt_n=d.prompt_tokens), now=now)

    def _place(self, d: Routed) -> Routed:
        self.r.place(d)
        self.changed += d.prediction != self.seen[d.request_id]
        self.seen[d.request_id] = d.prediction
        return d

    def hand_off(self, handoffs: list[Handoff]) -> None:
        for h in handoffs:  # as the proxy does: sent pinned where the hand-off says
            d = next(x[0] for x in self.live if x[0].request_id == h.request_id)
            assert (d.slot, d.predicted_cached) == (h.slot, h.predicted_cached)
            self.seen[d.request_id] = d.prediction


def _view(d: Routed) -> tuple[object, ...]:
    return (d.request_id, d.backend, d.slot, d.predicted_cached, d.tier, d.queued,
            d.prompt_tokens)


def _both(ops: list[Op], slots: int, ram_tokens: int,
          settings: RouterSettings | None = None) -> tuple[_Run, _Run]:
    now_r = _Run(False, slots, ram_tokens, settings)
    later_r = _Run(True, slots, ram_tokens, settings)
    for op in ops:
        a, b = now_r.step(op), later_r.step(op)
        if isinstance(a, Routed):
            assert isinstance(b, Routed) and (b.request_id, b.backend, b.slot, b.queued) \
                == (a.request_id, a.backend, a.slot, a.queued)
        elif isinstance(a, list):
            assert a == b
            now_r.hand_off(a)
            later_r.hand_off(a)
    for (a, _, _), (b, _, _) in zip(now_r.live, later_r.live, strict=True):
        assert _view(a) == _view(later_r._place(b))
    assert now_r.r.snapshot() == later_r.r.snapshot()
    return now_r, later_r


@settings(max_examples=200, deadline=None)
@given(ops=OPS, ram_tokens=RAM_TOKENS, slots=st.integers(1, 3))
@example(ops=RECONCILED, ram_tokens=100, slots=2)
def test_deferred_placement_routes_as_immediate(ops: list[Op], ram_tokens: int,
                                                slots: int) -> None:
    _both(ops, slots, ram_tokens)


def test_place_returns_the_reuse_the_model_found_when_it_differs() -> None:
    # the weights the sequence was found with: they decide which slots it displaces
    _, later = _both(RECONCILED, 2, 100, RouterSettings(displace_weight=0.02))
    assert later.changed == 1  # the example above does exercise the reconciliation


def test_place_is_idempotent_and_any_later_call_applies_it() -> None:
    r = Router()
    r.add_backend(BackendCapacity("a", 2, 4096, 1 << 30, 8192))
    d = r.decide(list(range(50)), now=0.0, defer=True)
    assert isinstance(d, Routed)
    # not applied yet: the slot does not hold the prompt
    assert not r.tree.match(list(range(50))).held
    # the next decision applies it first: the same prompt again finds the first one
    # in its (busy) slot, not an empty model
    e = r.decide([*range(50), 9], now=0.0, defer=True)
    assert isinstance(e, Routed) and r.tree.match(list(range(50))).held
    assert e.slot != d.slot
    assert r.place(d) == r.place(d) == d


def test_a_failed_restore_is_predicted_as_a_prefill() -> None:
    """A slot given a file from disk first is predicted to reuse it; if the restore
    fails (the server clears the slot), the request reuses nothing, and the model's slot
    holds its prompt afterwards as the server's does."""
    for applied in (False, True):
        r = Router("prefix")
        r.add_backend(BackendCapacity("a", 1, 8192, 0, 8192))
        history = list(range(100, 1100))
        r.disk.add(0, "kvroute-0.bin", to_token_bytes(history), frozenset({"a"}))
        prompt = history + list(range(5000, 5040))
        d = r.decide(prompt, defer=True)
        assert isinstance(d, Routed) and d.restore == "kvroute-0.bin"
        assert d.tier == "disk" and d.predicted_cached == 1000
        if applied:  # another decision applied the model's update meanwhile
            r.snapshot()
        failed = r.restore_failed(d)
        assert (failed.predicted_cached, failed.tier, failed.restore) == (0, "none", None)
        assert r.place(failed).predicted_cached == 0
        # the whole prompt is prefill work now (and the slot held nothing before it)
        backend = r.snapshot()["backends"]["a"]  # type: ignore[index]
        assert backend["work_tokens"] == len(prompt) + r.settings.request_overhead_tokens
        assert r.held("a", 0) is None  # busy: it holds this request's prompt
        r.complete(failed, Report(output_tokens=[1, 2], reported_cached=0, prompt_ms=100.0,
                                  prompt_n=len(prompt), reported_slot=0), now=1.0)
        assert r.held("a", 0) == to_token_bytes([*prompt, 1, 2])


def test_a_queued_request_is_handed_its_slot_with_the_file_that_holds_its_prefix() -> None:
    """Every slot busy: a turn whose conversation only the disk tier holds is queued;
    when a slot frees it is handed the slot with that file to restore first, predicted
    from disk, and what the slot held (the turn that just ended) goes with it, for the
    disk tier to save before the restore replaces it."""
    r = Router("prefix")
    r.add_backend(BackendCapacity("a", 1, 8192, 0, 8192))
    history = list(range(100, 1100))
    r.disk.add(0, "kvroute-0.bin", to_token_bytes(history), frozenset({"a"}))
    r.disk.spills("a")
    other = list(range(20_000, 20_600))
    busy = r.decide(other, now=0.0)
    assert isinstance(busy, Routed) and not busy.queued
    turn = r.decide([*history, *range(5000, 5040)], now=0.1)
    assert isinstance(turn, Routed) and turn.queued and turn.restore is None
    (h,) = r.complete(busy, Report(output_tokens=[7], reported_cached=0), now=1.0)
    assert (h.request_id, h.slot, h.restore, h.tier) == (turn.request_id, 0,
                                                         "kvroute-0.bin", "disk")
    assert h.predicted_cached == len(history)
    assert h.displaced == to_token_bytes([*other, 7])
    # the record says where the hand-off sends it
    assert (turn.slot, turn.predicted_cached, turn.tier, turn.restore) == (
        h.slot, h.predicted_cached, h.tier, h.restore)
    done = r.complete(turn, Report(output_tokens=[9], reported_cached=len(history)), now=2.0)
    assert done == [] and r.mispredictions == 0
    assert r.held("a", 0) == to_token_bytes([*history, *range(5000, 5040), 9])


def test_a_hand_off_whose_file_holds_the_slot_already_spills_nothing() -> None:
    """The slot holds an earlier point of the conversation the restored file holds: it
    is on disk already, so the hand-off does not ask for it to be saved again."""
    r = Router("prefix")
    r.add_backend(BackendCapacity("a", 1, 8192, 0, 8192))
    history = list(range(100, 1100))
    r.disk.add(0, "kvroute-0.bin", to_token_bytes(history), frozenset({"a"}))
    r.disk.spills("a")
    early = r.decide(history[:500], now=0.0)
    assert isinstance(early, Routed) and not early.queued
    turn = r.decide([*history, *range(5000, 5040)], now=0.1)
    assert isinstance(turn, Routed) and turn.queued
    (h,) = r.complete(early, Report(output_tokens=[], reported_cached=0), now=1.0)
    assert (h.restore, h.tier, h.predicted_cached) == ("kvroute-0.bin", "disk", 1000)
    assert h.displaced is None


def test_a_hand_off_carries_the_slot_only_where_a_disk_tier_spills() -> None:
    """A backend without a disk tier (no ``disk_spills``): its hand-offs carry nothing
    of what the slot held; one whose tier spills gets it."""
    for spills in (False, True):
        r = Router("prefix")
        r.add_backend(BackendCapacity("a", 1, 8192, 0, 8192))
        r.disk.spills("a")
        r.disk.spills("a", spills)  # (told again when the backend comes back another)
        other = list(range(20_000, 20_600))
        busy = r.decide(other, now=0.0)
        queued = r.decide(list(range(100, 1100)), now=0.1)
        assert isinstance(busy, Routed) and isinstance(queued, Routed) and queued.queued
        (h,) = r.complete(busy, Report(output_tokens=[7], reported_cached=0), now=1.0)
        assert h.displaced == (to_token_bytes([*other, 7]) if spills else None)


def test_a_peers_queued_request_is_not_handed_a_restore() -> None:
    """The replica that routed a request restores for it, if at all: handed a slot
    here, a peer's queued request is placed without the file."""
    r = Router("prefix")
    r.add_backend(BackendCapacity("a", 1, 8192, 0, 8192))
    history = list(range(100, 1100))
    r.disk.add(0, "kvroute-0.bin", to_token_bytes(history), frozenset({"a"}))
    busy = r.decide(list(range(20_000, 20_600)), now=0.0)
    assert isinstance(busy, Routed)
    peer = r.observe_start("a", 0, to_token_bytes([*history, 1]), now=0.1, wait=True)
    assert peer is not None
    handed = r.complete(busy, Report(output_tokens=[7], reported_cached=0), now=1.0)
    assert all(h.restore is None for h in handed)
    assert r.held("a", 0) is None  # the peer's request runs there, from nothing


def test_another_replicas_request_is_placed_as_if_routed_here() -> None:
    """Replica b learns that replica a's request left a conversation in slot 0: b's next
    turn of it is predicted from there; a slot busy with b's own request is left alone."""
    a, b = Router("prefix"), Router("prefix")
    for r in (a, b):
        r.add_backend(BackendCapacity("x", 2, 8192, 0, 8192))
    history = list(range(100, 1100))
    d = a.decide(history, now=0.0)
    assert isinstance(d, Routed) and d.slot is not None
    a.complete(d, Report(output_tokens=[7, 8], reported_cached=0), now=1.0)
    held = a.held("x", d.slot)
    assert held is not None and b.observe("x", d.slot, held, now=1.0)
    assert b.held("x", d.slot) == held
    turn = b.decide([*history, 7, 8, *range(5000, 5040)], now=2.0)
    assert isinstance(turn, Routed)
    assert (turn.slot, turn.tier, turn.predicted_cached) == (d.slot, "slot", 1002)
    # b's own request is on that slot now: another replica's word does not move it
    assert not b.observe("x", d.slot, held, now=2.0)
    assert not b.observe("y", 0, held) and not b.observe("x", 9, held)
