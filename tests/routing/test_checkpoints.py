"""Context checkpoints (proxy/routing/cache/checkpoints.py): the numbers the pinned
llama-server gives on the demo models (tests/backends/test_demo_models.py measures them,
docs/checkpoints.md states them), and the batch-by-batch creation against a
token-by-token replay of the server's loop."""

from __future__ import annotations

from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.routing.cache.checkpoints import (
    DENSE,
    Checkpoint,
    Memory,
    Resumed,
    created,
    loaded_floor,
    media_spans,
    reusable,
    surviving,
)
from proxy.routing.cache.model import BackendCache
from proxy.routing.cache.values import BackendCapacity
from proxy.routing.tree.radix import RadixTree
from proxy.routing.tree.token_bytes import to_token_bytes

SWA = Memory(n_swa=256, swa_cells=768)
HYBRID = Memory(recurrent=True)
N = 1000
GEN = 3  # generated tokens the slot holds after n_predict 4
FRESH = Resumed(0, (), 0)  # a prompt processed from its start


def first(mem: Memory) -> tuple[Checkpoint, ...]:
    return created(mem, N, FRESH, (), task=1)


@pytest.mark.parametrize("mem, points", [
    (SWA, [(484, 0), (996, 228)]),
    (HYBRID, [(484, 483), (996, 995)]),
    (DENSE, []),
])
def test_checkpoints_of_a_fresh_prompt(mem: Memory, points: list[tuple[int, int]]) -> None:
    assert [(c.n_tokens, c.pos_min) for c in first(mem)] == points


@pytest.mark.parametrize("mem, shared, n_past", [
    (SWA, 300, 0), (SWA, 488, 483), (SWA, 700, 700), (SWA, 999, 999),
    (HYBRID, 300, 0), (HYBRID, 488, 484), (HYBRID, 700, 484), (HYBRID, 999, 996),
    (DENSE, 300, 300), (DENSE, 700, 700),
    # a continuation (the whole slot, then more): everything
    (SWA, N + GEN, N + GEN), (HYBRID, N + GEN, N + GEN),
])
def test_a_call_diverging_from_the_slot(mem: Memory, shared: int, n_past: int) -> None:
    r = reusable(mem, shared, N + 50, N + GEN, first(mem), 0)
    assert r.n_past == n_past


@pytest.mark.parametrize("mem, n_past", [(SWA, N), (HYBRID, 996), (DENSE, N)])
def test_the_same_prompt_again(mem: Memory, n_past: int) -> None:
    # (the server then re-evaluates the last token: 999 on SWA and dense)
    assert reusable(mem, N, N, N + GEN, first(mem), 0).n_past == n_past


@pytest.mark.parametrize("mem, n_past", [(SWA, 995), (HYBRID, N + GEN), (DENSE, N + GEN)])
def test_a_continuation_loaded_back_from_ram(mem: Memory, n_past: int) -> None:
    held = N + GEN
    assert reusable(mem, held, held + 50, held, first(mem),
                    loaded_floor(mem, held)).n_past == n_past


CHAT_N, USERS = 1790, (665, 1233)  # system prompt of 665 tokens, two user messages


@pytest.mark.parametrize("mem", [SWA, HYBRID])
def test_a_chat_prompt_is_checkpointed_at_its_user_messages(mem: Memory) -> None:
    cps = created(mem, CHAT_N, FRESH, USERS, task=1)
    assert [c.n_tokens for c in cps] == [665, 1233, 1274, 1786]


@pytest.mark.parametrize("mem, shared, n_past", [
    (SWA, 1236, 1232), (HYBRID, 1236, 1233),  # same history, new last user message
    (SWA, 668, 664), (HYBRID, 668, 665),  # same system prompt, a title call
])
def test_chat_side_calls(mem: Memory, shared: int, n_past: int) -> None:
    cps = created(mem, CHAT_N, FRESH, USERS, task=1)
    assert reusable(mem, shared, shared + 40, CHAT_N + GEN, cps, 0).n_past == n_past


