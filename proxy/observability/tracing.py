"""OpenTelemetry traces (optional: the `kvroute[otel]` extra, `proxy.otel: true`).

One span per routed attempt, `kvroute.route`, a child of the client's own trace when its
request carries a `traceparent`, with the routing decision and what the backend reported
as attributes: which backend and slot, the tier, prompt, predicted and reported cached
tokens, TTFT, status. Exported where the standard OTEL_* variables say (OTLP over HTTP,
to localhost:4318 by default), unless the process already set a tracer provider (e.g.
`opentelemetry-instrument kvroute serve`). Off: no OpenTelemetry import at all.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

OTEL_MISSING = ("proxy.otel: OpenTelemetry is not installed "
                "(fix: pip install 'kvroute[otel]', or set proxy.otel: false)")


class Decided(Protocol):
    """What a span tells of a routing decision (proxy.routing.decision.Decision)."""

    backend: str
    slot: int | None
    tier: str
    prompt_tokens: int
    predicted_cached: int
    reasons: dict[str, object]


class Answered(Protocol):
    """What a span tells of the answer (proxy.reporting.outcome.Outcome)."""

    status: int
    reported_cached: int | None
    complete: bool

    @property
    def ttft(self) -> float | None: ...


# what `proxy.otel` needs installed: the API, and the SDK and exporter kvroute sets up
# when the process has no tracer provider of its own
OTEL_MODULES = ("opentelemetry.trace", "opentelemetry.sdk.trace",
                "opentelemetry.exporter.otlp.proto.http.trace_exporter")


class Tracing:
    """Spans of routed requests; a no-op without a tracer."""

    def __init__(self, tracer: Any = None, provider: Any = None) -> None:
        self.tracer = tracer
        self.provider = provider  # the one set up here, if any: flushed at `close`

    @classmethod
    def start(cls, enabled: bool) -> Tracing:
        """The app's tracing: off, or on with the process's tracer provider (set up
        from the OTEL_* variables when none is). RuntimeError when it is asked for and
        OpenTelemetry is not installed."""
        if not enabled:
            return cls()
        try:
            from opentelemetry import trace

            provider = None
            if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
                provider = _default_provider()  # (none set by the process: the SDK's)
        except ImportError:
            raise RuntimeError(OTEL_MISSING) from None
        return cls(trace.get_tracer("kvroute"), provider)

    def close(self) -> None:
        """Export what is left (spans are sent in batches) and stop."""
        if self.provider is not None:
            self.provider.shutdown()

    def begin(self, headers: Mapping[str, str], endpoint: str) -> Any:
        """A span for one attempt at a request with these headers (None: off)."""
        if self.tracer is None:
            return None
        from opentelemetry import propagate, trace

        span = self.tracer.start_span("kvroute.route", context=propagate.extract(headers),
                                      kind=trace.SpanKind.SERVER)
        span.set_attribute("kvroute.endpoint", endpoint)
        return span

    @staticmethod
    def end(span: Any, decision: Decided, outcome: Answered) -> None:
        """Close ``span`` with what was decided and what came of it."""
        if span is None:
            return
        attrs: dict[str, Any] = {
            "kvroute.backend": decision.backend, "kvroute.tier": decision.tier,
            "kvroute.prompt_tokens": decision.prompt_tokens,
            "kvroute.predicted_cached": decision.predicted_cached,
            "kvroute.why": str(decision.reasons.get("why", "")),
            "http.response.status_code": outcome.status,
        }
        optional = {"kvroute.slot": decision.slot,
                    "kvroute.reported_cached": outcome.reported_cached,
                    "kvroute.ttft_s": outcome.ttft}
        attrs.update({k: v for k, v in optional.items() if v is not None})
        span.set_attributes(attrs)
        if not outcome.complete:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, "the answer did not complete"))
        span.end()


def _default_provider() -> Any:
    """The SDK's provider, exporting batches over OTLP/HTTP where OTEL_* says."""
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": "kvroute"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    return provider
