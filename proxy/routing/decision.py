"""What the router answers: a `Decision` (or `NoBackend`), and `Handoff`s of queued requests;
and what it is told back of an answer (`Report`).

Plain values, shared by the router (proxy/routing/router.py), the pipeline that acts on them
(proxy/forwarding/attempt.py) and the recorder that logs them (proxy/reporting/recorder.py).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class Decision:
    request_id: int
    backend: str
    slot: int | None  # slot to pin via id_slot, or None = let the server pick
    predicted_cached: int  # tokens we expect the backend to reuse
    prompt_tokens: int
    tier: str  # "slot" | "ram" | "none"
    reasons: dict[str, object]  # JSON-serialisable, for one log line
    # every slot was busy: the request waits for one (unpinned, predicted from the slot it
    # will get); see Handoff for holding it in the caller instead of the server's queue
    queued: bool = False
    # a file of the disk tier to restore into ``slot`` before sending (see SlotStore)
    restore: str | None = None
    # it takes a slot whose content it does not go on from (an empty one, or another
    # conversation's): replicas that chose that slot at once settle who keeps it
    # (proxy/replicas/claims.py)
    claims: bool = False
    # the request whose start creates the RAM entry this one loads (or, handed a slot, saves
    # that slot as an idle one before this one keeps its content), while it is not known
    # posted on the server: send this one only once it is (proxy/routing/posting.py)
    after: int | None = None
    # send it with cache_prompt false: the server loads into its slot a RAM entry made
    # under other LoRA adapters and would run over that KV (see Placement.recompute)
    recompute: bool = False


@dataclass(frozen=True)
class Handoff:
    """A queued request the model just gave a freed slot (returned by complete/abort).

    Why it exists: the server takes deferred requests in the order its HTTP threads
    *post* them, which for requests arriving together is not the order they were
    decided in; an unpinned queued request can thus overtake a request pinned to an idle
    slot and take that slot (observed in the e2e spread test: the two swap reuse, both
    mispredicted). A caller that holds ``Decision.queued`` requests until their hand-off
    and only then sends them, pinned to ``slot`` (idle by then: the server releases a
    slot right after its final response), removes that race. The model placed it by the
    server's own unpinned pick, so pinning it changes nothing except for an empty slot
    (a pinned request there cannot load from RAM). ``predicted_cached`` is the model's
    reuse at hand-off, from ``tier``.

    ``restore``: a file of the disk tier to restore into the slot first (a queued
    request is placed only now, so only now can the router tell the slot will not hold
    its prefix while a file does). ``displaced``: what the slot held when handed over
    (None: empty, or the request's own continuation): the slot's last turn may have
    ended a moment ago, and the disk tier saves it before the request replaces it.
    ``after``: as ``Decision.after``."""

    request_id: int
    backend: str
    slot: int
    predicted_cached: int
    tier: str = "slot"
    restore: str | None = None
    displaced: bytes | None = field(default=None, compare=False, repr=False)
    after: int | None = None


@dataclass(frozen=True)
class Report:
    """What the backend reported of a request that ended with an answer (for
    ``complete``): the ids it generated (the slot holds them after the prompt), the
    prompt tokens it reused and evaluated and how long that took, the slot it ran in;
    ``starts_before_end``: ``Router.starts(backend)`` when the proxy last read what the
    server sent before the step that ended the request: tasks started later were
    launched after its slot was freed (see ``BackendCache.saved_idle``).
    ``unlaunched_at_end``: ``Router.unlaunched(backend)`` as the answer's last bytes came:
    requests sent whose stream's head had not come then. The server sends that head
    when the task's slot first joins a batch, usually the step that launches it; a
    request still unheard when another's answer ended was then most likely launched
    after that answer's slot was freed (its HTTP thread still tokenizing a long prompt),
    and the server saved that slot as an idle one (see outcomes._saved_at for
    when it may not have)."""

    output_tokens: Sequence[int] | array | bytes = ()
    reported_cached: int | None = None
    prompt_ms: float | None = None
    prompt_n: int | None = None
    reported_slot: int | None = None
    starts_before_end: int | None = None
    unlaunched_at_end: int = 0


@dataclass(frozen=True)
class NeedWholePrompt:
    """Decided on the head of its prompt (``Router.decide(n_prompt=...)``), the request
    may go on from a holder further than the choice reuses, which only the rest of the
    prompt shows (proxy/routing/head.py), so it is not moved off its history on the
    head's word. Nothing was recorded: decide again with the whole prompt."""

    most_held: int  # tokens of the head the best holder has
    reuse: int  # what the head-based choice would have reused


NoBackendKind = Literal["unavailable", "too_long", "empty"]


@dataclass(frozen=True)
class NoBackend:
    """No backend can take the request (a result, not an exception).

    ``kind`` is for the caller's status code; ``reason`` is for humans and may change:
    - "unavailable": no (healthy) backend right now -> 503, retry later;
    - "too_long": the prompt does not fit any backend's slot context -> 400 (client);
    - "empty": an empty prompt -> 400 (client).
    """

    reason: str
    kind: NoBackendKind = "unavailable"
