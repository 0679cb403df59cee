"""The proxy's own knobs, parsed from the `proxy:` section of config.yaml (proxy/config/load.py).

Kept apart from proxy/app.py so that config loading does not import the HTTP app.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class HealthSettings:
    probe_interval_s: float = 1.0     # how often routable backends are probed
    probe_timeout_s: float = 2.0      # a /health slower than this is a failure
    breaker_failures: int = 3         # consecutive failed probes that open the breaker
    open_backoff_s: float = 0.5       # first wait before a half-open probe
    open_backoff_max_s: float = 15.0
    # a backend with requests whose /slots (answered by its main loop between batches)
    # is not answered for this long is stuck, whatever /health says (see proxy/forwarding/health.py)
    stall_timeout_s: float = 60.0



@dataclass(frozen=True)
class ProxySettings:
    """Proxy knobs: the `proxy:` section of config.yaml (host/port/policy aside)."""

    api_keys: tuple[str, ...] = ()          # client keys; empty = no auth
    protect_admin: bool = True              # /metrics and /kvroute/status need a key too
    max_body_bytes: int = 32 << 20          # larger bodies -> 413
    # a body not whole by then -> 408: a stalled upload holds one of max_in_flight places
    body_timeout_s: float = 60.0
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0           # between bytes: a cold 30k prompt on CPU is slow
    # until the client's first byte (a whole non-streamed answer): retried elsewhere past it
    first_byte_timeout_s: float = 600.0
    retry_attempts: int = 3                 # backends tried for a request that got no answer
    max_in_flight: int = 256                # requests served at once by this proxy
    max_queue: int = 512                    # requests waiting for one of those places
    queue_timeout_s: float = 30.0           # longest wait for a place (then 429)
    max_messages: int = 8192                # longer `messages` arrays -> 400
    # most tokens a request may ask to generate (max_tokens, max_completion_tokens,
    # n_predict, max_output_tokens): more, or a negative one, becomes this. None: more
    # than the slot's context becomes that (proxy/server/validate.py capped_lengths)
    max_tokens_cap: int | None = None
    strict_models: bool = False             # True: a `model` no backend serves -> 404
    log_prompts: bool = False               # debug: log request bodies (never keys)
    otel: bool = False                      # OpenTelemetry spans (the kvroute[otel] extra)
    health: HealthSettings = field(default_factory=HealthSettings)  # probes, breakers
    # uncached text up to this size is tokenized on the event loop (a worst-case stall of
    # ~5 ms at 16 KiB); larger uncached text goes to a worker thread
    inline_tokenize_bytes: int = 16 << 10
    tokenizer: Path | None = None           # GGUF to tokenize with (default: first managed)
