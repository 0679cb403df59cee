"""What the router learns as a request goes and ends: the rest of a prompt decided on its
head, a failed disk restore, its first token, its completion (what its slot holds, its
backend's prefill rate, whether the prediction held), a wait gone on too long, or its
abort.

Each end frees the request's slot in the model, tells the listener (PeerRequests) and
hands the slot to the requests queued for it (SlotQueue), whose hand-offs it returns.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Literal

from proxy.routing.backend_state import BackendState, share_rate
from proxy.routing.cache.values import CONTINUATION_SLACK, Launch
from proxy.routing.decision import Handoff, Report
from proxy.routing.deferred import Deferred
from proxy.routing.observed import PeerRequests
from proxy.routing.posting import Unposted
from proxy.routing.queue import SlotQueue
from proxy.routing.routed import Inflight, Ledger, Prior, Routed
from proxy.routing.settings import RouterSettings
from proxy.routing.tree.token_bytes import common_len, to_token_bytes


class RequestEnds:
    """Feedback on requests in flight, told through their records (`Routed`)."""

    def __init__(self, backends: Mapping[str, BackendState], ledger: Ledger,
                 deferred: Deferred, queue: SlotQueue, peers: PeerRequests,
                 settings: RouterSettings, unposted: Unposted) -> None:
        self._backends, self._ledger, self._deferred = backends, ledger, deferred
        self._queue, self._peers, self._settings = queue, peers, settings
        self._unposted = unposted
        self.mispredictions = 0  # completions whose reported reuse differed from ours
        self.completed = 0  # this replica's own requests
        self.completed_for_peers = 0  # other replicas' (see PeerRequests)

    def extend(self, routed: Routed, tokens: Sequence[int] | array | bytes,
               user_starts: tuple[int, ...] = ()) -> Routed:
        """The whole prompt of a request decided on its head (``decide(n_prompt=...)``):
        the model records it, and the reuse is predicted again (the rest may go on
        matching what the reused holder had); the record's prediction says so. Nothing
        changes if the request is over, or ``tokens`` does not start with the head."""
        self._deferred.apply()
        f = routed.entry
        st = self._backends.get(f.backend)
        q = to_token_bytes(tokens)
        if not f.live or st is None or not q.startswith(f.prompt) or len(q) == len(f.prompt):
            return routed
        d = routed.prediction
        n = len(q) // 4
        reuse = min(d.predicted_cached, n - 1)
        if f.beyond is not None:
            more = common_len(f.beyond, q, len(f.prompt))
            reuse = min(len(f.prompt) // 4 + more, n - 1)
        claims = d.claims and not _goes_on(f.prior, q)
        if f.slot is not None:
            most = st.cache.extend_prompt(f.slot, q, user_starts)
            reuse = reuse if most is None else min(reuse, most)
            st.busy_until += st.prefill_s(reuse, n) - st.prefill_s(d.predicted_cached, f.n)
        else:
            st.requeue(d.request_id, n, q, reuse)
        work = n - reuse + self._settings.request_overhead_tokens
        st.work += work - f.work
        f.prompt, f.n, f.work, f.beyond = q, n, work, None
        f.user_starts = user_starts
        f.prediction = replace(d, prompt_tokens=n, predicted_cached=reuse, claims=claims)
        return routed

    def restore_failed(self, routed: Routed) -> Routed:
        """The disk file chosen for the request's slot was not restored: the server
        cleared the slot (or the file was gone), so the request is prefilled from scratch,
        as its record's prediction then says; the model's slot is emptied first."""
        f, decision = routed.entry, routed.prediction
        st = self._backends.get(f.backend)
        if st is None or not f.live or decision.restore is None:
            return routed
        if not self._deferred.forget_restore(decision.request_id):
            # applied already: the slot holds the prompt now, as the server's does
            more = decision.predicted_cached
            st.work += more
            f.work += more
            st.busy_until += st.prefill_s(0, more)
        d = routed.prediction
        f.prediction = replace(d, predicted_cached=0, tier="none", restore=None,
                               reasons={**d.reasons, "reuse": 0, "tier": "none",
                                        "restore": "failed"})
        return routed

    def prefilled(self, routed: Routed) -> None:
        """The request's first token came: its prompt is processed. From here only its
        decoding loads the backend: its in-flight work (the load bound's measure) drops
        to ``request_overhead_tokens``, or a backend streaming long answers would look
        as loaded as one prefilling long prompts."""
        self._deferred.apply()
        f, rid = routed.entry, routed.request_id
        st = self._backends.get(f.backend)
        # (one of this replica's still waiting here has had no token; another replica's
        # has: the server ran it before the request this model has in its slot)
        if not f.live or st is None or (f.slot is None and not f.observed):
            return
        left = min(f.work, self._settings.request_overhead_tokens)
        st.work -= f.work - left
        f.work, f.prefilled = left, True
        self._peers.told_prefilled(f, rid)

    def sending(self, routed: Routed) -> None:
        """The request is written to its backend, its answer streamed: its launch is
        heard when the stream's head comes (see ``launched``)."""
        f = routed.entry
        st = self._backends.get(f.backend)
        if st is not None and f.live and not f.observed:
            st.unlaunched[routed.request_id] = None

    def launched(self, routed: Routed) -> None:
        """The server launched the request: its stream's head came."""
        st = self._backends.get(routed.entry.backend)
        if st is not None:
            st.unlaunched.pop(routed.request_id, None)

    def complete(self, routed: Routed, report: Report, *, now: float = 0.0
                 ) -> list[Handoff]:
        """The request finished: its slot is free and holds prompt + output. Returns the
        queued requests handed a slot as a result (oldest first)."""
        self._deferred.apply()
        out = to_token_bytes(report.output_tokens)  # (before the record goes: it may raise)
        f, decision = routed.entry, routed.prediction
        st = self._backends.get(f.backend)
        if not f.live or st is None:
            return []  # backend was removed meanwhile: nothing to learn
        self._ledger.end(decision.request_id)
        self._unposted.posted(decision.request_id)
        st.unlaunched.pop(decision.request_id, None)
        st.release(f.work, now)
        st.learn(self._settings, now - f.started, report.prompt_ms, report.prompt_n,
                 report.reported_cached)
        if st.rate_learned:
            share_rate(self._backends.values(), self._settings.default_prefill_tps)
        if f.observed:
            self.completed_for_peers += 1
        else:
            self.completed += 1
        cached = report.reported_cached
        if cached is not None and cached != decision.predicted_cached:
            self.mispredictions += 1
        slot = self._ended_in(st, f, decision.request_id, report.reported_slot)
        saver = None if slot is None else self._saved_as_idle(st, f, slot, report, out)
        self._peers.told_freed(f, slot if slot is not None else f.slot, decision.request_id)
        handoffs = self._queue.drain(st, decision.backend, now)
        if saver is None:
            return handoffs
        # sent once the saver is known posted: it then launches first, the slot idle
        return [self._held_for(h, slot, saver) for h in handoffs]

    def _saved_as_idle(self, st: BackendState, f: Inflight, slot: int, report: Report,
                       out: bytes) -> int | None:
        """The request in ``slot`` ended there: the model records what it holds, and a
        save of it as an idle slot if a start the server launched after its end made
        one (see `_saved_at`). Returns the request whose launch saves it, not known
        posted yet (None: none such), the save then named its own (`Unposted`)."""
        cache = st.cache
        cache.finish_generated(slot, out)
        prefilling = report.unlaunched_at_end > 0 and any(
            g.slot is not None and not g.prefilled and r not in st.unlaunched
            for r, g in self._ledger.on(f.backend))
        peers_wait = any(t == slot and (g := self._ledger.get(r)) is not None and g.observed
                         for r, t in st.targets.items())
        saved = _saved_at(st, report, prefilling, peers_wait)
        if saved is None:
            return None
        made = cache.saved_idle(slot)
        if not made:
            return None
        # this replica's start made last after the read, or its request sent last: the
        # likeliest to be launched after the slot freed (None: posted since, before any
        # sent now, or another replica's start)
        before = report.starts_before_end
        saver = (self._unposted.since(f.backend, before) if saved == "start" and before
                 is not None else next(reversed(st.unlaunched), None))
        if saver is not None:
            self._unposted.started(saver, f.backend, made)
        return saver

    def _held_for(self, h: Handoff, slot: int, saver: int) -> Handoff:
        """Hand-off ``h``, sent after ``saver`` when it keeps what freed ``slot`` holds
        (posted first, it would take the slot before the save; a request replacing the
        slot's content saves it itself), unless it waits for another creator."""
        g = self._ledger.get(h.request_id)
        if (h.slot != slot or h.tier != "slot" or h.after is not None or g is None
                or g.observed):
            return h
        g.wait_for(saver)
        return replace(h, after=saver)

    def _ended_in(self, st: BackendState, f: Inflight, rid: int,
                  reported_slot: int | None) -> int | None:
        """The slot the model has ``f``'s request end in (None: not known), after placing
        it where the server says it ran, when the model had it elsewhere or queued."""
        cache = st.cache
        slot = f.slot
        if slot is None:
            # still queued in our model: place it where the server says (or would)
            st.dequeue(rid)
            slot = reported_slot
            if slot is None or not 0 <= slot < len(cache.slots) or cache.slots[slot].busy:
                slot = self._queue.server_pick_now(cache, f.prompt)
        elif reported_slot is not None and reported_slot != slot:
            # the server chose another slot than modelled: what ours holds is unknown
            cache.finish(slot, None, 0)
            slot = reported_slot if 0 <= reported_slot < len(cache.slots) else None
            if slot is not None and cache.slots[slot].busy:
                return None  # busy in our model: leave it alone
        else:
            return slot
        if slot is not None:
            cache.correct(slot, f.prompt, *self._queue.lcps(cache, f.prompt), f.n,
                          Launch(f.user_starts, f.lora))
            st.occupy(slot, f.session)
        return slot

    def wait_overdue(self, routed: Routed, now: float) -> bool:
        """Has a request waiting for a busy slot waited well past that slot's expected end
        (a long generation)? Then the caller gives up (``abort``) and decides again;
        the slot's expected end moves as far again, so that it is not chosen anew."""
        self._deferred.apply()
        f = routed.entry
        st = self._backends.get(f.backend)
        if st is None or not f.live:
            return True  # its backend left the model (tripped; maybe back, fresh)
        slot = st.targets.get(routed.request_id)
        if slot is None:
            return False
        end = st.slot_free_at.get(slot, now)
        if now <= end + max(self._settings.wait_grace_s, end - f.started):
            return False
        st.slot_free_at[slot] = now + (now - f.started)
        return True

    def abort(self, routed: Routed, *, now: float = 0.0, prefilled: bool = False,
              held: int | None = None, sent: bool = True, prior: Prior | None = None
              ) -> list[Handoff]:
        """The request failed or was cancelled: free its slot, forget its content, or
        with ``prefilled`` (it had produced output: the server keeps a cancelled slot's
        state) keep its prompt there; ``held``: the slot holds that many of the prompt's
        tokens (its server said so once done with it); ``prior``: it holds that again
        (see ``withdraw``). Without ``sent``, it never reached the server: the listener
        hears it withdrawn. Returns the queued requests handed a slot as a result (as
        ``complete``)."""
        self._deferred.apply()
        f, decision = routed.entry, routed.prediction
        st = self._backends.get(f.backend)
        if not f.live or st is None:
            return []
        made = self._unposted.created(decision.request_id) if prior is not None else []
        self._ledger.end(decision.request_id)
        self._unposted.posted(decision.request_id)
        st.unlaunched.pop(decision.request_id, None)
        st.release(f.work, now)
        if not sent:
            self._peers.told_withdrawn(f, decision.request_id)
        if f.slot is None:
            released = st.dequeue(decision.request_id)
            if sent:
                self._peers.told_freed(f, None, decision.request_id)
            # its followers wait for any slot now: an idle one is theirs
            return self._queue.drain(st, decision.backend, now) if released else []
        if prior is not None:
            st.cache.finish(f.slot, None, 0)
            if prior.sequence:
                st.cache.restore(f.slot, prior.sequence)
            st.cache.forget_ram(made)
            st.occupy(f.slot, prior.session)
        elif prefilled:
            # NOTE: an agent's interrupted turn: its next one resends that history
            st.cache.finish_generated(f.slot, b"")
        elif held is not None and held > 0:
            n = min(held, f.n)
            st.cache.finish(f.slot, f.prompt[:4 * n], n)
        else:
            st.cache.finish(f.slot, None, 0)
        if sent:
            self._peers.told_freed(f, f.slot, decision.request_id)
        return self._queue.drain(st, decision.backend, now)

    def withdraw(self, routed: Routed, *, now: float = 0.0) -> list[Handoff]:
        """The request is not sent where it was decided (another replica's request won
        its slot: see `Decision.claims`): nothing its start did in the model happened
        on the server. The slot holds what it held before (a claim's slot: else what it
        shared with the prompt), the RAM entries its start created are forgotten (those
        its saves evicted stay gone: the model then claims less than the server holds,
        the safe error), and the slot goes to the requests waiting for it (their
        hand-offs returned)."""
        d = routed.prediction
        kept = d.predicted_cached if d.tier == "slot" else None
        return self.abort(routed, now=now, held=kept, sent=False, prior=routed.entry.prior)


def _saved_at(st: BackendState, report: Report, prefilling: bool,
              peers_wait: bool) -> Literal["start", "unlaunched"] | None:
    """Did the server launch a task after the request's slot was freed, and so save it
    to RAM as an idle one (--cache-idle-slots)? A start the model made after the read
    before its last step did (see ``Report``): "start". So does, most likely, a request
    sent whose stream's head had not come when the answer ended (its HTTP thread was
    still tokenizing it): "unlaunched". Not always: the server sends that head when the
    slot joins a batch, and a launched slot waits out of it while another slot's
    prefill fills the batch (``prefilling``), or while the slot generating runs under
    other LoRA adapters; nor when another replica's request waits for this slot (that
    replica sends it when handed the slot, and the server may post it first:
    ``peers_wait``). In those cases nothing is saved (None): the lesser error (a reuse
    under-predicted, never one the server cannot give). This replica's waiters handed
    the slot at this end are sent only once that start (either kind) is known posted
    (`RequestEnds._held_for`): they launch after it. Not covered: a request decided
    later and pinned to the slot before that start is posted, another replica's told
    later, or that start failing before its launch; each leaves the model an entry the
    server lacks (a reuse over-predicted, once)."""
    before = report.starts_before_end
    if before is not None and st.cache.starts > before:
        return "start"
    if (report.unlaunched_at_end > 0 and not prefilling and not st.cache.lora_global
            and not peers_wait):
        return "unlaunched"
    return None


def _goes_on(prior: Prior | None, prompt: bytes) -> bool:
    """Does ``prompt`` go on from the whole sequence its claim's slot held, past what
    other holders share with it? (Then it is no claim: see booking.is_claim.)"""
    if prior is None or prior.sequence is None:
        return False
    held = len(prior.sequence) // 4
    lcp = common_len(prior.sequence, prompt, 0)
    return held - lcp <= CONTINUATION_SLACK and lcp > prior.common
