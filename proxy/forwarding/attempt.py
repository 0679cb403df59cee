"""One routed request on one backend (`Attempt`): decided, sent with id_slot to the slot
chosen, its answer relayed, and what it leaves fed back to the router.

`Forwarder.routed` (proxy/forwarding/forwarder.py) runs one `Attempt` per backend tried;
`send()` (proxy/forwarding/send.py) does the upstream exchange and tells the attempt what
happens (`ExchangeEvents`), which tells the request's record (`Routed`, owned by the
router). A prompt routed on its head while the rest is tokenized arrives as a
`PendingPrompt`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from array import array
from collections.abc import Sequence

from aiohttp import web

from backends.dialect import CHAT_PATH
from backends.info import BackendInfo
from proxy.errors import NoBackendAvailable, UpstreamError, UpstreamTimeout
from proxy.forwarding.asked import Asked, Forwarding, PendingPrompt, whole_prompt
from proxy.forwarding.assemble import runs_on_when_left
from proxy.forwarding.payload import for_backend, upstream_payload
from proxy.forwarding.send import Exchange, Target, send
from proxy.prompt.media import (
    cut_short,
    media_kinds,
    media_positions,
)
from proxy.reporting.outcome import Outcome, held_output
from proxy.routing.cache.lora import Lora, requested
from proxy.routing.cache.values import Launch
from proxy.routing.decision import Decision, NeedWholePrompt, NoBackend, Report
from proxy.routing.routed import Routed
from proxy.routing.tree.token_bytes import to_token_bytes

# a request that claims its slot moves at most this often (each move costs a claim's
# window); then it is sent where it was last decided
MAX_MOVES = 3


class Attempt:
    """One routed request on one backend, in named steps: `decide` (on the head while
    the rest of a pending prompt is tokenized), `contest` its slot with the other
    replicas (if any, and it claims one), `claim` the backend, then `exchange`
    (held for a slot if queued, sent pinned, the prediction `settle`d once the whole
    prompt is known) and `feedback`. The slot claim `decide` makes is released however it
    ends: `complete` on a normal answer, `abort` on errors, cancellation, disconnects.

    It hears its exchange as `send`'s `ExchangeEvents` (`sent`, `settle`, `data`,
    `first_token`) and tells the request's record; the prediction is the record's."""

    def __init__(self, fw: Forwarding, asked: Asked, tokens: Sequence[int] | PendingPrompt,
                 pending: PendingPrompt | None) -> None:
        self.fw, self.router = fw, fw.router
        self.request, self.endpoint, self.path, self.raw, self.body = (
            asked.request, asked.endpoint, asked.path, asked.raw, asked.body)
        self.relay, self.hint, self.started = asked.relay, asked.hint, asked.started
        self.tokens, self.pending = tokens, pending
        self.whole = pending is None  # the model has the whole prompt
        # `cache_prompt: false`: the server reuses nothing (and caches the prompt as
        # usual: the model's state stays right); the prediction shown is 0
        self.no_reuse = asked.body.get("cache_prompt") is False
        self.detached: asyncio.Future[web.StreamResponse] | None = None
        self.media = media_kinds(asked.body)
        self.lora = requested(asked.body)
        self.among = fw.serving(asked.path, self.media)
        # the answer is streamed from the backend: its head tells the server launched it
        self.streams = False
        self.heard = False  # the answer's first bytes came

    async def run(self) -> web.StreamResponse:
        self.routed = await self.decide()
        if self.pending is not None:
            self.pending.rest.add_done_callback(self.take_rest)
        await self.contest()
        self.info = self.claim()
        self.outcome = Outcome(started=self.started)
        self.fw.recorder.begin(self.info.name)
        self.span = None
        try:
            self.span = self.fw.tracing.begin(self.request.headers, self.endpoint)
            return await self.exchange()
        except (UpstreamError, UpstreamTimeout) as e:
            self.outcome.status = 0
            if self.fw.health is not None:
                self.fw.health.failed(self.info.name, e.message)
            raise
        except asyncio.CancelledError:
            self.outcome.cancelled = True  # the client left (an interrupt), not a failure
            raise
        finally:
            self.finish()

    def named_lora(self, backend: str) -> Lora | None:
        """The LoRA adapters the request goes to ``backend`` naming: its own, or, where
        it names none (no field, or ``[]``), the backend's global scales (None: it has
        no adapters, or the field is one the server refuses)."""
        if self.lora is not None:
            return self.lora
        if self.body.get("lora", []) != []:
            return None
        return tuple(enumerate(self.router.adapters(backend))) or None

    def launch(self, ids: Sequence[int] | array) -> Launch:
        """Where the server finds user messages in this prompt (none unless a backend
        checkpoints there and this is a chat prompt), and the adapters it names."""
        find = self.fw.user_starts
        if find is None or self.path != CHAT_PATH or not self.router.wants_user_starts:
            return Launch((), self.lora)
        return Launch(find(to_token_bytes(ids)), self.lora)

    async def decide(self) -> Routed:
        # NOTE: defer: the slot model's update runs once the request is written (`placed`)
        pending = self.pending
        if pending is None or self.whole:
            tokens: Sequence[int] = self.tokens  # type: ignore[assignment]
            got = self.router.decide(tokens, session=self.hint, now=time.monotonic(),
                                     defer=True, among=self.among,
                                     launch=self.launch(tokens))
        else:
            got = self.router.decide(pending.head, session=self.hint, now=time.monotonic(),
                                     n_prompt=pending.n_estimate, defer=True,
                                     among=self.among, launch=self.launch(pending.head))
            if isinstance(got, NeedWholePrompt):  # not moved off its history on the head
                self.tokens = whole = await whole_prompt(pending)
                self.pending, self.whole = None, True
                got = self.router.decide(whole, session=self.hint, now=time.monotonic(),
                                         defer=True, among=self.among,
                                         launch=self.launch(whole))
        if isinstance(got, NoBackend):
            raise self.fw.no_backend_error(got)
        assert not isinstance(got, NeedWholePrompt), "only ever for a head"
        return got

    async def contest(self) -> None:
        """Hold a request that claims its slot while another replica may claim it too
        (proxy/replicas/claims.py); one whose claim lost moves: it is withdrawn (never
        sent) and decided again, with the winner's request in that slot now."""
        claims = self.fw.claims
        if claims is None:
            return
        for _ in range(MAX_MOVES):
            try:
                kept = await claims.hold(self.routed, self.told_prompt)
            except BaseException:
                # (the client left, or its prompt's rest failed: it was never sent)
                self.fw.waits.hand_off(self.routed.withdraw(now=time.monotonic()))
                raise
            if kept:
                return
            d = self.routed.prediction
            self.fw.recorder.log.debug("slot_claim_lost", request_id=d.request_id,
                                       backend=d.backend, slot=d.slot)
            self.fw.waits.hand_off(self.routed.withdraw(now=time.monotonic()))
            self.routed = await self.decide()

    async def told_prompt(self) -> bytes:
        """The prompt the other replicas are told of a claim: the whole once its rest
        is tokenized (the head if that failed)."""
        pending = self.pending
        if pending is not None and not self.whole:
            await asyncio.wait({pending.rest})
            self.take_rest(pending.rest)
        ids = self.tokens if self.whole or pending is None else pending.head
        return to_token_bytes(ids)  # type: ignore[arg-type]

    def claim(self) -> BackendInfo:
        info = self.fw.backends.get(self.routed.backend)
        if info is None:  # removed between the event and now
            self.fw.waits.hand_off(self.routed.abort(now=time.monotonic()))
            raise NoBackendAvailable("backend went away", retry_after=1)
        return info

    async def exchange(self) -> web.StreamResponse:
        await self._take_slot()
        sending = self._send()
        if not runs_on_when_left(self.path, self.body):
            return await sending
        # The backend would not notice this client leave (proxy/forwarding/assemble.py):
        # the exchange then goes on without it, and the model frees the slot when the
        # backend really does (bounded by first_byte_timeout), not when the client left
        task = asyncio.ensure_future(sending)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done():
                self.detached = task
            raise

    async def _take_slot(self) -> None:
        """Wait for the slot of a queued decision, then have the disk tier save what the
        slot holds (a spill) and restore the decision's file into it. Its own method so
        what the slot held (up to a slot's tokens) is not kept through the response."""
        displaced = None
        if self.routed.queued:
            # NOTE: placed with the whole prompt if tokenized by then (take_rest): the
            # slot it waits for may hold more than the head (a summary with its turn);
            # the record's prediction is the hand-off's (pinned there)
            held_at = time.perf_counter()
            displaced = (await self.fw.waits.hold(self.routed, self.info)).displaced
            self.fw.recorder.slot_waited(self.info.name, time.perf_counter() - held_at)
        # the others hear of its slot now: the waits below may last (a posting, a disk
        # restore), and a peer's request must not take that slot meanwhile
        self._tell_start()
        await self.fw.waits.after(self.routed)
        d = self.routed.prediction
        store = self.fw.slot_store(self.info.name)
        if store is not None and d.slot is not None:
            keeps = d.predicted_cached if d.tier == "slot" else 0
            await store.spill(self.info, d.slot, keeps, displaced)
        # the slot is given the saved conversation first: the request then reuses it (not
        # restored: the request is predicted a prefill, never more than it reuses)
        if d.restore is not None and d.slot is not None and store is not None \
                and not await store.restore_into(self.info, d.slot, d.restore):
            self.routed.restore_failed()

    async def _send(self) -> web.StreamResponse:
        info, d = self.info, self.routed.prediction
        out = for_backend(
            self.body, self.path, info, d.slot, recompute=d.recompute,
            lora=self.named_lora(info.name) if self.lora is None else None,
            markers={b.media_marker for b in self.fw.backends.values()} if self.media
            else frozenset())
        self.streams = out.streams
        target = Target(info, d.slot if info.dialect.pins_slots else None,
                        d.predicted_cached, d.tier)
        return await send(Exchange(
            self.fw.upstream, self.request, target, self.path,
            upstream_payload(self.raw, self.body, out.fields), self.outcome,
            relay=self.relay, strip_usage=out.strip_usage, health=self.fw.health,
            first_byte_timeout=self.fw.first_byte_timeout, assemble=out.assemble), self)

    def take_rest(self, task: asyncio.Task[array | None]) -> None:
        # NOTE: as soon as the rest is tokenized, not when the answer comes: requests
        # decided meanwhile see all this one's slot will hold (a summary sent with its
        # turn reuses the turn's tool result there)
        if self.whole or task.cancelled() or task.exception() is not None:
            return
        ids = task.result()
        if ids is not None:
            self.routed.extend(ids, tuple(self.launch(ids).user_starts))
            self.tokens, self.whole = ids, True

    # ExchangeEvents: what `send` tells of the exchange
    def sent(self) -> None:
        # the request is written: the model's bookkeeping runs while the backend works
        self.outcome.sent_at = time.perf_counter()
        self.routed.placed()
        if self.streams:
            self.routed.sending()  # (an answer that comes whole cannot show its launch)
        self._tell_start()

    def _tell_start(self) -> None:
        # the other replicas learn the prompt's place before the answer is over: a
        # client's next turn may reach one of them as soon as it has it (told once)
        d = self.routed.prediction
        tell = self.fw.on_sent
        if tell is not None and self.whole and d.slot is not None:
            tell(d.backend, d.slot, d.request_id,
                 to_token_bytes(self.tokens), self.named_lora(d.backend))  # type: ignore[arg-type]

    def data(self) -> None:
        # NOTE: as the bytes come, not when they are read: another answer read first
        # may hand a queued request a slot meanwhile (see BackendCache.saved_idle)
        if not self.heard:
            self.heard = True
            self.routed.launched()  # (a stream's head comes as its slot joins a batch)
        backend = self.routed.backend
        self.outcome.read(self.router.starts(backend), self.router.unlaunched(backend))

    def first_token(self) -> None:
        self.routed.first_token()

    async def settle(self, target: Target) -> Target:
        # the answer's head came: the server has posted the task (a stream's head comes
        # once its slot is launched), so requests held for it go (see SlotWaits.after)
        self.fw.waits.posted(self.routed)
        # the answer is coming: the model takes the whole prompt before the headers
        # (with the prediction) are written and before any feedback
        if not self.whole:
            assert self.pending is not None
            await asyncio.wait({self.pending.rest})
            self.take_rest(self.pending.rest)  # (a no-op if its callback ran first)
        # (revised since it was sent if another replica's request ran there first)
        self.routed.placed()
        d = self.reported()
        if (target.predicted_cached, target.tier) == (d.predicted_cached, d.tier):
            return target
        return dataclasses.replace(target, predicted_cached=d.predicted_cached, tier=d.tier)

    def reported(self) -> Decision:
        """The prediction the client is shown (and the log line says)."""
        d = self.routed.prediction
        return dataclasses.replace(d, predicted_cached=0, tier="none") if self.no_reuse else d

    def feedback(self) -> None:
        # NOTE: decided by the outcome, not by how the handler ends: a client that
        # closes its connection as soon as it has the stream's last event cancels it
        # in its final write, after the backend finished; an abort there would forget
        # what the slot now holds (its next turn then predicted 0).
        outcome, decision, whole = self.outcome, self.routed.prediction, self.whole
        self.fw.waits.posted(self.routed)  # (ended or failed: nothing waits for it)
        if outcome.complete and 0 < outcome.status < 400 and whole:
            self._complete(outcome, check=not self.no_reuse)
        elif whole and self._left_during_prefill() and decision.slot is not None \
                and self.info.dialect.has_slots:
            # llama-server goes on with a prefill its client left (it notices only when
            # it writes the first token, or after a second with no result): the slot is
            # busy until then, and holds what was prefilled
            self.fw.waits.free_when_idle(self.routed, self.info, self.outcome.status == 200)
        else:
            # a client that leaves once output flows (an interrupted agent turn)
            # leaves its prompt in the slot
            prefilled = whole and outcome.first_token_at is not None
            self.fw.waits.hand_off(self.routed.abort(now=time.monotonic(),
                                                     prefilled=prefilled))

    def _left_during_prefill(self) -> bool:
        """The client left once the request was written and before the first token: the
        answer's head came (the slot launched), or none came yet (the server may still be
        tokenizing or queueing it, or refuse it: see SlotWaits.free_when_idle)."""
        outcome = self.outcome
        return outcome.cancelled and outcome.first_token_at is None \
            and (outcome.status == 200 or (outcome.status == 0 and outcome.sent_at is not None))

    def _complete(self, outcome: Outcome, *, check: bool = True) -> None:
        """Feed a whole answer back; `check`: compare its reuse with the prediction."""
        decision = self.routed.prediction
        output = held_output(outcome, self.fw.tokenize_output)
        self.fw.recorder.log.debug("feedback", request_id=decision.request_id,
                                slot=decision.slot, output_tokens=len(output),
                                reported_slot=outcome.reported_slot)
        self._learn(outcome)
        report = Report(output_tokens=output,
                        reported_cached=outcome.reported_cached if check else None,
                        prompt_ms=outcome.prompt_ms, prompt_n=outcome.prompt_n,
                        reported_slot=outcome.reported_slot,
                        starts_before_end=outcome.starts_before_end,
                        unlaunched_at_end=outcome.unlaunched_at_end)
        self.fw.waits.hand_off(self.routed.complete(report, now=time.monotonic()))
        info = self.fw.backends.get(decision.backend)
        slot = outcome.reported_slot if outcome.reported_slot is not None else decision.slot
        store = self.fw.slot_store(decision.backend)
        if store is not None and info is not None and slot is not None:
            store.note(info, slot)

    def _learn(self, outcome: Outcome) -> None:
        """Ids cut at an image whose positions were not known: learned from the count
        the server reports, and the slot's record takes the whole prompt (the next turn
        then goes on from it as predicted). Ids whole, but not the server's count: the
        counts learned for its images are forgotten."""
        learn, forget = self.fw.learn_media, self.fw.forget_media
        if learn is None or forget is None or not self.media or outcome.prompt_n is None \
                or outcome.reported_cached is None:
            return
        reported = outcome.prompt_n + outcome.reported_cached
        if not cut_short(self.body, self.tokens):
            whole = self.whole or self.pending is None  # (not a head whose rest was lost)
            if whole and reported != len(self.tokens):
                forget(self.body)
            return
        markers = {b.media_marker for b in self.fw.backends.values()}
        ids = learn(self.body, reported, markers)
        if ids is not None and len(ids) > len(self.tokens):
            self.routed.extend(ids, tuple(self.launch(ids).user_starts))
            self.tokens = ids

    def feedback_when_done(self, task: asyncio.Future[web.StreamResponse]) -> None:
        if not task.cancelled():
            task.exception()  # retrieved: a failure there is only the abort below
        try:
            self.feedback()
        finally:
            self.fw.recorder.backend_done(self.info.name)

    def finish(self) -> None:
        try:
            if self.detached is None:
                self.feedback()
            else:
                self.detached.add_done_callback(self.feedback_when_done)
        finally:  # (the gauge, the log line and the span, whatever the feedback did)
            try:
                self.fw.recorder.end(self.endpoint, self.reported(), self.outcome,
                                     self.started, stream=self.body.get("stream") is True,
                                     backend_busy=self.detached is not None,
                                     media_tokens=media_positions(self.tokens)
                                     if self.media and self.whole else 0)
            finally:
                self.fw.tracing.end(self.span, self.reported(), self.outcome)
