"""The routing knobs (see proxy/routing/policy.py for what each one does), validated on creation:
an error names the field."""

from __future__ import annotations

from dataclasses import dataclass

from proxy.routing.cache.values import ServerRules


@dataclass(frozen=True)
class RouterSettings:
    load_factor: float = 1.25  # max work of a backend / mean work (bounded load)
    load_slack_s: float = 2.0  # slack on the bound, in seconds of prefill at the mean rate
    load_slack_tokens: int = 0  # extra absolute slack on the bound, in tokens of work
    # a request that continues a conversation a backend holds whole (at least this many
    # tokens) is exempt from the load bound there, and so, under load, is one reusing
    # this many from a slot (see policy.py, _adds_little)
    continuation_min_tokens: int = 1024
    # a request may wait for a busy slot holding at least this many of its tokens (and
    # is handed a freed slot first when it reuses that many there; see queue.py)
    wait_min_tokens: int = 256
    # a freed slot goes to the waiter of shortest expected prefill there, a waiter's
    # prefill divided by 1 + this x the seconds it has waited; one that has waited
    # wait_starve_s goes first, the oldest of those first (see queue.py)
    wait_ageing: float = 0.5
    wait_starve_s: float = 30.0
    # a waiter gives up and is routed again once its slot is this late (or as late again
    # as its expected wait, if longer): a bound for generations far longer than learned,
    # loose because early estimates (default rate, no decode time yet) are rough
    wait_grace_s: float = 30.0
    max_resident_tokens: int = 64_000_000  # cap on tokens in the router's tree (LRU leaves)
    default_prefill_tps: float = 1500.0  # prefill tokens/s until a backend reports timings
    rate_ewma_alpha: float = 0.2  # weight of a new prefill sample (rate, prefill.py's fit)
    ram_load_s_per_token: float = 2e-6  # cost of restoring one token of KV from host RAM
    request_overhead_tokens: int = 256  # work units per request beyond its uncached prompt
    default_service_s: float = 5.0  # request duration assumed until one is observed
    displace_weight: float = 0.1  # fraction of displaced tokens' prefill time charged
    destroy_weight: float = 8.0  # x prefill time of unique tokens a placement destroys
    min_rate_sample_tokens: int = 32  # ignore rate samples from smaller prefills (noise)
    # extra charge on the prefill s a placement adds (it delays the queue), times 1 +
    # per_waiter x the mean, over the candidate backends, of the requests waiting for a
    # slot (see policy.py)
    queue_cost_weight: float = 2.0
    queue_cost_per_waiter: float = 2.0
    # a slot saved to disk is restored into the chosen idle slot when it holds at least
    # this many more of the prompt than the slot would reuse (reading KV from disk costs
    # a small fraction of computing it, but a round trip and the server's loop)
    disk_min_gain_tokens: int = 256
    # RAM entries per backend the tree matches against: all of at least
    # ram_track_min_tokens, and smaller ones while there are no more than
    # ram_entries_tracked in all (the largest first; see BackendCache)
    ram_entries_tracked: int = 64
    ram_track_min_tokens: int = 1024
    # llama-server behaviour mirrored by the cache model (defaults of the pinned build)
    slot_prompt_similarity: float = 0.10  # --slot-prompt-similarity
    keep_threshold: float = 0.5  # below this kept fraction the slot state goes to RAM
    ram_min_share: float = 0.25  # RAM entries must share this fraction of their tokens
    cache_idle_slots: bool = True  # --cache-idle-slots (on unless --no-cache-idle-slots)
    kv_unified: bool = False  # --kv-unified (llama-server's default only when -np is auto)

    @property
    def rules(self) -> ServerRules:
        return ServerRules(
            self.keep_threshold,
            self.ram_min_share,
            self.slot_prompt_similarity,
            self.cache_idle_slots,
            self.kv_unified,
        )

    def __post_init__(self) -> None:
        positive = {
            "load_factor": self.load_factor,
            "max_resident_tokens": self.max_resident_tokens,
            "ram_entries_tracked": self.ram_entries_tracked,
            "default_prefill_tps": self.default_prefill_tps,
            "default_service_s": self.default_service_s,
        }
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"{name}: must be > 0, got {value!r}")
        if self.load_factor < 1.0:
            raise ValueError(f"load_factor: must be >= 1.0, got {self.load_factor!r}")
        if not 0.0 < self.rate_ewma_alpha <= 1.0:
            raise ValueError(f"rate_ewma_alpha: must be in (0, 1], got {self.rate_ewma_alpha!r}")
        nonneg = {
            "load_slack_tokens": self.load_slack_tokens,
            "load_slack_s": self.load_slack_s,
            "queue_cost_weight": self.queue_cost_weight,
            "queue_cost_per_waiter": self.queue_cost_per_waiter,
            "ram_load_s_per_token": self.ram_load_s_per_token,
            "request_overhead_tokens": self.request_overhead_tokens,
            "displace_weight": self.displace_weight,
            "destroy_weight": self.destroy_weight,
            "min_rate_sample_tokens": self.min_rate_sample_tokens,
            "wait_min_tokens": self.wait_min_tokens,
            "wait_ageing": self.wait_ageing,
            "wait_starve_s": self.wait_starve_s,
            "disk_min_gain_tokens": self.disk_min_gain_tokens,
            "wait_grace_s": self.wait_grace_s,
            "ram_track_min_tokens": self.ram_track_min_tokens,
        }
        for name, value in nonneg.items():
            if value < 0:
                raise ValueError(f"{name}: must be >= 0, got {value!r}")
        fractions = {
            "slot_prompt_similarity": self.slot_prompt_similarity,
            "keep_threshold": self.keep_threshold,
            "ram_min_share": self.ram_min_share,
        }
        for name, value in fractions.items():
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name}: must be in [0, 1], got {value!r}")
