"""Integer arithmetic shared by every kernel: rounding shifts, exact ``round(log2)``,
the forward's finishing step, ``max |v|`` and the row dot products of the gradients.

``round_shift(v, k)`` divides by ``2^k`` rounding half away from zero (``k > 0``),
multiplies by ``2^-k`` (``k < 0``) and is the identity for ``k == 0``. ``round_log2(m)``
is ``round(log2 m)`` without a float (WAGE rounds, docs/algorithms.md §1). All helpers are
``inline="always"``: their bodies are typed inside the kernels that call them.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

# floor(2^(b + 1/2)) for b = 0..62: m > 2^(b+1/2)  <=>  m > LOG2_HALF_THRESH[b] (integers).
LOG2_HALF_THRESH = np.array([math.isqrt(1 << (2 * b + 1)) for b in range(63)], dtype=np.int64)


@njit(cache=True, nogil=True, inline="always")
def round_shift(v: int, k: int) -> int:
    """``v / 2^k`` rounded half away from zero (k > 0), ``v * 2^-k`` (k <= 0)."""
    if k > 0:
        half = np.int64(1) << (k - 1)
        if v >= 0:
            return (v + half) >> k
        return -((half - v) >> k)
    if k < 0:
        return v << (-k)
    return v


@njit(cache=True, nogil=True, inline="always")
def round_shift_sel(v: int, k: int) -> int:
    """:func:`round_shift` written with selects instead of branches on the sign of v (for
    loops over values of random sign: no mispredictions, and they vectorize)."""
    if k > 0:
        av = -v if v < 0 else v
        r = (av + (np.int64(1) << (k - 1))) >> k
        return -r if v < 0 else r
    if k < 0:
        return v << (-k)
    return v


@njit(cache=True, nogil=True, inline="always")
def round_log2(m: int) -> int:
    """``round(log2 m)`` for an integer ``m >= 1``, exactly (no float)."""
    b = 0
    while (m >> (b + 1)) > 0:
        b += 1
    if m > LOG2_HALF_THRESH[b]:
        return b + 1
    return b


@njit(cache=True, nogil=True, inline="always")
def _finish(acc: int, shift: int, amax: int, relu: bool) -> int:
    v = round_shift(acc, shift)
    if relu and v < 0:
        v = 0
    if v > amax:
        v = amax
    elif v < -amax:
        v = -amax
    return v


@njit(cache=True, nogil=True, inline="always")
def max_abs(v):
    """max |v| over a flat integer array, as int64."""
    m = np.int64(0)
    for i in range(v.shape[0]):
        x = np.int64(v[i])
        if x < 0:
            x = -x
        if x > m:
            m = x
    return m


@njit(cache=True, nogil=True, inline="always")
def _dots_rows(col_t, e_t, cols, g2, r_len, n_out):
    """g2[r, o] += sum_{p < cols} col_t[r, p] * e_t[o, p] (int32), 2 rows x 4 outputs
    per pass."""
    o = 0
    while o + 4 <= n_out:
        r = 0
        while r + 2 <= r_len:
            a0 = np.int32(0)
            a1 = np.int32(0)
            a2 = np.int32(0)
            a3 = np.int32(0)
            b0 = np.int32(0)
            b1 = np.int32(0)
            b2 = np.int32(0)
            b3 = np.int32(0)
            for p in range(cols):
                u = np.int32(col_t[r, p])
                v = np.int32(col_t[r + 1, p])
                e0 = np.int32(e_t[o, p])
                e1 = np.int32(e_t[o + 1, p])
                e2 = np.int32(e_t[o + 2, p])
                e3 = np.int32(e_t[o + 3, p])
                a0 = np.int32(a0 + u * e0)
                a1 = np.int32(a1 + u * e1)
                a2 = np.int32(a2 + u * e2)
                a3 = np.int32(a3 + u * e3)
                b0 = np.int32(b0 + v * e0)
                b1 = np.int32(b1 + v * e1)
                b2 = np.int32(b2 + v * e2)
                b3 = np.int32(b3 + v * e3)
            g2[r, o] = np.int32(g2[r, o] + a0)
            g2[r, o + 1] = np.int32(g2[r, o + 1] + a1)
            g2[r, o + 2] = np.int32(g2[r, o + 2] + a2)
            g2[r, o + 3] = np.int32(g2[r, o + 3] + a3)
            g2[r + 1, o] = np.int32(g2[r + 1, o] + b0)
            g2[r + 1, o + 1] = np.int32(g2[r + 1, o + 1] + b1)
            g2[r + 1, o + 2] = np.int32(g2[r + 1, o + 2] + b2)
            g2[r + 1, o + 3] = np.int32(g2[r + 1, o + 3] + b3)
            r += 2
        while r < r_len:
            for oo in range(o, o + 4):
                a0 = np.int32(0)
                for p in range(cols):
                    a0 = np.int32(a0 + np.int32(col_t[r, p]) * np.int32(e_t[oo, p]))
                g2[r, oo] = np.int32(g2[r, oo] + a0)
            r += 1
        o += 4
    while o < n_out:
        for r in range(r_len):
            a0 = np.int32(0)
            for p in range(cols):
                a0 = np.int32(a0 + np.int32(col_t[r, p]) * np.int32(e_t[o, p]))
            g2[r, o] = np.int32(g2[r, o] + a0)
        o += 1
