"""Structured logs (one line per routing decision), Prometheus metrics, the recent
decisions the status page shows (recent.py) and OpenTelemetry spans (tracing.py)."""
