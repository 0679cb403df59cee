"""What an answer's stream says of when its request ended on the server."""

from __future__ import annotations

import pytest

from proxy.reporting.outcome import Outcome


def token(text: str) -> dict[str, object]:
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}


def final(reason: str) -> dict[str, object]:
    return {"choices": [{"index": 0, "delta": {}, "finish_reason": reason}],
            "timings": {"cache_n": 3, "prompt_n": 40}}


HEAD: list[dict[str, object]] = []  # a read of the stream's head: no chunk yet


@pytest.mark.parametrize(("reads", "want"), [
    # (chunks in one read, tasks started by then); the last token came in the last
    # step of an answer cut at its length: starts after the token before it count
    ([(HEAD, 0), ([token("a")], 0), ([token("b")], 1), ([final("length")], 1)], 0),
    ([(HEAD, 0), ([token("a")], 1), ([token("b")], 1), ([final("length")], 2)], 1),
    # the last two tokens read together: the read before them is the reference
    ([(HEAD, 0), ([token("a")], 0), ([token("b"), token("c"), final("length")], 2)], 0),
    # stopped on an end-of-generation token: its text came a step before the end
    ([(HEAD, 0), ([token("a")], 0), ([token("b")], 1), ([final("stop")], 2)], 1),
    # one token, cut at its length: sent in the step after the head (its launch)
    ([(HEAD, 0), ([token("a"), final("length")], 3)], 0),
    # read whole (no stream) or without text: the last read
    ([([{**token("a"), **final("length")}], 4)], 4),
    ([(HEAD, 0), ([final("stop")], 2)], 2),
])
def test_starts_before_end(reads: list[tuple[list[dict[str, object]], int]],
                           want: int) -> None:
    o = Outcome(started=0.0)
    for chunks, starts in reads:
        for c in chunks:
            o.absorb(c)
        o.read(starts)
    assert o.starts_before_end == want
