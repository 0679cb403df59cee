"""What the proxy records of each routed request: metrics, its one log line, and its
entry among the status page's recent decisions."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from proxy.errors import UpstreamTimeout
from proxy.observability.metrics import ProxyMetrics
from proxy.observability.recent import RecentActivity
from proxy.reporting.outcome import Outcome

if TYPE_CHECKING:
    from proxy.routing.decision import Decision


class Recorder:
    """Metrics and the one log line of each routed request (and its entry among the
    status page's recent decisions, when ``recent`` is given)."""

    def __init__(self, metrics: ProxyMetrics, log: Any,
                 recent: RecentActivity | None = None) -> None:
        self.metrics = metrics
        self.log = log
        self.recent = recent

    def retried(self, endpoint: str, err: Exception) -> None:
        """A request that got no answer is tried again on another backend."""
        cause = "timeout" if isinstance(err, UpstreamTimeout) else "unreachable"
        self.metrics.retries.labels(endpoint, cause).inc()
        self.log.info("retry", endpoint=endpoint, cause=cause, error=str(err))

    def slot_waited(self, backend: str, seconds: float) -> None:
        """A request was held this long for a busy slot before it was sent."""
        self.metrics.child(self.metrics.slot_wait, backend).observe(seconds)

    def begin(self, backend: str) -> None:
        self.metrics.child(self.metrics.in_flight, backend).inc()

    def backend_done(self, backend: str) -> None:
        """The backend is done with a request `end` was told it still works on."""
        self.metrics.child(self.metrics.in_flight, backend).dec()

    def end(self, endpoint: str, decision: Decision, outcome: Outcome, started: float, *,
            stream: bool, backend_busy: bool = False, media_tokens: int = 0) -> None:
        """Called exactly once per `begin`, from a `finally`: must not raise.
        `backend_busy`: the client left, the backend still works on it (the in-flight
        gauge then waits for `backend_done`). `media_tokens`: the prompt's positions
        that its media take."""
        m = self.metrics
        backend = decision.backend
        latency = time.perf_counter() - started
        status = str(outcome.status) if outcome.status else \
            "cancelled" if outcome.cancelled else "error"
        if outcome.status and not outcome.complete and outcome.status < 400:
            status = "incomplete"  # client left or the stream broke
        if not backend_busy:
            m.child(m.in_flight, backend).dec()
        m.child(m.requests, endpoint, backend, status).inc()
        m.child(m.latency, endpoint).observe(latency)
        ttft = outcome.ttft
        if outcome.complete:
            m.record_feedback(backend, decision.prompt_tokens, decision.predicted_cached,
                              outcome.reported_cached, decision.tier)
            m.record_generation(backend, outcome.predicted_n, outcome.predicted_ms)
            if media_tokens:
                m.child(m.media_tokens, backend).inc(media_tokens)
            if ttft is not None:
                m.child(m.ttft, backend).observe(ttft)
        # NOTE: the policy's full reasons (nested dicts) cost as much to render as the rest
        # of the line: only its one-line `why` at info, everything at debug
        reasons = decision.reasons
        head = reasons.get("head")
        if head is not None:
            m.routed_on_head.inc()
        self.log.info(
            "routed", request_id=decision.request_id, endpoint=endpoint, backend=backend,
            slot=decision.slot, tier=decision.tier, status=status, stream=stream,
            prompt_tokens=decision.prompt_tokens, predicted_cached=decision.predicted_cached,
            reported_cached=outcome.reported_cached, prompt_n=outcome.prompt_n,
            ttft_ms=None if ttft is None else round(ttft * 1000, 2),
            latency_ms=round(latency * 1000, 2), sent_ms=_ms(outcome.sent_at, started),
            why=reasons.get("why"), head_tokens=head, matched=reasons.get("matched"))
        self.log.debug("routed.reasons", request_id=decision.request_id, reasons=reasons)
        if self.recent is not None:
            self._remember(endpoint, decision, outcome, status, stream, latency)

    def _remember(self, endpoint: str, decision: Decision, outcome: Outcome, status: str,
                  stream: bool, latency: float) -> None:
        """The decision among the recent ones: ids, counts and names only (no text)."""
        assert self.recent is not None
        reasons, ttft = decision.reasons, outcome.ttft
        slot = outcome.reported_slot if outcome.reported_slot is not None else \
            reasons.get("slot", decision.slot)
        try:
            self.recent.add({
                "request_id": decision.request_id, "endpoint": endpoint,
                "backend": decision.backend, "slot": slot, "pinned": decision.slot is not None,
                "tier": decision.tier, "queued": decision.queued, "status": status,
                "stream": stream, "prompt_tokens": decision.prompt_tokens,
                "predicted_cached": decision.predicted_cached,
                "reported_cached": outcome.reported_cached, "prompt_n": outcome.prompt_n,
                "ttft_ms": None if ttft is None else round(ttft * 1000, 2),
                "latency_ms": round(latency * 1000, 2), "why": reasons.get("why"),
                "head_tokens": reasons.get("head"), "matched": reasons.get("matched")})
        except Exception:  # called from a `finally`: the page's loss, never the request's
            self.log.exception("recent.failed", request_id=decision.request_id)


def _ms(at: float | None, since: float) -> float | None:
    return None if at is None else round((at - since) * 1000, 2)
