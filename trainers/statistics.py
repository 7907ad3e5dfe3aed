"""The interval estimates the trainers' evaluations and ``tools/learning_results.py`` report:
Wilson's interval of a proportion, Newcombe's interval of a difference of paired proportions
and the exact McNemar test of paired binary outcomes. Pure functions of counts."""

from __future__ import annotations

import math
from typing import Any


def wilson(k: float, n: float, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion ``k / n`` (Wilson 1927, JASA 22),
    inside [0, 1]: exactly 0 at k = 0 and exactly 1 at k = n, where the formula's end is 0
    or 1 up to a rounding error of either sign (``-0.000`` printed, or a low end of 1.7e-18
    above an observed 0). ``z``: the normal quantile (1.96 for 95%)."""
    p = k / n
    mid, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    lo = 0.0 if k == 0 else max(0.0, (mid - half) / (1 + z * z / n))
    hi = 1.0 if k == n else min(1.0, (mid + half) / (1 + z * z / n))
    return lo, hi


def newcombe_paired(both: float, breaks: float, fixes: float, neither: float,
                    z: float = 1.96) -> tuple[float, float, float]:
    """The difference of two paired proportions, second minus first, ``(fixes - breaks) / n``
    for the 2x2 table of n items (``both``: right twice; ``breaks``: right, then wrong;
    ``fixes``: wrong, then right; ``neither``), and its 95% interval by Newcombe's hybrid
    score method (Newcombe 1998, "Improved confidence intervals for the difference between
    binomial proportions based on paired data", Statistics in Medicine 17, method 10: the two
    Wilson intervals combined with the phi correlation of the pairs). Returns
    ``(difference, low, high)``, the limits inside [-1, 1].

    Raises:
        ValueError: a negative count, or no item."""
    a, b, c, d = both, breaks, fixes, neither
    if min(a, b, c, d) < 0 or a + b + c + d <= 0:
        raise ValueError(f"both, breaks, fixes, neither: expected counts >= 0 of at least one "
                         f"item, got {a}, {b}, {c}, {d}")
    n = a + b + c + d
    p1, p2 = (a + b) / n, (a + c) / n
    l1, u1 = wilson(a + b, n, z)
    l2, u2 = wilson(a + c, n, z)
    den = float(a + b) * (c + d) * (a + c) * (b + d)
    phi = (a * d - b * c) / math.sqrt(den) if den > 0 else 0.0
    diff = p2 - p1
    lo = diff - math.sqrt(max(0.0, (p2 - l2) ** 2 - 2 * phi * (p2 - l2) * (u1 - p1)
                              + (u1 - p1) ** 2))
    hi = diff + math.sqrt(max(0.0, (u2 - p2) ** 2 - 2 * phi * (u2 - p2) * (p1 - l1)
                              + (p1 - l1) ** 2))
    return diff, max(-1.0, lo), min(1.0, hi)


def paired_counts(first: Any, second: Any) -> tuple[int, int, int, int]:
    """The 2x2 table of two paired binary outcomes (``first``, ``second``: bool ``[n]``
    each, the same items in the same order): ``(both, breaks, fixes, neither)``, ``breaks``
    being right in ``first`` and wrong in ``second``, ``fixes`` the other way round.

    Raises:
        ValueError: the two differ in length, are not one-dimensional, or are empty."""
    import numpy as np

    a, b = np.asarray(first, bool), np.asarray(second, bool)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ValueError(f"first, second: expected two [n] arrays of one length n >= 1, got "
                         f"shapes {a.shape} and {b.shape}")
    return (int((a & b).sum()), int((a & ~b).sum()), int((~a & b).sum()),
            int((~a & ~b).sum()))


def mcnemar_exact(breaks: int, fixes: int) -> float:
    """Two-sided exact McNemar p of paired binary outcomes: under the null a discordant pair
    is a break or a fix with probability 1/2 each, so with ``n = breaks + fixes`` the p is
    ``min(1, 2 P(X <= min(breaks, fixes)))`` for ``X ~ Binomial(n, 1/2)`` (McNemar 1947; the
    exact binomial form, e.g. Fagerland, Lydersen and Laake 2013, BMC Med Res Methodol 13:91).
    1.0 when there is no discordant pair. Exact integer arithmetic up to the last division.
    Symmetric in its two arguments.

    Raises:
        ValueError: a negative count."""
    if breaks < 0 or fixes < 0:
        raise ValueError(f"breaks, fixes: expected counts >= 0, got {breaks} and {fixes}")
    n = breaks + fixes
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(breaks, fixes) + 1))
    return min(1.0, 2 * tail / 2**n)
