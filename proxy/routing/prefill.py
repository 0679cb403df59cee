"""How long a backend takes to prefill part of a prompt, learned from its own timings.

A token's prefill costs its share of the weights' work, the same at every position, and
attention over every token before it, which grows with its position. Prefilling tokens
``[reuse, n)`` therefore takes

    per_token x (n - reuse) + per_position x (n^2 - reuse^2) / 2

seconds (the second term: the sum of their positions). On the demo model on one CPU
thread the two terms are equal near position 1,500 (the servers' timings in the smg
matrix: 1,300 tokens/s at the start of a context, 5.2e-7 s per token per position), so
a 10,000-token prompt takes ~4x what its first tokens' rate says, and tokens after a
long reused prefix cost more than the first ones did. A single learned rate is then
too slow for short prompts and far too fast for long ones; on a GPU with flash
attention ``per_position`` is learned near 0 and the model is that rate.

Both are fitted by least squares to the backend's reported prefills, older samples
weighted down by ``(1 - alpha)`` per new one (a window of ~1 / alpha prefills, so it
follows a machine that slows down). Until the fit is well posed (prefills of more than
one length) or while it gives a negative term, the model is a single rate, fitted to
the same samples.
"""

from __future__ import annotations

from dataclasses import dataclass

# the fit is used once the samples' lengths vary enough to tell the terms apart: the
# normal equations' determinant at least this fraction of its largest possible value
_WELL_POSED = 1e-6


@dataclass(slots=True)
class PrefillCost:
    """Seconds to prefill a range of a prompt's positions (see the module doc)."""

    per_token: float  # seconds per token, at position 0
    per_position: float = 0.0  # seconds per token per token before it
    learned: bool = False  # fitted to this backend's own timings
    # the weighted normal equations: sums of x1^2, x1 x2, x2^2, x1 y, x2 y, where x1 =
    # tokens, x2 = the sum of their positions, y = seconds
    _sums: tuple[float, float, float, float, float] = (0.0, 0.0, 0.0, 0.0, 0.0)

    @classmethod
    def at_rate(cls, tokens_per_s: float) -> PrefillCost:
        """A backend not measured yet: one rate at every position."""
        return cls(1.0 / tokens_per_s)

    def seconds(self, reuse: int, n: int) -> float:
        """Prefill time of positions ``[reuse, n)`` (0 when there are none)."""
        if n <= reuse:
            return 0.0
        return self.per_token * (n - reuse) + self.per_position * (n * n - reuse * reuse) / 2

    def learn(self, seconds: float, reuse: int, n: int, alpha: float) -> None:
        """The backend reported prefilling positions ``[reuse, n)`` in ``seconds``."""
        if n <= reuse or seconds <= 0:
            return
        x1, x2 = float(n - reuse), (n * n - reuse * reuse) / 2.0
        keep = 1.0 - alpha if self.learned else 0.0
        s11, s12, s22, s1y, s2y = (keep * v for v in self._sums)
        self._sums = (s11 + x1 * x1, s12 + x1 * x2, s22 + x2 * x2, s1y + x1 * seconds,
                      s2y + x2 * seconds)
        self.learned = True
        self.per_token, self.per_position = fit(*self._sums)

    def copy_terms(self, other: PrefillCost) -> None:
        """Price like ``other`` (a peer's fit, for a backend that reported nothing yet)."""
        self.per_token, self.per_position = other.per_token, other.per_position


def fit(s11: float, s12: float, s22: float, s1y: float, s2y: float) -> tuple[float, float]:
    """(per_token, per_position) minimising the weighted squared error, from the normal
    equations' sums; one rate (per_position 0) when they cannot tell the terms apart or
    give a negative one."""
    det = s11 * s22 - s12 * s12
    if det > _WELL_POSED * s11 * s22:
        per_token = (s22 * s1y - s12 * s2y) / det
        per_position = (s11 * s2y - s12 * s1y) / det
        if per_token > 0 and per_position >= 0:
            return per_token, per_position
    # least squares with per_position 0; s1y > 0 as every sample's seconds are
    return s1y / s11, 0.0
