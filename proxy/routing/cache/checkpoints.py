"""Context checkpoints: what llama-server can reuse on sliding-window and hybrid models.

A model whose memory cannot be cut back at any token (recurrent or linear-attention
layers, or a sliding-window attention cache holding only the last window) reuses a slot's
prefix only where the server kept a *checkpoint* of that memory, or where what the memory
holds still covers the divergence. The rules below follow the pinned build's
tools/server/server-context.cpp (the prompt loop's checkpoint restore, the batch loop's
checkpoint creation, ``create_checkpoint``); docs/checkpoints.md gives them with the
numbers measured on the demo models, which tests/routing/test_checkpoints.py checks.

Pure functions over plain values: the cache model keeps each slot's and each RAM entry's
checkpoints and asks these what a request reuses and what it leaves behind.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class Memory:
    """How a backend's memory can be cut back, and the server's checkpoint settings."""

    n_swa: int = 0  # sliding window the server applies (0: none, or --swa-full)
    recurrent: bool = False  # recurrent state: the memory holds only the last position
    swa_cells: int = 0  # cells of the sliding-window cache per sequence (n_swa + ubatch)
    max_checkpoints: int = 32  # --ctx-checkpoints
    min_step: int = 8192  # --checkpoint-min-step
    n_ubatch: int = 512
    n_batch: int = 2048
    # bytes of the state that cannot be cut back, per sequence (a sliding window's cells,
    # a recurrent state): saved once with a RAM entry, and once per checkpoint
    partial_bytes: int = 0

    @property
    def checkpointed(self) -> bool:
        """Does the server checkpoint this memory (else any prefix is reused as it is)?"""
        return self.max_checkpoints > 0 and (self.recurrent or self.n_swa > 0)

    def __post_init__(self) -> None:
        if self.n_swa < 0 or self.swa_cells < 0 or self.max_checkpoints < 0:
            raise ValueError("n_swa, swa_cells, max_checkpoints: must be >= 0")
        if self.min_step < 0 or self.n_ubatch < 1 or self.n_batch < 1:
            raise ValueError("min_step must be >= 0, n_ubatch and n_batch >= 1")


DENSE = Memory()


class Checkpoint(NamedTuple):
    """A checkpoint taken before the server processed position ``n_tokens`` (its
    ``pos_max`` is ``n_tokens - 1``)."""

    n_tokens: int
    pos_min: int  # oldest position the checkpointed memory holds
    task: int  # the request that created it (create_checkpoint spares its own)


Checkpoints = tuple[Checkpoint, ...]
Span = tuple[int, int]  # an image or audio chunk's (first, end) token
_FILL = -2  # a media chunk's ids after its first
_SIGN = bytes(int(b >= 0x80) for b in range(256))  # an int32's high byte -> its sign bit


def oldest_held(mem: Memory, n_tokens: int, floor: int) -> int:
    """The oldest position a slot's memory holds after ``n_tokens`` were processed:
    a recurrent state only its last one; a sliding-window cache the last ``swa_cells``
    (never older than ``floor``: what a restore or a RAM load brought back)."""
    if mem.recurrent:
        return n_tokens - 1
    return max(floor, n_tokens - mem.swa_cells)


def loaded_floor(mem: Memory, n_tokens: int) -> int:
    """The oldest position a sliding-window memory holds once loaded back from the RAM
    cache: the state keeps only the window's cells (measured: a continuation reloaded
    reuses up to a checkpoint, not the whole entry)."""
    return max(0, n_tokens - mem.n_swa)


class Reuse(NamedTuple):
    n_past: int  # tokens the server keeps (before it re-evaluates a fully matched one)
    pos_next: int  # checkpoints past this position are erased
    floor: int  # oldest position the memory holds from now on


def reusable(mem: Memory, lcp: int, n_prompt: int, held: int, checkpoints: Checkpoints,
             floor: int) -> Reuse:
    """What the server keeps of a slot whose memory holds ``held`` tokens (its oldest
    position set by ``floor``) and shares ``lcp`` with a prompt of ``n_prompt``: all of
    ``lcp`` while the memory still covers the divergence, else the latest checkpoint at
    or before it that does, else nothing (full re-processing)."""
    if not mem.checkpointed:
        return Reuse(lcp, lcp, floor)
    if lcp <= 0:
        return Reuse(0, 0, 0)
    thold = max(0, lcp - mem.n_swa - (0 if lcp < n_prompt else 1))
    if oldest_held(mem, held, floor) < thold:
        return Reuse(lcp, lcp, floor)
    for ck in reversed(checkpoints):
        pos_max = ck.n_tokens - 1
        if pos_max > lcp:
            continue
        if ck.pos_min < thold or ck.pos_min == 0:
            pos_next = min(lcp, max(ck.pos_min + 1, pos_max))
            return Reuse(min(pos_next, ck.n_tokens), pos_next, ck.pos_min)
    return Reuse(0, 0, 0)


def surviving(checkpoints: Checkpoints, pos_next: int) -> Checkpoints:
    """The checkpoints left once a request starts at ``pos_next``."""
    return tuple(c for c in checkpoints if c.n_tokens - 1 <= pos_next)


class Resumed(NamedTuple):
    """Where a request takes up its slot's memory."""

    start: int  # what it reused
    kept: Checkpoints  # the checkpoints surviving from before
    floor: int  # the oldest position the memory holds


