"""The recent past the status page shows: the last routing decisions (a bounded ring)
and reuse and TTFT per 10-second bucket over the last minutes.

The feedback's Recorder adds one entry per routed request, as its log line is written;
entries hold ids, counts and names only, never prompt text (the page may be open on any
operator's screen). The status page's event stream (proxy/server/status_page.py)
subscribes to be told of each entry as it is added.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Entry = dict[str, Any]
Listener = Callable[[Entry], None]

BUCKET_S = 10


@dataclass
class Bucket:
    """The routed requests that ended within one BUCKET_S interval."""

    start: int  # unix seconds, a multiple of BUCKET_S
    requests: int = 0
    prompt_tokens: int = 0  # of the requests whose backend reported its reuse
    reused: int = 0
    predicted: int = 0
    ttft_sum_ms: float = 0.0
    ttft_n: int = 0
    ttft_max_ms: float = 0.0

    def add(self, e: Entry) -> None:
        self.requests += 1
        if e.get("reported_cached") is not None:
            self.prompt_tokens += e.get("prompt_tokens") or 0
            self.reused += e["reported_cached"]
            self.predicted += e.get("predicted_cached") or 0
        ttft = e.get("ttft_ms")
        if ttft is not None:
            self.ttft_sum_ms += ttft
            self.ttft_n += 1
            self.ttft_max_ms = max(self.ttft_max_ms, ttft)

    def as_dict(self) -> dict[str, object]:
        return {"start": self.start, "requests": self.requests,
                "prompt_tokens": self.prompt_tokens, "reused": self.reused,
                "predicted": self.predicted,
                "ttft_mean_ms": round(self.ttft_sum_ms / self.ttft_n, 1) if self.ttft_n
                else None,
                "ttft_max_ms": round(self.ttft_max_ms, 1) if self.ttft_n else None}


class RecentActivity:
    """The last ``size`` decisions and the buckets of the last ``window_s`` seconds."""

    def __init__(self, size: int = 200, window_s: int = 600,
                 clock: Callable[[], float] = time.time) -> None:
        self._ring: deque[Entry] = deque(maxlen=size)
        self._n_buckets = max(1, window_s // BUCKET_S)
        self._buckets: deque[Bucket] = deque(maxlen=self._n_buckets)
        self._listeners: list[Listener] = []
        self._clock = clock

    def add(self, entry: Entry) -> None:
        """One routed request ended; listeners must not raise (they run in the caller)."""
        now = self._clock()
        entry = {"at": round(now, 3), **entry}
        self._ring.append(entry)
        self._bucket(int(now)).add(entry)
        for listener in self._listeners:
            listener(entry)

    def decisions(self) -> list[Entry]:
        """The ring, oldest first."""
        return list(self._ring)

    def series(self) -> list[dict[str, object]]:
        """Every bucket of the window, oldest first; those with no request too, so that
        a chart's axis is time."""
        now = int(self._clock()) // BUCKET_S * BUCKET_S
        have = {b.start: b for b in self._buckets}
        starts = range(now - (self._n_buckets - 1) * BUCKET_S, now + 1, BUCKET_S)
        return [(have.get(s) or Bucket(s)).as_dict() for s in starts]

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener`` with each new entry; returns the unsubscribe."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def _bucket(self, now: int) -> Bucket:
        start = now // BUCKET_S * BUCKET_S
        if not self._buckets or self._buckets[-1].start < start:
            self._buckets.append(Bucket(start))
        return self._buckets[-1]
