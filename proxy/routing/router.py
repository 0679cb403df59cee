"""The routing facade driven by both the simulator and the live proxy.

Pure and synchronous: no I/O, no asyncio, no clock (callers pass ``now``). One
:class:`Router` owns the token tree, one cache model per backend and the policy state.

Life of a request: ``decide()`` returns its live record (`Routed`, proxy/routing/routed.py)
-> (proxy forwards with ``id_slot``) -> ``complete()`` or ``abort()`` on the record.
``decide`` records its choice in the tree at once (fallbacks included), so affinity starts
with the first request of a conversation.

``decide(defer=True)`` leaves the slot model's update to ``place()``, which the proxy
calls once the request is written to its backend (proxy/routing/deferred.py).

Router itself owns membership and ``decide``; its components own the rest, each its own
state: the requests in flight (`Ledger`, routed.py), a decision booked on its backend
(`Booking`, booking.py), the update deferred (deferred.py), the disk tier (`DiskIndex`,
disk.py), the requests held for a slot (`SlotQueue`, queue.py), other replicas'
requests (`PeerRequests`, observed.py) and what the router learns as a request goes
and ends (`RequestEnds`, outcomes.py).
"""

from __future__ import annotations

from array import array
from collections.abc import Collection, Sequence

from proxy.routing.backend_state import BackendState, peer_rate, share_rate
from proxy.routing.booking import Booking, Prompt, is_claim
from proxy.routing.cache.lora import Lora, Scales
from proxy.routing.cache.model import BackendCache
from proxy.routing.cache.values import PLAIN, BackendCapacity, Launch
from proxy.routing.decision import (
    Decision,
    Handoff,
    NeedWholePrompt,
    NoBackend,
    NoBackendKind,
    Report,
)
from proxy.routing.deferred import Deferred
from proxy.routing.disk import DiskIndex
from proxy.routing.head import most_held, rest_may_change
from proxy.routing.observed import PeerRequests
from proxy.routing.outcomes import RequestEnds
from proxy.routing.policies import Ask, make_policy
from proxy.routing.policy import Choice
from proxy.routing.posting import Unposted
from proxy.routing.queue import SlotQueue
from proxy.routing.routed import Ledger, Prior, Routed
from proxy.routing.settings import RouterSettings
from proxy.routing.tree.radix import RadixTree
from proxy.routing.tree.token_bytes import to_token_bytes

__all__ = [
    "BackendCapacity",
    "Decision",
    "Handoff",
    "NeedWholePrompt",
    "NoBackend",
    "NoBackendKind",
    "Report",
    "Routed",
    "Router",
    "RouterSettings",
]


NOTHING_REPORTED = Report()


