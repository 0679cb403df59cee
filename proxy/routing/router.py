"""The routing facade driven by both the simulator and the live proxy.

Pure and synchronous: no I/O, no asyncio, no clock (callers pass ``now``). One
:class:`Router` owns the token tree, one cache model per backend and the policy state.

Life of a request: ``decide()`` -> (proxy forwards with ``id_slot``) -> ``complete()`` or
``abort()``. ``decide`` records its choice in the tree at once (fallbacks included), so
affinity starts with the first request of a conversation.

``decide(defer=True)`` leaves the slot model's update (the modelled saves to RAM, the
slot's new content in the tree) to ``place()``, which the proxy calls once the request
is written to its backend: that bookkeeping then runs while the backend works, not
before the request leaves. Every other call applies a deferred update first, so no
decision ever sees the model without it.
"""

from __future__ import annotations

from array import array
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import Any

from proxy.routing.backend_state import BackendState, peer_rate, share_rate
from proxy.routing.cache.model import BackendCache
from proxy.routing.cache.predict import DISK, PENDING, RAM, SLOT, BackendCapacity, Placement
from proxy.routing.decision import Decision, Handoff, NeedWholePrompt, NoBackend, NoBackendKind
from proxy.routing.observed import ObservedRequests, SlotListener
from proxy.routing.policy import POLICIES, Baselines, Candidate, Choice, choose_prefix
from proxy.routing.queue import Inflight, QueuedRequests
from proxy.routing.settings import RouterSettings
from proxy.routing.tree.radix import RadixTree
from proxy.routing.tree.token_bytes import common_len, to_token_bytes

__all__ = [
    "BackendCapacity",
    "Decision",
    "Handoff",
    "NeedWholePrompt",
    "NoBackend",
    "NoBackendKind",
    "Router",
    "RouterSettings",
]


@dataclass(frozen=True)
class _Unplaced:
    """A decision whose slot model update is deferred (``decide(defer=True)``)."""

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