def test_a_resumed_prompt_adds_checkpoints_near_its_end() -> None:
    cps = first(HYBRID)
    r = reusable(HYBRID, N + GEN, N + 100, N + GEN, cps, 0)
    kept = surviving(cps, r.pos_next)
    after = created(HYBRID, N + 100, Resumed(r.n_past, kept, r.floor), (), task=2)
    # the first new batch is near the end: a checkpoint where it resumes, and at n - 4
    assert [c.n_tokens for c in after] == [484, 996, N + GEN, N + 96]


def test_a_full_list_drops_the_oldest_first() -> None:
    mem = Memory(recurrent=True, max_checkpoints=2, min_step=0)
    cps = created(mem, N, FRESH, (), task=1)
    later = created(mem, 2000, Resumed(N, cps, 0), (), task=2)
    assert [c.n_tokens for c in later] == [1484, 1996]


def test_the_model_predicts_side_calls_on_a_hybrid_slot() -> None:
    tree = RadixTree()
    cache = BackendCache(BackendCapacity("h", 1, 8192, 0, 2048, memory=HYBRID), tree)
    prompt = list(range(10, 10 + N))
    cache.start(0, to_token_bytes(prompt), {}, {}, N)
    cache.finish_generated(0, to_token_bytes([1, 2, 3]))
    for shared, n_past in ((300, 0), (488, 484), (700, 484), (999, 996)):
        p = cache.predict(0, {0: shared}, {}, N + 50)
        assert p is not None and p.reuse == n_past, shared


def _ids(*parts: list[int] | tuple[bytes, int]) -> bytes:
    from proxy.prompt.media import chunk_ids

    out = array("i")
    for p in parts:
        out.extend(chunk_ids(*p) if isinstance(p, tuple) else p)
    return out.tobytes()


@pytest.mark.parametrize("prompt, spans", [
    (_ids([5, 6, 7]), ()),
    (_ids([5, 6], (b"a" * 32, 4), [7]), ((2, 6),)),
    # two images side by side, one of a single position, one at the end
    (_ids([5], (b"a" * 32, 3), (b"b" * 32, 1), [9], (b"c" * 32, 2)),
     ((1, 4), (4, 5), (6, 8))),
    (_ids((b"d" * 32, 2), [255, 65535, 1 << 20]), ((0, 2),)),
], ids=["text", "one", "three", "first"])
def test_media_chunks_are_read_from_the_ids(prompt: bytes, spans: tuple[tuple[int, int], ...]
                                            ) -> None:
    assert media_spans(prompt) == spans


def test_a_batch_ends_where_an_image_starts_and_the_next_takes_no_checkpoint() -> None:
    """The last user message (at 500) holds an image at 520..620: no checkpoint where
    the text after it starts; the ones near the prompt's end as without it."""
    n, users = 1000, (500,)
    plain = created(SWA, n, FRESH, users, 1)
    with_image = created(SWA, n, FRESH, users, 1, ((520, 620),))
    assert [c.n_tokens for c in plain] == [484, 500, 996]
    assert [c.n_tokens for c in with_image] == [484, 500, 996]
    # an image where the end batch would start: the batch after it takes none
    late = created(SWA, n, FRESH, users, 1, ((400, 484),))
    assert [c.n_tokens for c in late] == [500, 996]


