"""How many backends a trace needs: the fewest whose simulated p90 TTFT meets a target."""

from __future__ import annotations

from collections.abc import Sequence

from loadtest.simulate import SimBackend, SimResult, simulate
from loadtest.trace import TraceRequest


def plan_capacity(
    trace: Sequence[TraceRequest],
    target_p90_s: float,
    backend: SimBackend | None = None,
    policy: str = "prefix",
    max_backends: int = 64,
    time_scale: float = 1.0,
    prompts: Sequence[bytes] | None = None,
) -> tuple[int | None, list[SimResult]]:
    """Fewest backends whose modelled p90 TTFT meets the target (None: not within max).

    Doubles until the target is met, then bisects; assumes more backends never hurt.
    """
    runs: dict[int, SimResult] = {}

    def ok(n: int) -> bool:
        if n not in runs:
            runs[n] = simulate(trace, policy, n, backend, time_scale=time_scale,
                               prompts=prompts)
        return runs[n].ttft_p90 <= target_p90_s

    hi = 1
    while not ok(hi):
        if hi >= max_backends:
            return None, [runs[k] for k in sorted(runs)]
        hi = min(max_backends, hi * 2)
    lo = hi // 2  # lo fails (or is 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi, [runs[k] for k in sorted(runs)]