class Router(QueuedRequests, ObservedRequests):
    def __init__(
        self, policy: str = "prefix", *, settings: RouterSettings | None = None, seed: int = 0
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy: must be one of {POLICIES}, got {policy!r}")
        self._policy = policy
        self.settings = settings or RouterSettings()
        self.tree = RadixTree(max_resident=self.settings.max_resident_tokens)
        self._backends: dict[str, BackendState] = {}
        self._inflight: dict[int, Inflight] = {}
        self._baselines = Baselines(seed)
        self._next_id = 0
        # disk entry -> its file and the backends that may restore it (see disk_add)
        self._disk: dict[int, tuple[str, frozenset[str]]] = {}
        # at most one: every call but `decide(defer=True)` itself applies it first
        self._unplaced: _Unplaced | None = None
        self.mispredictions = 0  # completions whose reported reuse differed from ours
        self.completed = 0  # this replica's own requests
        self.completed_for_peers = 0  # other replicas' (see ObservedRequests)
        self._observed: set[int] = set()
        self.listener: SlotListener | None = None  # hears this replica's slots change

    @property
    def policy(self) -> str:
        return self._policy

    @property
    def backends(self) -> list[str]:
        return list(self._backends)

    # ------------------------------------------------------------- membership
    def add_backend(self, cap: BackendCapacity) -> None:
        """Add a backend, or reset it (fresh and empty) when it comes back healthy."""
        self._apply_unplaced()
        if cap.name in self._backends:
            self.remove_backend(cap.name)
        cache = BackendCache(cap, self.tree, self.settings.rules,
                             max_tracked=self.settings.ram_entries_tracked,
                             track_min_tokens=self.settings.ram_track_min_tokens)
        rate = peer_rate(self._backends.values(), self.settings.default_prefill_tps)
        self._backends[cap.name] = BackendState(cache, rate=rate)

    def remove_backend(self, name: str) -> None:
        """Forget everything a dead or unhealthy backend held."""
        self._apply_unplaced()
        st = self._backends.pop(name, None)
        if st is None:
            return
        st.cache.clear()
        for rid in [r for r, f in self._inflight.items() if f.backend == name]:
            self._told_freed(name, self._inflight.pop(rid).slot, rid)
            self.tree.drop((name, PENDING, rid))

    def held(self, backend: str, slot: int) -> bytes | None:
        """What ``backend``'s idle ``slot`` holds (int32 token bytes; None: busy, empty,
        or no such backend)."""
        st = self._backends.get(backend)
        if st is None or not 0 <= slot < len(st.cache.slots):
            return None
        return st.cache.held(slot)

    def seed(self, backend: str, slot: int, sequence: bytes) -> bool:
        """``backend``'s empty ``slot`` now holds ``sequence`` (restored from disk)."""
        st = self._backends.get(backend)
        if st is None or not 0 <= slot < len(st.cache.slots):
            return False
        return st.cache.seed(slot, sequence)

    def disk_add(self, entry: int, file: str, sequence: bytes,
                 backends: frozenset[str]) -> None:
        """A slot saved to disk as ``file`` holds ``sequence``: each of ``backends`` (those
        that run the model that computed it and read the directory it is in) may have it
        restored into one of its slots. Called again for an entry when they change."""
        self._disk[entry] = (file, backends)
        self.tree.assign(("", DISK, entry), sequence)

    def disk_drop(self, entry: int) -> None:
        if self._disk.pop(entry, None) is not None:
            self.tree.drop(("", DISK, entry))

    @property
    def wants_user_starts(self) -> bool:
        """Does a backend checkpoint where user messages start (see ``decide``)?"""
        return any(st.cache.checkpointed for st in self._backends.values())

    def _disk_gain(self, held: dict[Any, int], p: Placement, n: int, backend: str
                   ) -> tuple[str, bytes, int] | None:
        """The disk file to restore into the placement's slot first, its sequence and
        the tokens it shares with the prompt: when it holds enough more than the slot.
        Never on a checkpointed backend: the server clears a restored slot's
        checkpoints, so a request diverging from it would reuse nothing."""
        if self._backends[backend].cache.checkpointed:
            return None
        best = max(((got, idx) for (_, kind, idx), got in held.items()
                    if kind == DISK and backend in self._disk[idx][1]), default=None)
        if best is None or best[0] - p.reuse < self.settings.disk_min_gain_tokens:
            return None
        got, idx = best
        return self._disk[idx][0], self.tree.tokens_of(("", DISK, idx)), min(got, n - 1)

    # --------------------------------------------------------------- decision
    def decide(
        self,
        tokens: Sequence[int] | array | bytes,
        *,
        session: str | None = None,
        now: float = 0.0,
        n_prompt: int | None = None,
        defer: bool = False,
        user_starts: tuple[int, ...] = (),
        among: Collection[str] | None = None,
    ) -> Decision | NoBackend | NeedWholePrompt:
        """Route one prompt. ``tokens``: ids as a list or ``array('i')``, or already as
        native int32 bytes (the tree's format, see proxy/routing/tree/token_bytes.py).

        ``n_prompt``: ``tokens`` is only the head of the prompt, whose whole length is
        estimated at ``n_prompt``; ``extend`` gives the rest once it is tokenized, unless
        the answer is ``NeedWholePrompt``.

        ``defer``: leave the slot model's update to ``place`` (see the module doc).

        ``user_starts``: the positions where the server finds a user message starting
        (it checkpoints there on sliding-window and hybrid models).

        ``among``: the backends that may serve it (None: any)."""
        self._apply_unplaced()
        q = to_token_bytes(tokens)
        n = len(q) // 4
        head = n_prompt is not None and n_prompt > n
        if head:
            n = n_prompt  # type: ignore[assignment]
        found = self._candidates(q, n, head, among)
        if not isinstance(found, tuple):
            return found
        cands, held = found
        if self._policy == "prefix":
            choice = choose_prefix(cands, n, self.settings, now, session,
                                   len(q) // 4 if head else None)
        else:
            choice = self._baselines.choose(self._policy, cands, n)
        if head and self._policy == "prefix":
            p = choice.placement or choice.queued  # (prefix sets one or the other)
            assert p is not None
            most = _most_kv(held)
            if p.reuse < most:
                return NeedWholePrompt(most, p.reuse)
        rid = self._next_id
        self._next_id += 1
        cand = next(c for c in cands if c.name == choice.backend)
        restore = None
        if choice.placement is not None and choice.slot is not None and not head \
                and self._disk:
            restore = self._disk_gain(held, choice.placement, n, choice.backend)
        placed, beyond = self._place(rid, choice, cand, q, n, head, defer, restore,
                                     user_starts)
        return self._record(rid, choice, cand, placed, q, n, now, beyond, session, head,
                            restore[0] if restore is not None else None, user_starts)

    def _candidates(self, q: bytes, n: int, head: bool, among: Collection[str] | None
                    ) -> tuple[list[Candidate], dict[Any, int]] | NoBackend | NeedWholePrompt:
        """The backends that may take an ``n``-token prompt, each with what of ``q`` its
        slots, RAM entries and queued requests hold, and the tree's match of ``q``."""
        if n == 0:
            return NoBackend("empty prompt", "empty")
        serving = [b for b in self._backends if among is None or b in among]
        if not serving:
            return NoBackend("no healthy backend", "unavailable")
        # NOTE: the server needs room for the prompt and at least one generated token
        names = [b for b in serving if self._backends[b].cache.cap.slot_ctx > n]
        if not names:
            return NoBackend(
                f"prompt of {n} tokens exceeds every backend's slot context", "too_long"
            )
        held = self.tree.match(q).held
        if head and any(self._backends[b].cache.checkpointed for b in names):
            # a checkpointed slot gives all it shares only to a prompt that goes on past
            # its end (else: up to a checkpoint): only the whole prompt can tell
            return NeedWholePrompt(_most_kv(held), 0)
        # per backend: slot -> lcp, RAM entry -> lcp, queued request id -> lcp
        per: dict[str, tuple[dict[int, int], dict[int, int], dict[int, int]]] = {
            b: ({}, {}, {}) for b in names
        }
        for (b, kind, idx), got in held.items():  # type: ignore[misc]
            lcps = per.get(b)
            if lcps is not None:
                lcps[kind][idx] = got  # SLOT, RAM, PENDING index the tuple
        return [Candidate(b, self._backends[b], *per[b]) for b in names], held

    def _place(self, rid: int, choice: Choice, cand: Candidate, q: bytes, n: int,
               head: bool, defer: bool, restore: tuple[str, bytes, int] | None,
               user_starts: tuple[int, ...]) -> tuple[Placement | None, bytes | None]:
        """The slot model's landing of the chosen placement (None: queued on the server),
        now or, with ``defer``, at ``place``; and, decided on a head, what the holder it
        reuses has beyond that head."""
        st = cand.state
        slot_lcp, ram_lcp = cand.slot_lcp, cand.ram_lcp
        if choice.placement is None:
            return None, None
        assert choice.slot is not None or restore is None
        if restore is not None:
            _, sequence, got = restore
            slot_lcp = {**slot_lcp, choice.slot: got}  # type: ignore[dict-item]
            placed = choice.placement._replace(reuse=got, tier="disk", ram_entry=None,
                                               saved=False, displaced=0, destroyed=0)
            if defer:
                self._unplaced = _Unplaced(rid, choice.backend, choice.slot, q, slot_lcp,
                                           ram_lcp, n, placed, sequence, user_starts)
                return placed, None
            st.cache.restore(placed.slot, sequence)
            return _from_disk(st.cache.start(choice.slot, q, slot_lcp, ram_lcp, n,
                                             user_starts=user_starts)), None
        beyond = self._beyond(choice.backend, choice.placement, slot_lcp, ram_lcp,
                              len(q)) if head else None
        if defer:
            self._unplaced = _Unplaced(rid, choice.backend, choice.slot, q, slot_lcp,
                                       ram_lcp, n, choice.placement, user_starts=user_starts)
            return choice.placement, beyond
        # NOTE: unpinned stays unpinned: an empty slot then may load from RAM
        return st.cache.start(choice.slot, q, slot_lcp, ram_lcp, n, choice.placement,
                              user_starts=user_starts), beyond

    def _record(self, rid: int, choice: Choice, cand: Candidate, placed: Placement | None,
                q: bytes, n: int, now: float, beyond: bytes | None, session: str | None,
                head: bool, restore: str | None, user_starts: tuple[int, ...]) -> Decision:
        """Book the request on its backend (work, in flight, the slot or the server's
        queue) and say what was decided."""
        st = cand.state
        queued = placed is None
        if placed is None:
            # queued on the server (unpinned): predict what it gets when a slot frees,
            # before recording it (it would share its whole prompt with itself)
            pq = choice.queued or cand.predict_queued(n, None)[0]
            self.tree.assign((choice.backend, PENDING, rid), q)
            st.queued.append(rid)
            st.queued_n[rid] = n
            if choice.slot is not None:  # waits for that busy slot (see _drain_queue)
                st.targets[rid] = choice.slot
            reuse, tier, slot = pq.reuse, pq.tier, None
        else:
            reuse, tier, slot = placed.reuse, placed.tier, placed.slot
        work = n - reuse + self.settings.request_overhead_tokens
        st.work += work
        st.inflight += 1
        st.busy_until = max(st.busy_until, now) + (n - reuse) / st.rate
        if slot is not None:
            st.expect_free(slot, now)
        self._inflight[rid] = Inflight(choice.backend, slot, q, n, work, now, beyond, session,
                                       user_starts=user_starts)
        if placed is not None:
            st.occupy(placed.slot, session)
        reasons = dict(choice.reasons)
        reasons.update({"chosen": choice.backend, "slot": slot, "tier": tier, "reuse": reuse})
        if head:
            reasons["head"] = len(q) // 4  # routed on these tokens (see extend)
        if queued:
            reasons["queued"] = len(st.queued)  # position in the server's deferred queue
            if choice.slot is not None:
                reasons["waits_for_slot"] = choice.slot
        return Decision(
            request_id=rid,
            backend=choice.backend,
            slot=choice.slot if placed is not None else None,
            predicted_cached=reuse,
            prompt_tokens=n,
            tier=tier,
            reasons=reasons,
            queued=queued,
            restore=restore,
        )

    def _beyond(self, backend: str, p: Placement, slot_lcp: dict[int, int],
                ram_lcp: dict[int, int], head_bytes: int) -> bytes | None:
        """The tokens after the prompt's head held by what the placement reuses (the RAM
        entry it loads, else its slot), if that holds the whole head: the rest of the
        prompt may match them further (the conversation's last answer, typically)."""
        if p.ram_entry is not None:
            holder, lcp = (backend, RAM, p.ram_entry), ram_lcp.get(p.ram_entry, 0)
        else:
            holder, lcp = (backend, SLOT, p.slot), slot_lcp.get(p.slot, 0)
        if lcp * 4 < head_bytes:
            return None
        held = self.tree.tokens_of(holder)
        return held[head_bytes:] if len(held) > head_bytes else None

    def place(self, decision: Decision) -> Decision:
        """Apply the slot model update ``decide(defer=True)`` left (if not done yet).
        Returns the decision with the model's reuse: saving the slot's old content to
        RAM may evict other entries than predicted, and so change what it loads; and
        another replica's request may have run in the slot first (``ran_first``)."""
        self._apply_unplaced()
        f = self._inflight.get(decision.request_id)
        if f is None or f.replaced is None:
            return decision
        (reuse, tier), f.replaced = f.replaced, None
        decision.reasons.update(reuse=reuse, tier=tier)
        return replace(decision, predicted_cached=reuse, tier=tier)

    def restore_failed(self, decision: Decision) -> Decision:
        """The disk file chosen for the decision's slot was not restored: the server
        cleared the slot (or the file was gone), so the request is prefilled from scratch.
        Returns the decision with that prediction; the model's slot is emptied first."""
        u = self._unplaced
        st = self._backends.get(decision.backend)
        f = self._inflight.get(decision.request_id)
        if st is None or f is None or decision.restore is None:
            return decision
        if u is not None and u.request_id == decision.request_id and u.restore is not None:
            self._unplaced = replace(u, restore=b"")  # an empty slot: start reuses nothing
            self._apply_unplaced()  # (which charges the prefill it adds)
        else:  # applied already: the slot holds the prompt now, as the server's does
            more = decision.predicted_cached
            st.work += more
            f.work += more
            st.busy_until += more / st.rate
        f.replaced = None
        decision.reasons.update(reuse=0, tier="none", restore="failed")
        return replace(decision, predicted_cached=0, tier="none", restore=None)

    def _apply_unplaced(self) -> None:
        u, self._unplaced = self._unplaced, None
        if u is None:
            return
        f = self._inflight.get(u.request_id)
        st = self._backends.get(u.backend)
        if f is None or st is None:
            return
        if u.restore is not None and u.pin is not None:
            st.cache.restore(u.pin, u.restore)
            p = _from_disk(st.cache.start(u.pin, u.prompt, u.slot_lcp, u.ram_lcp, u.n,
                                          user_starts=u.user_starts))
        else:
            p = st.cache.start(u.pin, u.prompt, u.slot_lcp, u.ram_lcp, u.n, u.predicted,
                               user_starts=u.user_starts)
        assert p is not None and p.slot == f.slot, "placed where predicted"
        if (p.reuse, p.tier) != (u.predicted.reuse, u.predicted.tier):
            more = u.predicted.reuse - p.reuse  # tokens to prefill beyond the prediction
            st.work += more
            f.work += more
            st.busy_until += more / st.rate
            st.expect_free(p.slot, f.started)
            f.replaced = (p.reuse, p.tier)

    def extend(self, decision: Decision, tokens: Sequence[int] | array | bytes,
               user_starts: tuple[int, ...] = ()) -> Decision:
        """The whole prompt of a request decided on its head (``decide(n_prompt=...)``):
        the model records it, and the reuse is predicted again (the rest may go on
        matching what the reused holder had). Returns the decision with the prompt's
        length and that prediction; unchanged if the request is over, or ``tokens`` does
        not start with the head."""
        self._apply_unplaced()
        f = self._inflight.get(decision.request_id)
        st = self._backends.get(decision.backend)
        q = to_token_bytes(tokens)
        if f is None or st is None or not q.startswith(f.prompt) or len(q) == len(f.prompt):
            return decision
        n = len(q) // 4
        reuse = min(decision.predicted_cached, n - 1)
        if f.beyond is not None:
            more = common_len(f.beyond, q, len(f.prompt))
            reuse = min(len(f.prompt) // 4 + more, n - 1)
        if f.slot is not None:
            st.cache.extend_prompt(f.slot, q, user_starts)
        elif decision.request_id in st.queued_n:
            self.tree.assign((decision.backend, PENDING, decision.request_id), q)
            st.queued_n[decision.request_id] = n
        work = n - reuse + self.settings.request_overhead_tokens
        st.work += work - f.work
        st.busy_until += ((n - reuse) - (f.n - decision.predicted_cached)) / st.rate
        f.prompt, f.n, f.work, f.beyond = q, n, work, None
        f.user_starts = user_starts
        return replace(decision, prompt_tokens=n, predicted_cached=reuse)

    # --------------------------------------------------------------- feedback
    def prefilled(self, decision: Decision) -> None:
        """The request's first token came: its prompt is processed. From here only its
        decoding loads the backend: its in-flight work (the load bound's measure) drops
        to ``request_overhead_tokens``, or a backend streaming long answers would look
        as loaded as one prefilling long prompts."""
        self._apply_unplaced()
        f = self._inflight.get(decision.request_id)
        st = self._backends.get(decision.backend)
        # (one of this replica's still waiting here has had no token; another replica's
        # has: the server ran it before the request this model has in its slot)
        if f is None or st is None or (f.slot is None
                                       and decision.request_id not in self._observed):
            return
        left = min(f.work, self.settings.request_overhead_tokens)
        st.work -= f.work - left
        f.work, f.prefilled = left, True
        self._told_prefilled(decision.backend, decision.request_id)

    def complete(
        self,
        decision: Decision,
        *,
        output_tokens: Sequence[int] | array | bytes = (),
        reported_cached: int | None = None,
        prompt_ms: float | None = None,
        prompt_n: int | None = None,
        reported_slot: int | None = None,
        now: float = 0.0,
        starts_at_end: int | None = None,
    ) -> list[Handoff]:
        """The request finished: its slot is free and holds prompt + output. Returns the
        queued requests handed a slot as a result (oldest first). ``starts_at_end``:
        `starts(backend)` when the answer's end reached the proxy (see
        `BackendCache.saved_idle`)."""
        self._apply_unplaced()
        out = to_token_bytes(output_tokens)  # (before the record goes: this may raise)
        f = self._inflight.get(decision.request_id)
        st = self._backends.get(decision.backend)
        if f is None or st is None or f.backend != decision.backend:
            return []  # backend was removed meanwhile: nothing to learn
        del self._inflight[decision.request_id]
        st.release(f.work, now)
        st.learn(self.settings, now - f.started, prompt_ms, prompt_n)
        if st.rate_learned:
            share_rate(self._backends.values(), self.settings.default_prefill_tps)
        if decision.request_id in self._observed:
            self.completed_for_peers += 1
        else:
            self.completed += 1
        if reported_cached is not None and reported_cached != decision.predicted_cached:
            self.mispredictions += 1
        cache = st.cache
        slot = f.slot
        if slot is None:
            # still queued in our model: place it where the server says (or would)
            self._unqueue(st, decision.backend, decision.request_id)
            slot = reported_slot
            if slot is None or not 0 <= slot < len(cache.slots) or cache.slots[slot].busy:
                slot = self._server_pick_now(cache, f.prompt)
            if slot is not None:
                held = self._lcps(cache, f.prompt)
                cache.start(slot, f.prompt, *held, f.n, task=False,
                            user_starts=f.user_starts)
                st.occupy(slot, f.session)
        elif reported_slot is not None and reported_slot != slot:
            # the server chose another slot than modelled: what ours holds is unknown
            cache.finish(slot, None, 0)
            slot = reported_slot if 0 <= reported_slot < len(cache.slots) else None
            if slot is not None and not cache.slots[slot].busy:
                cache.start(slot, f.prompt, *self._lcps(cache, f.prompt), f.n, task=False,
                            user_starts=f.user_starts)
                st.occupy(slot, f.session)
            elif slot is not None:
                slot = None  # busy in our model: leave it alone
        if slot is not None:
            cache.finish_generated(slot, out)
            if starts_at_end is not None and cache.starts > starts_at_end:
                cache.saved_idle(slot)
        self._told_freed(decision.backend, slot if slot is not None else f.slot,
                         decision.request_id)
        return self._drain_queue(st, decision.backend, now)

    def wait_overdue(self, decision: Decision, now: float) -> bool:
        """Has a request waiting for a busy slot waited well past that slot's expected end
        (a long generation)? Then the caller gives up (``abort``) and decides again;
        the slot's expected end moves as far again, so that it is not chosen anew."""
        self._apply_unplaced()
        st = self._backends.get(decision.backend)
        f = self._inflight.get(decision.request_id)
        if st is None or f is None:
            return True  # its backend left the model (tripped; maybe back, fresh)
        slot = st.targets.get(decision.request_id)
        if slot is None:
            return False
        end = st.slot_free_at.get(slot, now)
        if now <= end + max(self.settings.wait_grace_s, end - f.started):
            return False
        st.slot_free_at[slot] = now + (now - f.started)
        return True

    def abort(self, decision: Decision, *, now: float = 0.0, prefilled: bool = False,
              held: int | None = None) -> list[Handoff]:
        """The request failed or was cancelled: free its slot, forget its content, or
        with ``prefilled`` (it had produced output: the server keeps a cancelled slot's
        state) keep its prompt there; ``held``: the slot holds that many of the prompt's
        tokens (its server said so once done with it). Returns the queued requests
        handed a slot as a result (as ``complete``)."""
        self._apply_unplaced()
        f = self._inflight.get(decision.request_id)
        st = self._backends.get(decision.backend)
        if f is None or st is None or f.backend != decision.backend:
            return []
        del self._inflight[decision.request_id]
        st.release(f.work, now)
        if f.slot is None:
            self._unqueue(st, decision.backend, decision.request_id)
            self._told_freed(decision.backend, None, decision.request_id)
            return []
        if prefilled:
            # NOTE: an agent's interrupted turn: its next one resends that history
            st.cache.finish_generated(f.slot, b"")
        elif held is not None and held > 0:
            n = min(held, f.n)
            st.cache.finish(f.slot, f.prompt[:4 * n], n)
        else:
            st.cache.finish(f.slot, None, 0)
        self._told_freed(decision.backend, f.slot, decision.request_id)
        return self._drain_queue(st, decision.backend, now)

    def starts(self, backend: str) -> int:
        """Tasks the model has started on `backend` so far (0 if it is not routed)."""
        st = self._backends.get(backend)
        return 0 if st is None else st.cache.starts

    def slot_sessions(self) -> dict[str, dict[int, str]]:
        """backend -> slot -> the session id of the request last placed there (kept for
        the policy's ties; not in the snapshot, which stays free of client strings)."""
        return {name: dict(st.slot_session) for name, st in self._backends.items()}

    def prefill_rate(self, backend: str) -> float | None:
        """`backend`'s learned prefill rate (tokens/s), if it is routed."""
        st = self._backends.get(backend)
        return None if st is None else st.rate

    def snapshot(self) -> dict[str, object]:
        self._apply_unplaced()
        return {
            "policy": self._policy,
            "tree": {
                "resident_tokens": self.tree.resident_tokens,
                "nodes": self.tree.node_count,
                "evicted_tokens": self.tree.evicted_tokens,
            },
            "inflight": len(self._inflight),
            "completed": self.completed,
            "completed_for_peers": self.completed_for_peers,
            "mispredictions": self.mispredictions,
            "backends": {name: st.snapshot() for name, st in self._backends.items()},
        }


def _most_kv(held: dict[Any, int]) -> int:
    """The most tokens of a prompt any holder of KV has (queued prompts are none)."""
    return max((got for (_, kind, _), got in held.items() if kind != PENDING), default=0)


def _from_disk(p: Placement | None) -> Placement | None:
    """A placement in a slot just restored from disk: what it reuses came from disk."""
    return p._replace(tier="disk") if p is not None and p.tier == "slot" else p