class Router:
    def __init__(
        self, policy: str = "prefix", *, settings: RouterSettings | None = None, seed: int = 0
    ) -> None:
        self.settings = s = settings or RouterSettings()
        self._policy = make_policy(policy, s, seed)
        self.tree = RadixTree(max_resident=s.max_resident_tokens)
        self._backends: dict[str, BackendState] = {}
        self._ledger = Ledger()
        self._unposted = Unposted()
        self._deferred = Deferred(self._backends, self._ledger, self._unposted)
        self.disk = DiskIndex(self.tree, s, self._backends)
        self.peers = PeerRequests(self._backends, self._ledger)
        self._queue = SlotQueue(self.tree, self._ledger, self._policy, self.disk, self.peers, s,
                                self._unposted)
        self._spread = (0, 1)  # (see spread)
        self._ends = RequestEnds(self._backends, self._ledger, self._deferred, self._queue,
                                 self.peers, s, self._unposted)
        self._booking = Booking(self.tree, self._backends, self._ledger, self._deferred,
                                self._unposted, s, self)

    def spread(self, rank: int, replicas: int) -> None:
        """This router is replica ``rank`` of ``replicas`` sharing the backends: of the
        empty slots of a backend, it takes first those from ``rank / replicas`` of the
        way along, so that replicas starting conversations at the same moment (neither
        seeing the other's yet) take different ones."""
        self._spread = (rank, max(1, replicas))
        for st in self._backends.values():
            st.empty_from = rank * len(st.cache.slots) // max(1, replicas)

    @property
    def policy(self) -> str:
        return self._policy.name

    @property
    def backends(self) -> list[str]:
        return list(self._backends)

    # ------------------------------------------------------------- membership
    def add_backend(self, cap: BackendCapacity) -> None:
        """Add a backend, or reset it (fresh and empty) when it comes back healthy."""
        self._deferred.apply()
        if cap.name in self._backends:
            self.remove_backend(cap.name)
        cache = BackendCache(cap, self.tree, self.settings.rules,
                             max_tracked=self.settings.ram_entries_tracked,
                             track_min_tokens=self.settings.ram_track_min_tokens)
        rate = peer_rate(self._backends.values(), self.settings.default_prefill_tps)
        rank, replicas = self._spread
        self._backends[cap.name] = BackendState(
            cache, rate=rate, empty_from=rank * cap.n_slots // replicas)
        share_rate(self._backends.values(), self.settings.default_prefill_tps)

    def remove_backend(self, name: str) -> None:
        """Forget everything a dead or unhealthy backend held."""
        self._deferred.apply()
        st = self._backends.pop(name, None)
        if st is None:
            return
        st.cache.clear()
        for rid, f in self._ledger.on(name):
            self._ledger.end(rid)
            self._unposted.posted(rid)
            self.peers.told_freed(f, f.slot, rid)

    def set_adapters(self, name: str, scales: Scales) -> None:
        """``name``'s global LoRA scales are now ``scales`` (`POST /lora-adapters`: what
        its slots hold is not cleared)."""
        st = self._backends.get(name)
        if st is not None:
            st.cache.lora_global = scales

    def adapters(self, name: str) -> Scales:
        """``name``'s global LoRA scales as the router knows them ((): none, or no backend)."""
        st = self._backends.get(name)
        return () if st is None else st.cache.lora_global

    @property
    def wants_user_starts(self) -> bool:
        """Does a backend checkpoint where user messages start (see ``decide``)?"""
        return any(st.cache.checkpointed for st in self._backends.values())

    # --------------------------------------------------------------- decision
    def decide(
        self,
        tokens: Sequence[int] | array | bytes,
        *,
        session: str | None = None,
        now: float = 0.0,
        n_prompt: int | None = None,
        defer: bool = False,
        among: Collection[str] | None = None,
        launch: Launch = PLAIN,
    ) -> Routed | NoBackend | NeedWholePrompt:
        """Route one prompt. ``tokens``: ids as a list or ``array('i')``, or already as
        native int32 bytes (the tree's format, see proxy/routing/tree/token_bytes.py).

        ``n_prompt``: ``tokens`` is only the head of the prompt, whose whole length is
        estimated at ``n_prompt``; ``extend`` gives the rest once it is tokenized, unless
        the answer is ``NeedWholePrompt``.

        ``defer``: leave the slot model's update to ``place`` (see the module doc).

        ``among``: the backends that may serve it (None: any).

        ``launch``: the positions where the server finds a user message starting (it
        checkpoints there on sliding-window and hybrid models), and the LoRA adapters
        it names (None: no `lora` field; see proxy/routing/cache/lora.py)."""
        user_starts, lora = tuple(launch.user_starts), launch.lora
        self._deferred.apply()
        q = to_token_bytes(tokens)
        n = len(q) // 4
        head = n_prompt is not None and n_prompt > n
        if head:
            n = n_prompt  # type: ignore[assignment]
        found = self._booking.candidates(q, n, head, among, lora)
        if not isinstance(found, tuple):
            return found
        cands, held = found
        choice = self._policy.choose(cands, Ask(n, now, session, len(q) // 4 if head else None))
        if head and self._policy.checks_head:
            p = choice.placement or choice.queued  # (a queued choice predicts its landing)
            assert p is not None
            if rest_may_change(self.tree, held, len(q) // 4, p.reuse):
                return NeedWholePrompt(most_held(held), p.reuse)
        rid = self._ledger.new_id()
        cand = next(c for c in cands if c.name == choice.backend)
        restore = None
        if choice.placement is not None and choice.slot is not None and not head \
                and self.disk:
            restore = self.disk.gain(held, choice.placement, n, choice.backend)
        claims = is_claim(choice, cand, session)
        prior = None
        if claims and choice.slot is not None:
            cache = cand.state.cache
            prior = Prior(cache.held(choice.slot), cand.state.slot_session.get(choice.slot),
                          cache.common_part(choice.slot))
        r = Prompt(rid, q, n, head, now, session, user_starts, claims, prior, lora)
        placed, beyond = self._booking.land(r, choice, cand, defer, restore)
        return self._booking.record(r, choice, cand, placed, beyond,
                                    restore[0] if restore is not None else None)

    def place(self, routed: Routed) -> Routed:
        """Apply the slot model update ``decide(defer=True)`` left (if not done yet):
        saving the slot's old content to RAM may evict other entries than predicted, and
        so change what it loads (the record's prediction then says so)."""
        self._deferred.apply()
        return routed

    def posted(self, routed: Routed) -> None:
        """The request is known posted on its server (its answer's head came): the server
        launches it before any request sent after now, so those may load what its start
        saves to RAM."""
        self._deferred.apply()
        self._unposted.posted(routed.request_id)

    def held_for(self, routed: Routed) -> int | None:
        """The request ``routed`` is sent after (``Decision.after``) while that one is not
        known posted, else None; read with ``routed``'s own model update applied (a save
        its start makes may change the RAM entry it loads)."""
        self._deferred.apply()
        creator = routed.prediction.after
        return creator if creator is not None and self._unposted.pending(creator) else None

    def unposted(self, request_id: int) -> bool:
        """Is ``request_id`` a request some prediction may wait for: its start created RAM
        entries, and it is not known posted yet (see ``Decision.after``)?"""
        self._deferred.apply()
        return self._unposted.pending(request_id)

    # what a record tells (see RequestEnds)
    def extend(self, routed: Routed, tokens: Sequence[int] | array | bytes,
               user_starts: tuple[int, ...] = ()) -> Routed:
        return self._ends.extend(routed, tokens, user_starts)

    def restore_failed(self, routed: Routed) -> Routed:
        return self._ends.restore_failed(routed)

    def prefilled(self, routed: Routed) -> None:
        self._ends.prefilled(routed)

    def sending(self, routed: Routed) -> None:
        self._ends.sending(routed)

    def launched(self, routed: Routed) -> None:
        self._ends.launched(routed)

    def wait_overdue(self, routed: Routed, now: float) -> bool:
        return self._ends.wait_overdue(routed, now)

    def complete(self, routed: Routed, report: Report = NOTHING_REPORTED, *,
                 now: float = 0.0) -> list[Handoff]:
        return self._ends.complete(routed, report, now=now)

    def abort(self, routed: Routed, *, now: float = 0.0, prefilled: bool = False,
              held: int | None = None) -> list[Handoff]:
        return self._ends.abort(routed, now=now, prefilled=prefilled, held=held)

    def withdraw(self, routed: Routed, *, now: float = 0.0) -> list[Handoff]:
        return self._ends.withdraw(routed, now=now)

    @property
    def mispredictions(self) -> int:
        return self._ends.mispredictions

    @property
    def completed(self) -> int:
        return self._ends.completed

    @property
    def completed_for_peers(self) -> int:
        return self._ends.completed_for_peers

    # ------------------------------------------------ other replicas' requests
    def observe_start(self, backend: str, slot: int, sequence: bytes, *, now: float = 0.0,
                      wait: bool = True, lora: Lora | None = None) -> Routed | None:
        """Another replica's request was sent to ``backend``'s ``slot``, with ``sequence``
        (int32 token bytes) as its prompt: the model places it there as if routed here;
        it ends with ``complete`` (or ``abort``) as any. A slot busy in this model has
        it next: the server runs it once the request there ends, before any this
        replica holds for that slot (those are not sent yet). None when the backend is
        not routed here (or, without ``wait``, the slot is busy)."""
        self._deferred.apply()
        st = self._backends.get(backend)
        n = len(sequence) // 4
        if st is None or not 0 <= slot < len(st.cache.slots) or n < 2 or len(sequence) % 4:
            return None
        found = self._booking.candidates(sequence, n, False, (backend,), lora)
        if not isinstance(found, tuple):
            return None
        (cand,), _ = found
        why = {"why": "another replica's request"}
        if st.cache.slots[slot].busy:
            if not wait:
                return None
            choice = Choice(backend, slot, None, why, cand.predict_queued(n, None)[0])
        else:
            p = st.cache.predict(slot, cand.slot_lcp, cand.ram_lcp, n, lora=lora,
                                 prompt=sequence)
            choice = Choice(backend, slot, p, why)
        rid = self._ledger.new_id()
        r = Prompt(rid, sequence, n, False, now, None, (), lora=lora)
        placed, _ = self._booking.land(r, choice, cand, False, None)
        routed = self._booking.record(r, choice, cand, placed, None, None)
        routed.entry.observed = True
        self._unposted.posted(rid)  # (sent by its replica: its posting is not seen here)
        return routed

    def observe(self, backend: str, slot: int, sequence: bytes, *, now: float = 0.0,
                lora: Lora | None = None) -> bool:
        """Another replica's request on ``backend``'s ``slot`` ended, leaving ``sequence``
        there: ``observe_start`` and ``complete`` at once (what it displaces goes to RAM
        as the server's would). False when the backend is not routed here or the slot
        is busy in this model (the request there settles what it holds)."""
        routed = self.observe_start(backend, slot, sequence, now=now, wait=False, lora=lora)
        if routed is None:
            return False
        self.complete(routed, now=now)
        return True

    # ------------------------------------------------------------ slots by hand
    def held(self, backend: str, slot: int) -> bytes | None:
        """What ``backend``'s idle ``slot`` holds (int32 token bytes; None: busy, empty,
        or no such backend)."""
        st = self._backends.get(backend)
        if st is None or not 0 <= slot < len(st.cache.slots):
            return None
        return st.cache.held(slot)

    def vacant(self, backend: str, slot: int) -> bool:
        """Is ``backend``'s ``slot`` idle and empty (nothing routed there, or seeded)?"""
        st = self._backends.get(backend)
        if st is None or not 0 <= slot < len(st.cache.slots):
            return False
        s = st.cache.slots[slot]
        return not s.busy and not s.n_tokens

    def seed(self, backend: str, slot: int, sequence: bytes) -> bool:
        """``backend``'s empty ``slot`` now holds ``sequence`` (restored from disk)."""
        st = self._backends.get(backend)
        if st is None or not 0 <= slot < len(st.cache.slots):
            return False
        return st.cache.seed(slot, sequence)

    def starts(self, backend: str) -> int:
        """Tasks the model has started on `backend` so far (0 if it is not routed)."""
        self._deferred.apply()  # (a request sent is a task started)
        st = self._backends.get(backend)
        return 0 if st is None else st.cache.starts

    def unlaunched(self, backend: str) -> int:
        """This replica's requests sent to `backend`, streamed, whose launch on the server
        is not heard yet (see `Report.unlaunched_at_end`)."""
        st = self._backends.get(backend)
        return 0 if st is None else len(st.unlaunched)

    def slot_sessions(self) -> dict[str, dict[int, str]]:
        """backend -> slot -> the session id of the request last placed there (kept for
        the policy's ties; not in the snapshot, which stays free of client strings)."""
        return {name: dict(st.slot_session) for name, st in self._backends.items()}

    def prefill_rate(self, backend: str) -> float | None:
        """`backend`'s learned prefill rate (tokens/s), if it is routed."""
        st = self._backends.get(backend)
        return None if st is None else st.rate

    def prefill_s(self, backend: str, reuse: int, n: int) -> float | None:
        """How long `backend` takes to prefill a prompt's positions [reuse, n), if it is
        routed (proxy/routing/prefill.py)."""
        st = self._backends.get(backend)
        return None if st is None else st.prefill_s(reuse, n)

    def snapshot(self) -> dict[str, object]:
        self._deferred.apply()
        return {
            "policy": self._policy.name,
            "tree": {
                "resident_tokens": self.tree.resident_tokens,
                "nodes": self.tree.node_count,
                "evicted_tokens": self.tree.evicted_tokens,
            },
            "inflight": len(self._ledger),
            "completed": self.completed,
            "completed_for_peers": self.completed_for_peers,
            "mispredictions": self.mispredictions,
            "backends": {name: st.snapshot() for name, st in self._backends.items()},
        }
