"""Numba kernels of the streaming combine: a finiteness check and weighted accumulation.

All kernels work on 1-D contiguous arrays (callers pass ``layer.reshape(-1)``) and run in
place; none allocates. Accumulators may be float64 (default) or float32; inputs are
float32.
"""

from __future__ import annotations

import numba
import numpy as np

_EXP = np.uint32(0x7F800000)
_ALL = np.uint32(0xFFFFFFFF)


@numba.njit(cache=True, nogil=True)
def _has_nonfinite_bits(u: np.ndarray) -> bool:
    # A float32 is NaN or +-Inf iff its 8 exponent bits are all ones. A min-reduction of
    # the complemented exponent bits vectorizes (no early exit, no float compare).
    c = _ALL
    for i in range(u.size):
        c = min(c, (~u[i]) & _EXP)
    return c == 0


def has_nonfinite(x: np.ndarray) -> bool:
    """True if the 1-D contiguous float32 array ``x`` holds a NaN or an infinity."""
    return bool(_has_nonfinite_bits(x.view(np.uint32)))


@numba.njit(cache=True, nogil=True)
def add1(acc: np.ndarray, x0: np.ndarray, w0: float) -> None:
    """``acc += w0 * x0`` elementwise (acc float64 or float32, x0 float32, same size);
    the product and sum are formed in float64, then stored in the accumulator's dtype."""
    w = np.float64(w0)
    for i in range(acc.size):
        acc[i] = acc[i] + w * x0[i]


@numba.njit(cache=True, nogil=True)
def add2(acc: np.ndarray, x0: np.ndarray, x1: np.ndarray, w0: float, w1: float) -> None:
    """``acc += w0*x0 + w1*x1``, the sum formed in float64 and rounded once."""
    a, b = np.float64(w0), np.float64(w1)
    for i in range(acc.size):
        acc[i] = acc[i] + (a * x0[i] + b * x1[i])


@numba.njit(cache=True, nogil=True)
def add3(acc: np.ndarray, x0: np.ndarray, x1: np.ndarray, x2: np.ndarray,
         w0: float, w1: float, w2: float) -> None:
    """``acc += w0*x0 + w1*x1 + w2*x2``, the sum formed in float64 and rounded once."""
    a, b, c = np.float64(w0), np.float64(w1), np.float64(w2)
    for i in range(acc.size):
        acc[i] = acc[i] + ((a * x0[i] + b * x1[i]) + c * x2[i])


@numba.njit(cache=True, nogil=True)
def add4(acc: np.ndarray, x0: np.ndarray, x1: np.ndarray, x2: np.ndarray, x3: np.ndarray,
         w0: float, w1: float, w2: float, w3: float) -> None:
    """``acc += w0*x0 + w1*x1 + w2*x2 + w3*x3``: one read/write pass of ``acc`` for four
    updates (the accumulator traffic, not the inputs, bounds a one-update-at-a-time sum).
    The four-term sum is formed in float64 and rounded once into the accumulator, so a
    float32 accumulator rounds once per four updates."""
    a, b, c, d = np.float64(w0), np.float64(w1), np.float64(w2), np.float64(w3)
    for i in range(acc.size):
        acc[i] = acc[i] + ((a * x0[i] + b * x1[i]) + (c * x2[i] + d * x3[i]))

