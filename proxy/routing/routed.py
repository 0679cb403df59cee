"""The live record of one routed request (`Routed`), and the router's entry behind it.

`Router.decide` returns a `Routed`; the forwarder holds it for the request's life and
tells it what happens: `placed()` once the request is written, `posted()` once its
answer's head came (the server has posted it), `extend(ids)` when the rest
of a prompt decided on its head is tokenized, `first_token()`, and `complete(...)` or
`abort(...)` at the end (`withdraw()` instead of sending it: it moves). `prediction` is
read before it is sent (``after``), when the answer's headers are written and when its
log line is: the router keeps it current (the deferred slot model update, another
replica's request run first, the whole prompt, a hand-off, a failed restore), so no
caller keeps or revises a copy.

The router keeps the entries of the requests in flight by id too, for the events that
come by id (another replica's, a backend leaving); the record's own calls need no lookup.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple, Protocol

from proxy.routing.cache.lora import Lora
from proxy.routing.decision import Decision, Handoff, Report


class Prior(NamedTuple):
    """What the slot a claim takes held before it: given back if it is withdrawn (never
    sent), and compared with its whole prompt when it was decided on a head."""

    sequence: bytes | None  # (None: empty, or not known)
    session: str | None  # the session hint of the request last placed there
    common: int  # its leading tokens other holders have too (BackendCache.common_part)


@dataclass
class Inflight:
    """The router's entry for one request in flight (the model's side of a `Routed`)."""

    backend: str
    slot: int | None  # slot the model placed it in (None: queued on the server)
    prompt: bytes
    n: int
    work: int
    started: float
    # decided on the head of its prompt (see `Router.extend`): what the holder it reuses
    # from had beyond that head, when it held all of it
    beyond: bytes | None = None
    session: str | None = None  # the client's session hint
    user_starts: tuple[int, ...] = ()  # where its prompt's user messages start
    lora: Lora | None = None  # the adapters it names (None: no `lora` field)
    prefilled: bool = False  # its first token came
    prediction: Decision | None = None  # what the caller shows: set as it is decided
    live: bool = True  # False once it ended, or its backend left the model
    observed: bool = False  # another replica's request (see ObservedRequests)
    prior: Prior | None = None  # a claim's slot before it (see Decision.claims)

    def revise(self, reuse: int, tier: str) -> None:
        """The model found another reuse (and tier) for it than it predicted."""
        d = self.prediction
        if d is not None:
            self.prediction = replace(d, predicted_cached=reuse, tier=tier,
                                      reasons={**d.reasons, "reuse": reuse, "tier": tier})

    def wait_for(self, creator: int | None) -> None:
        """It is sent after ``creator``, not known posted yet: that start creates the RAM
        entry it loads, or saves the slot it keeps (None: no such request; see
        ``Decision.after``)."""
        d = self.prediction
        if d is not None and d.after != creator:
            self.prediction = replace(d, after=creator)


class Ledger:
    """The requests in flight by id, this replica's and those other replicas told of: for
    the events that come by id (a hand-off, a peer's request, a backend leaving)."""

    def __init__(self) -> None:
        self._entries: dict[int, Inflight] = {}
        self._next_id = 0

    def new_id(self) -> int:
        rid = self._next_id
        self._next_id += 1
        return rid

    def add(self, rid: int, entry: Inflight) -> Inflight:
        self._entries[rid] = entry
        return entry

    def get(self, rid: int) -> Inflight | None:
        return self._entries.get(rid)

    def __getitem__(self, rid: int) -> Inflight:
        return self._entries[rid]

    def __len__(self) -> int:
        return len(self._entries)

    def end(self, rid: int) -> None:
        """``rid`` is over (ended, or its backend left the model)."""
        entry = self._entries.pop(rid)
        entry.live = False

    def on(self, backend: str) -> list[tuple[int, Inflight]]:
        """The requests in flight on ``backend``, oldest first."""
        return [(rid, f) for rid, f in self._entries.items() if f.backend == backend]


class Owner(Protocol):
    """What a record asks of the router that owns it (`Router`)."""

    def place(self, routed: Routed) -> Routed: ...

    def posted(self, routed: Routed) -> None: ...

    def extend(self, routed: Routed, tokens: Sequence[int] | array | bytes,
               user_starts: tuple[int, ...] = ()) -> Routed: ...

    def restore_failed(self, routed: Routed) -> Routed: ...

    def wait_overdue(self, routed: Routed, now: float) -> bool: ...

    def prefilled(self, routed: Routed) -> None: ...

    def sending(self, routed: Routed) -> None: ...

    def launched(self, routed: Routed) -> None: ...

    def complete(self, routed: Routed, report: Report = ..., *,
                 now: float = 0.0) -> list[Handoff]: ...

    def abort(self, routed: Routed, *, now: float = 0.0, prefilled: bool = False,
              held: int | None = None) -> list[Handoff]: ...

    def withdraw(self, routed: Routed, *, now: float = 0.0) -> list[Handoff]: ...


class Routed:
    """One routed request, as the router sees it now (see the module doc)."""

    __slots__ = ("_router", "entry")

    def __init__(self, router: Owner, entry: Inflight) -> None:
        self._router = router
        self.entry = entry

    @property
    def prediction(self) -> Decision:
        p = self.entry.prediction
        assert p is not None, "recorded with its prediction"
        return p

    # the prediction's fields, read as a Decision's
    @property
    def request_id(self) -> int:
        return self.prediction.request_id

    @property
    def backend(self) -> str:
        return self.prediction.backend

    @property
    def slot(self) -> int | None:
        return self.prediction.slot

    @property
    def predicted_cached(self) -> int:
        return self.prediction.predicted_cached

    @property
    def prompt_tokens(self) -> int:
        return self.prediction.prompt_tokens

    @property
    def tier(self) -> str:
        return self.prediction.tier

    @property
    def queued(self) -> bool:
        return self.prediction.queued

    @property
    def restore(self) -> str | None:
        return self.prediction.restore

    @property
    def reasons(self) -> dict[str, object]:
        return self.prediction.reasons

    def placed(self) -> Decision:
        """The request is written to its backend: the slot model's update deferred at
        `decide` runs now (if nothing ran it before). Returns the prediction."""
        self._router.place(self)
        return self.prediction

    def posted(self) -> None:
        """The request is known posted on its server: its answer's head came (see
        `Router.posted`)."""
        self._router.posted(self)

    def extend(self, tokens: Sequence[int] | array | bytes,
               user_starts: tuple[int, ...] = ()) -> None:
        """The whole prompt of a request decided on its head (see `Router.extend`)."""
        self._router.extend(self, tokens, user_starts)

    def restore_failed(self) -> None:
        """The disk file chosen for its slot was not restored (see `Router.restore_failed`)."""
        self._router.restore_failed(self)

    def wait_overdue(self, now: float) -> bool:
        """Has it waited for a busy slot well past that slot's expected end?"""
        return self._router.wait_overdue(self, now)

    def first_token(self) -> None:
        self._router.prefilled(self)

    def sending(self) -> None:
        """It is written to its backend, its answer streamed: its launch is heard when
        the stream's head comes (`launched`). See `Report.unlaunched_at_end`."""
        self._router.sending(self)

    def launched(self) -> None:
        """The server launched it: its stream's head came."""
        self._router.launched(self)

    def complete(self, report: Report, *, now: float = 0.0) -> list[Handoff]:
        """It ended with an answer (see `Router.complete`): the hand-offs it made."""
        return self._router.complete(self, report, now=now)

    def abort(self, *, now: float = 0.0, prefilled: bool = False,
              held: int | None = None) -> list[Handoff]:
        """It failed or was cancelled (see `Router.abort`): the hand-offs it made."""
        return self._router.abort(self, now=now, prefilled=prefilled, held=held)

    def withdraw(self, *, now: float = 0.0) -> list[Handoff]:
        """It is not sent where it was decided (see `Router.withdraw`): the hand-offs
        it made."""
        return self._router.withdraw(self, now=now)

    def __repr__(self) -> str:
        return f"Routed({self.entry.prediction!r})"
