"""What the router learns as a request ends: its first token, its completion (what its
slot holds, its backend's prefill rate, whether the prediction held), a wait gone on too
long, or its abort.

A mixin of :class:`~proxy.routing.router.Router` (as QueuedRequests is). Each end frees the
request's slot in the model, tells the listener (ObservedRequests) and hands the slot to
the requests queued for it (QueuedRequests), whose hand-offs it returns.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence

from proxy.routing.backend_state import BackendState, share_rate
from proxy.routing.cache.model import BackendCache
from proxy.routing.decision import Handoff
from proxy.routing.routed import Inflight, Routed
from proxy.routing.settings import RouterSettings
from proxy.routing.tree.token_bytes import to_token_bytes


class RequestEnds:
    """Feedback on requests in flight (over the Router's records)."""

    settings: RouterSettings
    _backends: dict[str, BackendState]
    _inflight: dict[int, Inflight]
    _observed: set[int]  # (ObservedRequests)
    mispredictions: int  # (Router)
    completed: int  # (Router)
    completed_for_peers: int  # (Router)
    _apply_unplaced: Callable[[], None]  # (Router)
    _told_prefilled: Callable[[str, int], None]  # (ObservedRequests)
    _told_freed: Callable[[str, int | None, int], None]  # (ObservedRequests)
    _unqueue: Callable[[BackendState, str, int], None]  # (QueuedRequests)
    _lcps: Callable[[BackendCache, bytes], tuple[dict[int, int], dict[int, int]]]
    _server_pick_now: Callable[[BackendCache, bytes], int | None]  # (QueuedRequests)
    _drain_queue: Callable[[BackendState, str, float], list[Handoff]]  # (QueuedRequests)

    def prefilled(self, routed: Routed) -> None:
        """The request's first token came: its prompt is processed. From here only its
        decoding loads the backend: its in-flight work (the load bound's measure) drops
        to ``request_overhead_tokens``, or a backend streaming long answers would look
        as loaded as one prefilling long prompts."""
        self._apply_unplaced()
        f, rid = routed.entry, routed.request_id
        st = self._backends.get(f.backend)
        # (one of this replica's still waiting here has had no token; another replica's
        # has: the server ran it before the request this model has in its slot)
        if not f.live or st is None or (f.slot is None and rid not in self._observed):
            return
        left = min(f.work, self.settings.request_overhead_tokens)
        st.work -= f.work - left
        f.work, f.prefilled = left, True
        self._told_prefilled(f.backend, rid)

    def complete(
        self,
        routed: Routed,
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
        f, decision = routed.entry, routed.prediction
        st = self._backends.get(f.backend)
        if not f.live or st is None:
            return []  # backend was removed meanwhile: nothing to learn
        self._end(f, decision.request_id)
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

    def _end(self, f: Inflight, rid: int) -> None:
        """``f``'s request is over: out of the ledger."""
        del self._inflight[rid]
        f.live = False

    def wait_overdue(self, routed: Routed, now: float) -> bool:
        """Has a request waiting for a busy slot waited well past that slot's expected end
        (a long generation)? Then the caller gives up (``abort``) and decides again;
        the slot's expected end moves as far again, so that it is not chosen anew."""
        self._apply_unplaced()
        f = routed.entry
        st = self._backends.get(f.backend)
        if st is None or not f.live:
            return True  # its backend left the model (tripped; maybe back, fresh)
        slot = st.targets.get(routed.request_id)
        if slot is None:
            return False
        end = st.slot_free_at.get(slot, now)
        if now <= end + max(self.settings.wait_grace_s, end - f.started):
            return False
        st.slot_free_at[slot] = now + (now - f.started)
        return True

    def abort(self, routed: Routed, *, now: float = 0.0, prefilled: bool = False,
              held: int | None = None) -> list[Handoff]:
        """The request failed or was cancelled: free its slot, forget its content, or
        with ``prefilled`` (it had produced output: the server keeps a cancelled slot's
        state) keep its prompt there; ``held``: the slot holds that many of the prompt's
        tokens (its server said so once done with it). Returns the queued requests
        handed a slot as a result (as ``complete``)."""
        self._apply_unplaced()
        f, decision = routed.entry, routed.prediction
        st = self._backends.get(f.backend)
        if not f.live or st is None:
            return []
        self._end(f, decision.request_id)
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
