"""A decided request booked on its backend: the backends it is decided among
(`Booking.candidates`), its landing in the slot model, now or left to `Router.place`
(`Booking.land`), and its record in flight with the decision the caller is shown
(`Booking.record`). `Router.decide` books this replica's requests through it, and
`Router.observe_start` other replicas'."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, NamedTuple

from proxy.routing.backend_state import BackendState, Queued
from proxy.routing.cache.lora import Lora
from proxy.routing.cache.values import CONTINUATION_SLACK, RAM, SLOT, Launch, Placement, from_disk
from proxy.routing.decision import Decision, NeedWholePrompt, NoBackend
from proxy.routing.deferred import Deferred, Unplaced
from proxy.routing.head import most_held
from proxy.routing.options import Candidate
from proxy.routing.policy import Choice
from proxy.routing.posting import Unposted
from proxy.routing.routed import Inflight, Ledger, Owner, Prior, Routed
from proxy.routing.settings import RouterSettings
from proxy.routing.tree.radix import RadixTree


class Prompt(NamedTuple):
    """The request being decided, as the model books it."""

    rid: int
    q: bytes  # its prompt (int32 token bytes; the head, decided on its head)
    n: int  # its tokens (estimated, decided on its head)
    head: bool  # decided on its head (``decide(n_prompt=...)``)
    now: float
    session: str | None
    user_starts: tuple[int, ...]
    claims: bool = False  # it takes a slot it does not go on from (see Decision.claims)
    prior: Prior | None = None  # a claim's slot before it
    lora: Lora | None = None  # the adapters it names (None: no `lora` field)


class Booking:
    """Books decided requests on the router's backends (state owned by the Router)."""

    def __init__(self, tree: RadixTree, backends: dict[str, BackendState], ledger: Ledger,
                 deferred: Deferred, unposted: Unposted, settings: RouterSettings,
                 owner: Owner) -> None:
        self.tree, self._backends, self._ledger = tree, backends, ledger
        self._deferred, self._unposted, self.settings = deferred, unposted, settings
        self._owner = owner  # the Router each record answers to

    def candidates(self, q: bytes, n: int, head: bool, among: Collection[str] | None,
                   lora: Lora | None = None
                   ) -> tuple[list[Candidate], dict[Any, int]] | NoBackend | NeedWholePrompt:
        """The backends that may take an ``n``-token prompt, each with what of ``q`` its
        slots and RAM entries hold, and the tree's match of ``q``."""
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
            return NeedWholePrompt(most_held(held), 0)
        # per backend: slot -> lcp, RAM entry -> lcp
        per: dict[str, tuple[dict[int, int], dict[int, int]]] = {b: ({}, {}) for b in names}
        for (b, kind, idx), got in held.items():  # type: ignore[misc]
            lcps = per.get(b)  # (a disk entry's is "": no backend's)
            if lcps is not None:
                lcps[kind][idx] = got  # SLOT, RAM index the tuple
        return [Candidate(b, self._backends[b], *per[b], q, lora) for b in names], held

    def land(self, r: Prompt, choice: Choice, cand: Candidate, defer: bool,
             restore: tuple[str, bytes, int] | None
             ) -> tuple[Placement | None, bytes | None]:
        """The slot model's landing of the chosen placement (None: queued),
        now or, with ``defer``, at ``Router.place``; and, decided on a head, what the holder it
        reuses has beyond that head."""
        rid, q, n, user_starts, lora = r.rid, r.q, r.n, r.user_starts, r.lora
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
                self._deferred.defer(Unplaced(rid, choice.backend, choice.slot, q, slot_lcp,
                                              ram_lcp, n, placed, sequence, user_starts, lora))
                return placed, None
            st.cache.restore(placed.slot, sequence)
            p = from_disk(st.cache.start(choice.slot, q, slot_lcp, ram_lcp, n,
                                         launch=Launch(user_starts, lora)))
            self._unposted.started(rid, choice.backend, st.cache.created, st.cache.starts)
            return p, None
        beyond = self.beyond_head(choice.backend, choice.placement, slot_lcp, ram_lcp,
                                  len(q)) if r.head else None
        if defer:
            self._deferred.defer(Unplaced(rid, choice.backend, choice.slot, q, slot_lcp,
                                          ram_lcp, n, choice.placement,
                                          user_starts=user_starts, lora=lora))
            return choice.placement, beyond
        # NOTE: unpinned stays unpinned: an empty slot then may load from RAM
        p = st.cache.start(choice.slot, q, slot_lcp, ram_lcp, n, choice.placement,
                           Launch(user_starts, lora))
        self._unposted.started(rid, choice.backend, st.cache.created, st.cache.starts)
        return p, beyond

    def record(self, r: Prompt, choice: Choice, cand: Candidate, placed: Placement | None,
               beyond: bytes | None, restore: str | None) -> Routed:
        """Book the request on its backend (work, in flight, the slot or the server's
        queue) and say what was decided."""
        rid, q, n, now, session = r.rid, r.q, r.n, r.now, r.session
        st = cand.state
        queued = placed is None
        if placed is None:
            # queued (unpinned): predict what it gets when a slot frees,
            # before recording it (it would share its whole prompt with itself)
            pq = choice.queued or cand.predict_queued(n, None)[0]
            # choice.slot: it waits for that busy slot (see SlotQueue.drain); follows:
            # for the slot that waiter is handed
            st.enqueue(rid, Queued(n, q, session, r.lora, pq.reuse, now), choice.slot,
                       choice.follows)
            reuse, tier, slot = pq.reuse, pq.tier, None
        else:
            reuse, tier, slot = placed.reuse, placed.tier, placed.slot
            st.busy_until = max(st.busy_until, now) + st.prefill_s(reuse, n)
            st.expect_free(slot, now)
        work = n - reuse + self.settings.request_overhead_tokens
        st.work += work
        st.inflight += 1
        f = self._ledger.add(rid, Inflight(choice.backend, slot, q, n, work, now, beyond,
                                           session, user_starts=r.user_starts, lora=r.lora))
        if placed is not None:
            f.prior = r.prior
            st.occupy(placed.slot, session)
        reasons = dict(choice.reasons)
        reasons.update({"chosen": choice.backend, "slot": slot, "tier": tier, "reuse": reuse})
        if r.head:
            reasons["head"] = len(q) // 4  # routed on these tokens (see extend)
        if queued:
            reasons["queued"] = len(st.queued)  # requests waiting there
            if choice.slot is not None:
                reasons["waits_for_slot"] = choice.slot
        f.prediction = Decision(
            request_id=rid,
            backend=choice.backend,
            slot=choice.slot if placed is not None else None,
            predicted_cached=reuse,
            prompt_tokens=n,
            tier=tier,
            reasons=reasons,
            queued=queued,
            restore=restore,
            claims=r.claims and placed is not None,
            after=self._unposted.creator(rid, choice.backend, placed.ram_entry)
            if placed is not None else None,
            recompute=placed is not None and placed.recompute,
        )
        return Routed(self._owner, f)

    def beyond_head(self, backend: str, p: Placement, slot_lcp: dict[int, int],
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


def is_claim(choice: Choice, cand: Candidate, session: str | None) -> bool:
    """Does the choice pin a slot whose content it does not go on from: an empty one, or
    another conversation's, of which it shares a prefix at most (a system prompt)? A
    request that goes on from the whole sequence the slot holds (its conversation's
    next turn), or from a slot its own session used last (a side call), does not.
    Matching no further than what other holders share with the slot (a system prompt)
    shows no conversation of its own: every new conversation over that prompt matches
    as much. Decided on a head that ends inside the slot's sequence, it is a claim until
    its whole prompt shows it goes on (``RequestEnds.extend``)."""
    p = choice.placement
    if p is None or choice.slot is None:
        return False
    if p.tier != "slot":
        return True
    lcp = cand.slot_lcp.get(p.slot, 0)
    cache = cand.state.cache
    goes_on = cache.slots[p.slot].n_tokens - lcp <= CONTINUATION_SLACK \
        and lcp > cache.common_part(p.slot)
    return not goes_on and (session is None or cand.state.slot_session.get(p.slot) != session)
