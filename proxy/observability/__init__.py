"""Structured logs (one line per routing decision) and Prometheus metrics."""
