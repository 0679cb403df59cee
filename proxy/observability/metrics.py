"""Prometheus collectors of one proxy app, in a registry of its own.

A registry per app (not prometheus-client's global one) lets tests and benchmarks
build many apps in one process without "duplicated timeseries" errors.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST

# Latency buckets span a cached 1-token answer (ms) to a cold 30k-token prompt on CPU.
_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                 120.0)
# Per output token: ~5 ms on a GPU to a second on a loaded CPU.
_TPOT_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
_ERROR_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384)


class ProxyMetrics:
    """Every collector the proxy updates; `render()` is the /metrics body."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "kvroute_requests", "Requests answered, by endpoint, backend and status code.",
            ["endpoint", "backend", "status"], registry=r)
        self.prompt_tokens = Counter(
            "kvroute_prompt_tokens", "Prompt tokens of routed requests.", ["backend"],
            registry=r)
        self.media_tokens = Counter(
            "kvroute_media_tokens", "Prompt positions of routed requests that images, "
            "audio and video take (their projector's chunks, where kvroute knows them).",
            ["backend"], registry=r)
        self.predicted_cached = Counter(
            "kvroute_predicted_cached_tokens", "Prompt tokens the router predicted reused.",
            ["backend"], registry=r)
        self.reported_cached = Counter(
            "kvroute_reported_cached_tokens", "Prompt tokens the backend reported reused.",
            ["backend"], registry=r)
        self.prediction_error = Histogram(
            "kvroute_prediction_error_tokens", "|predicted - reported| reused tokens.",
            buckets=_ERROR_BUCKETS, registry=r)
        self.ttft = Histogram(
            "kvroute_ttft_seconds", "Time to first generated token as the proxy sees it.",
            ["backend"], buckets=_TIME_BUCKETS, registry=r)
        self.latency = Histogram(
            "kvroute_request_seconds", "Whole request latency through the proxy.",
            ["endpoint"], buckets=_TIME_BUCKETS, registry=r)
        self.in_flight = Gauge(
            "kvroute_in_flight", "Requests being served, per backend.", ["backend"],
            registry=r)
        self.backend_up = Gauge(
            "kvroute_backend_up", "1 while the backend is routable, else 0.", ["backend"],
            registry=r)
        self.retries = Counter(
            "kvroute_retries", "Requests retried on another backend (nothing had reached "
            "the client), by endpoint and cause.", ["endpoint", "cause"], registry=r)
        self.breaker_trips = Counter(
            "kvroute_breaker_trips", "Times a backend's circuit breaker opened.", ["backend"],
            registry=r)
        self.rejected = Counter(
            "kvroute_rejected", "Requests refused by admission control (429).", ["reason"],
            registry=r)
        self.queued = Gauge(
            "kvroute_queued", "Requests waiting for admission.", registry=r)
        self.routed_on_head = Counter(
            "kvroute_routed_on_head", "Requests routed on the head of their prompt while "
            "the rest (new text) was tokenized.", registry=r)
        self.slot_files = Counter(
            "kvroute_slot_files", "Slots saved to disk and restored (kv_disk), and the "
            "saves and restores that failed.", ["event"], registry=r)
        self.pool_backends = Gauge(
            "kvroute_pool_backends", "Routable backends of each model pool, by its name "
            "(empty: a pool of external backends that name none).", ["pool"], registry=r)
        self.reused_by_tier = Counter(
            "kvroute_reused_tokens", "Prompt tokens the backend reported reused, by the "
            "tier they were predicted from (slot, ram, disk, none: a reuse not foreseen).",
            ["backend", "tier"], registry=r)
        self.output_tokens = Counter(
            "kvroute_output_tokens", "Tokens generated, as the backend counts them.",
            ["backend"], registry=r)
        self.time_per_output_token = Histogram(
            "kvroute_time_per_output_token_seconds", "Generation time per output token "
            "(the backend's own timing of its decoding).", ["backend"],
            buckets=_TPOT_BUCKETS, registry=r)
        self.slot_wait = Histogram(
            "kvroute_slot_wait_seconds", "Time a request was held for a busy slot that "
            "holds its prefix before it was sent.", ["backend"], buckets=_TIME_BUCKETS,
            registry=r)
        self.admission_wait = Histogram(
            "kvroute_admission_wait_seconds", "Time a request waited for admission.",
            buckets=_TIME_BUCKETS, registry=r)
        self.build_info = Gauge(
            "kvroute_build_info", "1, labelled with kvroute's version and the llama.cpp "
            "version it tokenizes as.", ["version", "llama_cpp"], registry=r)
        self.replica_events = Counter(
            "kvroute_replica_events", "Events between replicas: sent, applied (another's, "
            "to this one's model), ignored (a backend or slot busy here, or nothing to "
            "change), invalid, unreadable (a start "
            "relative to one this replica missed), incomplete (a large "
            "one sent in parts lost one), dropped (no broker, sent too fast, or too "
            "large for a peer to read).", ["event"],
            registry=r)
        self.replicas_connected = Gauge(
            "kvroute_replicas_connected", "1 while the replicas' broker is reachable.",
            registry=r)
        self.replica_peers = Gauge(
            "kvroute_replica_peers", "Other replicas heard from lately.", registry=r)
        self.replica_inflight = Gauge(
            "kvroute_replica_inflight", "Other replicas' requests busy in this one's model.",
            registry=r)
        self.tokens_from_backend = Counter(
            "kvroute_tokens_from_backend", "Requests whose prompt ids a backend computed "
            "(/apply-template + /tokenize), by why kvroute did not.", ["reason"], registry=r)

        # labelled children by (collector, labels): `labels()` validates and locks on
        # every call; the label sets are few (endpoints x backends x statuses)
        self._children: dict[tuple[Any, ...], Any] = {}

    def child(self, collector: Any, *labels: str) -> Any:
        """`collector.labels(*labels)`, memoised (hot path: several per request)."""
        key = (id(collector), *labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = collector.labels(*labels)
        return c

    def media_tokens_of(self, backend: str) -> int:
        """`kvroute_media_tokens_total` of ``backend`` so far."""
        got = self.registry.get_sample_value("kvroute_media_tokens_total",
                                             {"backend": backend})
        return int(got or 0)

    def record_feedback(self, backend: str, prompt_tokens: int, predicted: int,
                        reported: int | None, tier: str = "none") -> None:
        """Token counters and the prediction error of one routed request (``tier``: where
        its reuse was predicted to come from)."""
        self.child(self.prompt_tokens, backend).inc(prompt_tokens)
        self.child(self.predicted_cached, backend).inc(predicted)
        if reported is not None:
            self.child(self.reported_cached, backend).inc(reported)
            self.child(self.reused_by_tier, backend, tier).inc(reported)
            self.prediction_error.observe(abs(predicted - reported))

    def record_generation(self, backend: str, n: int | None, ms: float | None) -> None:
        """The backend's count and time of the tokens it generated (either unknown:
        nothing)."""
        if n:
            self.child(self.output_tokens, backend).inc(n)
            if ms is not None:
                self.child(self.time_per_output_token, backend).observe(ms / 1000 / n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
