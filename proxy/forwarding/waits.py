"""Requests held until the router hands them a slot, and slots watched until their
server is done with them: the waiting side of the forwarder."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

import aiohttp

from backends.client import BackendClient
from backends.info import BackendInfo
from proxy.errors import NoBackendAvailable
from proxy.reporting.recorder import Recorder
from proxy.routing.decision import Handoff
from proxy.routing.routed import Routed
from proxy.routing.router import Router

# A slot whose client left during its prefill is watched until its server is done with
# it, for at most FREE_WAIT_MARGIN_S + twice the rest of the prefill.
FREE_WAIT_MARGIN_S = 10.0
# A request held until the request it is sent after is known posted (see
# `SlotWaits.after`) is sent anyway after this long (or first_byte_timeout)
AFTER_WAIT_S = 10.0
# ... and checks this often whether the router still has that request unposted (it may
# have ended, or its backend left, without its attempt telling)
AFTER_CHECK_S = 0.5


class BackendLeft(NoBackendAvailable):
    """The backend (or busy slot) a held request waited for went away (or is taking far
    longer than expected); nothing was sent: retry."""


class SlotWaits:
    def __init__(self, router: Router, backends: Mapping[str, BackendInfo],
                 recorder: Recorder, first_byte_timeout: float | None,
                 session: aiohttp.ClientSession | None) -> None:
        self.router, self.backends, self.recorder = router, backends, recorder
        self.first_byte_timeout = first_byte_timeout
        self.session = session  # for /slots; None: not asked
        # requests the router queued (every slot busy), held here until it hands them a
        # slot: see `hold`
        self._held: dict[int, asyncio.Future[Handoff]] = {}
        self._freeing: set[asyncio.Task[None]] = set()
        # request id -> resolved once that request is known posted, and how many wait
        # for it (see `after`)
        self._posting: dict[int, tuple[asyncio.Future[None], int]] = {}

    async def hold(self, routed: Routed, info: BackendInfo) -> Handoff:
        """Keep a queued request here until the router hands it a freed slot, then send
        it pinned there. Sent at once instead, it would wait in llama-server's queue, and
        the server takes queued requests in the order its HTTP threads post them, not
        the order they were decided: a request that arrived a moment later could take
        the slot this one was predicted to get (see `Handoff`). Nothing is sent while
        waiting; if the backend goes away (or restarts: a new `BackendInfo`), the caller
        retries elsewhere."""
        fut: asyncio.Future[Handoff] = asyncio.get_running_loop().create_future()
        self._held[routed.request_id] = fut
        try:
            while True:
                done, _ = await asyncio.wait({fut}, timeout=1.0)
                if done:
                    return fut.result()
                if self.backends.get(routed.backend) is not info:
                    raise BackendLeft(f"backend {info.name} went away", retry_after=1)
                if routed.wait_overdue(time.monotonic()):
                    raise BackendLeft(f"the busy slot of {info.name} waited for is taking "
                                      "long", retry_after=1)
        finally:
            self._held.pop(routed.request_id, None)

    async def after(self, routed: Routed) -> None:
        """Hold a request predicted to load a RAM entry that another request's start
        creates (or handed a slot that start saves as an idle one, whose content it
        keeps) until that request is known posted on the server (`posted`): the server
        launches tasks in the order its HTTP threads post them, and a long prompt's
        tokenization there posts it after a short one sent a moment later, whose lookup
        would then come before the entry exists (or which would take the slot before the
        save). Released at once if that request ends or its backend leaves; sent anyway
        after AFTER_WAIT_S (or first_byte_timeout)."""
        creator = self.router.held_for(routed)
        if creator is None:
            return
        loop = asyncio.get_running_loop()
        limit = AFTER_WAIT_S if self.first_byte_timeout is None \
            else min(AFTER_WAIT_S, self.first_byte_timeout)
        began = loop.time()
        fut, waiting = self._posting.get(creator) or (loop.create_future(), 0)
        self._posting[creator] = (fut, waiting + 1)
        try:
            while not fut.done() and self.router.unposted(creator):
                left = began + limit - loop.time()
                if left <= 0:
                    break
                await asyncio.wait({fut}, timeout=min(left, AFTER_CHECK_S))
        finally:
            self._unwait(creator, fut)
        posted = fut.done() or not self.router.unposted(creator)
        self.recorder.log.debug("waited_for_posting", request_id=routed.request_id,
                                after=creator, posted=posted,
                                seconds=round(loop.time() - began, 4))

    def _unwait(self, creator: int, fut: asyncio.Future[None]) -> None:
        """One waiter for ``creator`` is done: the last one takes its future away (the
        creator may end without `posted`: withdrawn, aborted by its replica)."""
        got = self._posting.get(creator)
        if got is None or got[0] is not fut:
            return
        if got[1] <= 1:
            del self._posting[creator]
        else:
            self._posting[creator] = (fut, got[1] - 1)

    def posted(self, routed: Routed) -> None:
        """`routed`'s request is known posted on its server (its answer's head came), or
        it ended: the requests held for it (`after`) go."""
        routed.posted()
        got = self._posting.pop(routed.request_id, None)
        if got is not None and not got[0].done():
            got[0].set_result(None)

    def hand_off(self, handoffs: list[Handoff]) -> None:
        for h in handoffs:
            fut = self._held.pop(h.request_id, None)
            if fut is not None and not fut.done():
                fut.set_result(h)

    def free_when_idle(self, routed: Routed, info: BackendInfo, launched: bool) -> None:
        """Free `routed`'s slot once its backend is done with it, holding what /slots
        says it does (unknown, as on any abort, when it cannot tell in time). Not known
        `launched` (no answer's head came) and never seen processing, the request may
        not have run there: the count /slots gives is then the slot's earlier task's,
        not a prefix of this prompt, and what the slot holds is unknown."""
        decision = routed.prediction
        assert decision.slot is not None
        prefill = self.router.prefill_s(info.name, decision.predicted_cached,
                                        decision.prompt_tokens)
        limit = FREE_WAIT_MARGIN_S + 2 * (prefill if prefill is not None else
                                          decision.prompt_tokens - decision.predicted_cached)
        if self.first_byte_timeout is not None:
            limit = min(limit, self.first_byte_timeout)

        async def free(slot: int) -> None:
            held = None
            try:
                if self.session is not None:
                    client = BackendClient(self.session, info.url, info.api_key)
                    state, seen = await client.slot_when_idle(slot, limit)
                    ran = launched or seen
                    held = state.n_prompt_tokens if state is not None and ran else None
            finally:
                self.recorder.log.debug("freed_when_idle", request_id=decision.request_id,
                                        backend=info.name, slot=slot, held=held)
                self.hand_off(routed.abort(now=time.monotonic(), held=held))

        task = asyncio.create_task(free(decision.slot))
        self._freeing.add(task)
        task.add_done_callback(self._freeing.discard)

    async def close(self) -> None:
        """Stop watching slots to free (the app is closing)."""
        for task in list(self._freeing):
            task.cancel()
        await asyncio.gather(*self._freeing, return_exceptions=True)