def created(mem: Memory, n_prompt: int, resumed: Resumed, user_starts: Sequence[int],
            task: int, media: Sequence[Span] = ()) -> Checkpoints:
    """The slot's checkpoints once a prompt of ``n_prompt`` tokens is processed from
    where it resumed.

    The server cuts the prompt into batches of at most ``n_batch`` tokens, also at
    ``n - 4 - n_ubatch`` and ``n - 4``, and at a user message's start when it is the last
    user message, or the slot has no checkpoint, or it is ``min_step`` past the last one.
    Before a batch it checkpoints the memory if the batch starts a user message or ends
    near the prompt's end (or is the last), and the slot has none yet, or this is the last
    user message, or it is near the end, or ``min_step`` past the last checkpoint.
    ``media``: the (start, end) of each image or audio chunk, in order. A batch ends
    where a chunk starts; the next one decodes the chunk (and any right after it) whole,
    then text as above, and takes no checkpoint.
    (Batches shared with other slots may be cut elsewhere: not modelled.)"""
    if not mem.checkpointed:
        return ()
    start, kept, floor = resumed
    cps = list(kept)
    users = set(user_starts)
    last_user = user_starts[-1] if user_starts else -1
    n = n_prompt
    chunks = dict(media)
    pos = start
    while pos < n:
        had_media = pos in chunks
        while pos in chunks:
            pos = chunks[pos]
        if pos >= n:
            break
        end = _batch_end(mem, pos, n, user_starts, cps, media)
        near_end = n < end + mem.n_ubatch
        take = (end == n or pos in users or near_end) and pos > 0 and not had_media and (
            not cps or pos == last_user or near_end or pos > cps[-1].n_tokens + mem.min_step)
        if take:
            pos_min = pos - 1 if mem.recurrent else max(floor, pos - mem.swa_cells, 0)
            cps = _add(mem, cps, Checkpoint(pos, pos_min, task))
        pos = end
    return tuple(cps)


def media_spans(prompt: bytes) -> tuple[Span, ...]:
    """The chunks of images or audio in ``prompt`` (native int32 ids). No vocabulary has
    ids below zero: the prompt stage gives each chunk one such id first, then ``-2`` for
    each further position (proxy/prompt/media.py, chunk_ids). A prompt without media costs
    a strided copy and a scan of its ids' high bytes."""
    negative = prompt[3::4].translate(_SIGN)  # 1 where an id is below zero, else 0
    i = negative.find(1)
    if i < 0:
        return ()
    ids = memoryview(prompt).cast("i")
    spans: list[Span] = []
    while i >= 0:
        end = negative.find(0, i)
        end = len(negative) if end < 0 else end
        first = i
        for k in range(i + 1, end):
            if ids[k] != _FILL:
                spans.append((first, k))
                first = k
        spans.append((first, end))
        i = negative.find(1, end)
    return tuple(spans)


def _batch_end(mem: Memory, pos: int, n: int, user_starts: Sequence[int],
               cps: list[Checkpoint], media: Sequence[Span]) -> int:
    """Where the text batch starting at ``pos`` of a prompt of ``n`` ends."""
    last_user = user_starts[-1] if user_starts else -1
    ends = (n - min(mem.n_batch, 4 + mem.n_ubatch), n - min(mem.n_batch, 4))
    end = min(pos + mem.n_batch, n)
    for a, _ in media:
        if pos < a < end:
            end = a
            break
    for e in ends:
        if pos < e < end:
            end = e
    for u in user_starts:
        if pos < u < end and (u == last_user or not cps
                              or u > cps[-1].n_tokens + mem.min_step):
            end = u
            break
    return end


def _add(mem: Memory, cps: list[Checkpoint], new: Checkpoint) -> list[Checkpoint]:
    """create_checkpoint: when the list is full, first drop checkpoints of earlier
    requests within ``min_step`` of their predecessor, then the oldest; one per
    position."""
    if len(cps) + 1 >= mem.max_checkpoints:
        out: list[Checkpoint] = []
        last = -1
        for c in cps:
            if c.task != new.task and last >= 0 and c.n_tokens <= last + mem.min_step:
                continue
            last = c.n_tokens
            out.append(c)
        cps = out
    while cps and len(cps) >= mem.max_checkpoints:
        cps.pop(0)
    cps = [c for c in cps if c.n_tokens != new.n_tokens]
    cps.append(new)
    return cps
