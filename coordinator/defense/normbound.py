"""How far one update may move the model: norm bounds relative to robust statistics.

An update's movement is ``Δ = x - g`` (``x`` itself for a delta update) over every layer;
a bound ``B`` scales it by ``s = min(1, B / ‖Δ‖)`` (:func:`clip_factor`, shared with
``coordinator.privacy.dp``): it then moves the model at most ``B``, in its own direction.
Two ways to set ``B`` behind one interface (:class:`NormBound`: ``observe`` each norm of
the round, ``bound()`` for the bound so far, ``end_round``):

- :class:`MedianBound`: ``k`` times the running median of the round's norms: one device
  moves the model at most k times as far as the round's median device, and fewer than
  half the devices cannot move the median (the poisoning guard's, :mod:`coordinator.defense.guard`);
- :class:`QuantileBound`: adaptive clipping (Andrew et al., 2021): ``B`` is fixed within a
  round and tracks the ``target`` quantile of the norms across rounds,
  ``B <- B · exp(-lr · (b - target))`` with ``b`` the fraction of norms at most ``B``
  (differential privacy's caller adds noise to ``b``).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import Protocol

import numba
import numpy as np

from coordinator.privacy.dp import adapt_clip, clip_factor

__all__ = ["MedianBound", "NormBound", "QuantileBound", "RunningMedian", "bites", "clip_factor", "sq_distance",
           "update_norm"]


class NormBound(Protocol):
    """A norm bound that learns from the norms it is shown (see the module docstring)."""

    def observe(self, norm: float) -> None:
        """One update's ‖Δ‖ of the round."""

    def bound(self) -> float:
        """The bound now (``inf``: none yet)."""

    def end_round(self) -> None:
        """The round is over."""


@numba.njit(cache=True, nogil=True)
def sq_distance(x: np.ndarray, g: np.ndarray, delta: bool) -> float:
    """``Σ (x - g)²`` (``Σ x²`` when ``delta``) over two flat float32 arrays in one pass, no
    temporaries, in float64: eight partial sums by index (element ``i`` goes to sum
    ``i mod 8``, the tail to the first), added in a fixed tree. The order depends on the
    indices alone, never on the arrays' alignment, so every process gets the same bits;
    the eight independent sums vectorize, where a single running sum would not."""
    n = x.size
    acc = np.zeros(8, np.float64)
    m = n - n % 8
    for i in range(0, m, 8):
        for k in range(8):
            v = np.float64(x[i + k]) if delta else np.float64(x[i + k]) - np.float64(g[i + k])
            acc[k] += v * v
    for i in range(m, n):
        v = np.float64(x[i]) if delta else np.float64(x[i]) - np.float64(g[i])
        acc[0] += v * v
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))


def update_norm(layers: Sequence[np.ndarray], reference: Sequence[np.ndarray], delta: bool) -> float:
    """‖Δ‖ over every layer of an update's flat float32 ``layers`` against the flat float32
    ``reference`` model it started from (``delta``: the layers are Δ already)."""
    return math.sqrt(sum(sq_distance(x, g, delta) for x, g in zip(layers, reference, strict=True)))


def bites(n: int, factor: float) -> bool:
    """Whether ``factor`` times the median of ``n`` non-negative values can bound any of
    them: never for one value (it is the median), nor for two when ``factor >= 2`` (the
    median of two is their mean, at least half the larger one)."""
    return n >= 3 or (n == 2 and factor < 2)


class RunningMedian:
    """The median of the numbers added so far, O(log n) per number (two heaps)."""

    def __init__(self) -> None:
        self._low: list[float] = []   # max-heap (negated): the smaller half
        self._high: list[float] = []  # min-heap: the larger half

    def add(self, x: float) -> None:
        if self._low and x > -self._low[0]:
            heapq.heappush(self._high, x)
        else:
            heapq.heappush(self._low, -x)
        if len(self._low) > len(self._high) + 1:
            heapq.heappush(self._high, -heapq.heappop(self._low))
        elif len(self._high) > len(self._low):
            heapq.heappush(self._low, -heapq.heappop(self._high))

    def __len__(self) -> int:
        return len(self._low) + len(self._high)

    def values(self) -> list[float]:
        """The numbers added so far (in no order)."""
        return [-x for x in self._low] + list(self._high)

    def median(self) -> float:
        """The median (the mean of the middle two for an even count; nan when empty)."""
        if not self._low:
            return math.nan
        if len(self._low) > len(self._high):
            return -self._low[0]
        return (-self._low[0] + self._high[0]) / 2.0


class MedianBound:
    """``k`` times the median of the round's norms so far (``k > 1``)."""

    def __init__(self, k: float) -> None:
        self.k = float(k)
        self._median = RunningMedian()

    def observe(self, norm: float) -> None:
        self._median.add(float(norm))

    def median(self) -> float:
        return self._median.median()

    def bound(self) -> float:
        m = self._median.median()
        return self.k * m if math.isfinite(m) else math.inf

    def end_round(self) -> None:
        self._median = RunningMedian()


class QuantileBound:
    """Adaptive clipping to the ``target`` quantile of the norms (module docstring):
    ``initial`` the first round's bound, ``lr`` the geometric step (Andrew et al.: 0.2)."""

    def __init__(self, target: float = 0.5, initial: float = 0.1, lr: float = 0.2) -> None:
        if not 0.0 < target < 1.0 or not initial > 0 or not lr > 0:
            raise ValueError(f"QuantileBound: need 0 < target < 1, initial > 0, lr > 0 "
                             f"(got {target}, {initial}, {lr})")
        self.target, self.lr = float(target), float(lr)
        self._bound = float(initial)
        self._n = 0
        self._below = 0

    def observe(self, norm: float) -> None:
        self._n += 1
        self._below += int(norm <= self._bound)

    def bound(self) -> float:
        return self._bound

    def fraction_below(self) -> float:
        """The fraction of this round's norms at most the bound (``b``; nan before any)."""
        return self._below / self._n if self._n else math.nan

    def end_round(self, fraction_below: float | None = None) -> None:
        """Move the bound toward the target quantile; ``fraction_below``: ``b`` as the
        caller measured it (a noised one, under differential privacy), else this round's."""
        b = self.fraction_below() if fraction_below is None else float(fraction_below)
        if math.isfinite(b):
            self._bound = adapt_clip(self._bound, b, 1, quantile=self.target, lr=self.lr)
        self._n = self._below = 0
