"""The statistics of the experiment reports: over seeds, a mean, its sample standard
deviation and the 95 % confidence interval of the mean (Student's t); between two
methods, the paired difference seed by seed (same data split, same initial model) with
its interval and how many seeds it won.

Pure functions of plain numbers; NaNs (a group a run did not have) are left out. With
one value there is no spread: SD and interval are NaN and print as ``n/a``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

CONFIDENCE = 0.95


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t distribution with ``df`` degrees of freedom."""
    from scipy.stats import t  # scipy comes with scikit-learn (the coordinator extra)

    return float(t.ppf(p, df))


@dataclass(frozen=True)
class Estimate:
    """``n`` values: their ``mean``, sample SD (``ddof = 1``) and the 95 % CI of the mean
    ``[lo, hi]`` = mean ± t(0.975, n - 1) · SD / √n."""

    n: int
    mean: float
    sd: float
    lo: float
    hi: float

    def text(self, scale: float = 100.0, digits: int = 1, signed: bool = False) -> str:
        """``"78.1 ± 1.2 [76.6, 79.6]"`` (``scale`` 100: fractions as percent points)."""
        if self.n == 0:
            return "n/a"
        f = f"{{:{'+' if signed else ''}.{digits}f}}"
        m = f.format(scale * self.mean)
        if self.n < 2:
            return f"{m} (n = 1)"
        return (f"{m} ± {scale * self.sd:.{digits}f} "
                f"[{f.format(scale * self.lo)}, {f.format(scale * self.hi)}]")


def estimate(values: Sequence[float], confidence: float = CONFIDENCE) -> Estimate:
    """The :class:`Estimate` of ``values`` (NaNs dropped)."""
    v = [float(x) for x in values if x is not None and not math.isnan(float(x))]
    n = len(v)
    if n == 0:
        return Estimate(0, math.nan, math.nan, math.nan, math.nan)
    mean = math.fsum(v) / n
    if n < 2:
        return Estimate(1, mean, math.nan, math.nan, math.nan)
    sd = math.sqrt(math.fsum((x - mean) ** 2 for x in v) / (n - 1))
    half = t_quantile(0.5 + confidence / 2, n - 1) * sd / math.sqrt(n)
    return Estimate(n, mean, sd, mean - half, mean + half)


@dataclass(frozen=True)
class Paired:
    """The differences ``a - b`` over the seeds both have: their :class:`Estimate`, and
    how many seeds ``a`` won (> 0), tied and lost."""

    diff: Estimate
    wins: int
    ties: int
    losses: int
    seeds: tuple[int, ...]

    def text(self, scale: float = 100.0, digits: int = 1) -> str:
        """``"+2.1 ± 1.0 [+0.9, +3.3], 5/5 seeds"``."""
        if self.diff.n == 0:
            return "n/a"
        return f"{self.diff.text(scale, digits, signed=True)}, wins {self.wins}/{self.diff.n}"


def paired(a: Mapping[int, float], b: Mapping[int, float], confidence: float = CONFIDENCE) -> Paired:
    """The paired difference ``a[s] - b[s]`` over the seeds ``s`` both have (NaNs left out)."""
    seeds = tuple(sorted(s for s in a if s in b and not _nan(a[s]) and not _nan(b[s])))
    d = [float(a[s]) - float(b[s]) for s in seeds]
    return Paired(estimate(d, confidence), sum(x > 0 for x in d), sum(x == 0 for x in d),
                  sum(x < 0 for x in d), seeds)


def _nan(x: float | None) -> bool:
    return x is None or math.isnan(float(x))
