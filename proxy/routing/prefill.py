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
follows a machine that slows down). The position term is learned only from prefills
whose mean positions differ enough (``_SPREAD``): from two of similar length, timing
noise alone would make it anything (1,000 tokens in 1.0 s and 1,100 in 1.2 s fit a
10,000-token prompt at 92 s). Until then, and while a fit would give a negative term,
the position term stays what it was (a peer's, or 0) and the per-token term is fitted
under it; one rate when even that is negative. (With alpha 1 each prefill is fitted
alone: no position term is learned.)
"""

from __future__ import annotations

from dataclasses import dataclass

# the position term is fitted once the samples' mean positions m vary this much:
# var(m) / mean(m^2) (weighted as the fit weighs them), the normal equations'
# determinant over its largest possible value; 0.05 is a spread of ~23% of the mean
_SPREAD = 0.05


@dataclass(slots=True)
class PrefillCost:
    """Seconds to prefill a range of a prompt's positions (see the module doc)."""

    per_token: float  # seconds per token, at position 0
    per_position: float = 0.0  # seconds per token per token before it
    learned: bool = False  # fitted to this backend's own timings
    # the weighted normal equations: sums of x1^2, x1 x2, x2^2, x1 y, x2 y, where x1 =
    # tokens, x2 = the sum of their positions (per_token absorbs the half token by which
    # the formula's sum differs), y = seconds
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
        self.per_token, self.per_position = fit(self._sums, self.per_position)

    def copy_terms(self, other: PrefillCost) -> None:
        """Price like ``other`` (a peer's fit, for a backend that reported nothing yet)."""
        self.per_token, self.per_position = other.per_token, other.per_position


def fit(sums: tuple[float, float, float, float, float], per_position: float
        ) -> tuple[float, float]:
    """(per_token, per_position) minimising the weighted squared error, from the normal
    equations' sums; when their positions do not tell the terms apart, or the two give
    a negative term, ``per_position`` is kept and the per-token term fitted under it,
    and when that is not positive either, one rate."""
    s11, s12, s22, s1y, s2y = sums
    det = s11 * s22 - s12 * s12
    if det >= _SPREAD * s11 * s22:
        both = ((s22 * s1y - s12 * s2y) / det, (s11 * s2y - s12 * s1y) / det)
        if both[0] > 0 and both[1] >= 0:
            return both
    per_token = (s1y - per_position * s12) / s11
    if per_token > 0:
        return per_token, per_position
    # least squares with per_position 0; s1y > 0 as every sample's seconds are
    return s1y / s11, 0.0