# ---------------------------------------------------------------- brute force
def _reference(mem: Memory, n: int, start: int, users: tuple[int, ...],
               kept: tuple[Checkpoint, ...], floor: int, task: int,
               media: tuple[tuple[int, int], ...] = ()) -> tuple[Checkpoint, ...]:
    """The server's prompt loop, a token at a time (server-context.cpp): a media chunk
    decoded whole where an iteration starts on it, text up to the next chunk."""
    cps = list(kept)
    last_user = users[-1] if users else -1
    chunk_end = dict(media)
    done = start
    while done < n:
        had_media = done in chunk_end
        while done in chunk_end:
            done = chunk_end[done]
        if done >= n:
            break
        first_pos, added = done, 0
        while done < n and added < mem.n_batch:
            if done in chunk_end:  # a placeholder token: the text chunk ends
                break
            done += 1
            added += 1
            if done in users and (done == last_user or not cps
                                  or done > cps[-1].n_tokens + mem.min_step):
                break
            if any(n == done + min(mem.n_batch, off) for off in (4 + mem.n_ubatch, 4)):
                break
        near_end = n < done + mem.n_ubatch
        do = done == n or first_pos in users or near_end
        do = do and first_pos > 0 and not had_media
        do = do and (not cps or first_pos == last_user or near_end
                     or first_pos > cps[-1].n_tokens + mem.min_step)
        if not do:
            continue
        if len(cps) + 1 >= mem.max_checkpoints:
            i, last = 0, -1
            while i < len(cps):
                c = cps[i]
                if c.task != task and last >= 0 and c.n_tokens <= last + mem.min_step:
                    del cps[i]
                    continue
                last = c.n_tokens
                i += 1
        while len(cps) >= mem.max_checkpoints:
            del cps[0]
        cps = [c for c in cps if c.n_tokens != first_pos]
        pos_min = first_pos - 1 if mem.recurrent else max(floor, first_pos - mem.swa_cells, 0)
        cps.append(Checkpoint(first_pos, pos_min, task))
    return tuple(cps)


Case = tuple[Memory, int, int, tuple[int, ...], tuple[Checkpoint, ...], int,
             tuple[tuple[int, int], ...]]


@st.composite
def _cases(draw: st.DrawFn) -> Case:
    n_batch = draw(st.integers(2, 600))
    mem = Memory(n_swa=draw(st.integers(0, 64)), recurrent=draw(st.booleans()),
                 swa_cells=draw(st.integers(0, 200)),
                 max_checkpoints=draw(st.integers(1, 5)), min_step=draw(st.integers(0, 400)),
                 n_ubatch=draw(st.integers(1, n_batch)), n_batch=n_batch)
    n = draw(st.integers(1, 2500))
    start = draw(st.integers(0, n - 1))
    # media chunks after the start, apart, none at the prompt's end (chat prompts end in
    # text); no user message starts inside one (the server's spans skip them)
    cuts = sorted(draw(st.sets(st.integers(start, max(start, n - 1)), max_size=8)))
    media = tuple((a, b) for a, b in zip(cuts[::2], cuts[1::2], strict=False) if a < b)
    inside = {i for a, b in media for i in range(a + 1, b)}
    users = tuple(sorted(u for u in draw(st.sets(st.integers(1, max(1, n - 1)), max_size=6))
                         if u not in inside))
    marks = sorted(draw(st.sets(st.integers(1, max(1, start)), max_size=5))) if start else []
    kept = tuple(Checkpoint(m, max(0, m - 50), draw(st.integers(0, 2))) for m in marks)
    return mem, n, start, users, kept, draw(st.integers(0, 100)), media


@settings(max_examples=600, deadline=None)
@given(_cases())
def test_created_matches_the_servers_loop(case: Case) -> None:
    mem, n, start, users, kept, floor, media = case
    if not mem.checkpointed:
        assert created(mem, n, Resumed(start, kept, floor), users, 3, media) == ()
        return
    assert created(mem, n, Resumed(start, kept, floor), users, 3, media) == \
        _reference(mem, n, start, users, kept, floor, 3, media)


@pytest.mark.parametrize("mem, whole", [(HYBRID, True), (SWA, True), (DENSE, False)])
def test_a_checkpointed_backend_is_routed_on_the_whole_prompt(mem: Memory, whole: bool
                                                              ) -> None:
    from proxy.routing.decision import NeedWholePrompt
    from proxy.routing.router import Router

    router = Router("prefix")
    router.add_backend(BackendCapacity("h", 1, 8192, 0, 2048, memory=mem))
    assert router.wants_user_starts is (mem is not DENSE)
    got = router.decide(list(range(10, 500)), n_prompt=900)
    assert isinstance(got, NeedWholePrompt) is whole
