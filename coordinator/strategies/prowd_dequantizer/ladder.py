"""The bitwidth ladder: the quantizer Q_π of each rung, the precision of received weights,
and the lookup-table application of a per-position dequantizer (Numba).

Q_π (π = 2..16 bits) puts a shared-domain weight on the grid of step 2^-(π-1), clipped to
±clip (0.5): ``clip(rint(w·2^(π-1)), ±m_π) / 2^(π-1)``, m_π = ``min(round(clip·2^(π-1)),
2^(π-1) - 1)``, the rounding of ``intnn.from_shared`` on that grid (half to even). Q_2 is
the ternary forward weight ``0.5·ternary(W)`` (|W| > 0.25), Q_8 an Int6/Int8 device's
storage grid, Q_16 an Int16 device's; π = 32 is the float weight itself.

What a received layer enters the ladder at is read from its values
(:func:`grid_precision`): the coarsest grid 2^-(p-1), p ≤ 16, that holds every value
(an ``int`` uplink of an Int6 or Int8 device: 8; ``ternary``: 2; ``int`` of an Int16: 16).
A layer on no such grid (a K-means or ASYM uplink, a float device) has no rung.
"""

from __future__ import annotations

import numba
import numpy as np

from coordinator.strategies.prowd_dequantizer.config import FULL_PRECISION

GRID_BITS = 16  # the finest grid a received layer is checked against


def level_scale(bits: int) -> float:
    """``2^(bits-1)``: weight = level / level_scale."""
    return float(1 << (bits - 1))


def level_max(bits: int, clip: float = 0.5) -> int:
    """The largest level magnitude on the ``bits`` grid: ``min(round(clip·S), S - 1)``."""
    s = 1 << (bits - 1)
    return min(int(round(clip * s)), s - 1)


def quantize(w: np.ndarray, bits: int, clip: float = 0.5) -> np.ndarray:
    """Q_bits(w) as float32, same shape (``bits >= 32``: a float32 copy of ``w``)."""
    w = np.asarray(w, dtype=np.float32)
    if bits >= FULL_PRECISION:
        return w.copy()
    s = np.float32(level_scale(bits))
    m = level_max(bits, clip)
    q = np.rint(w * s)
    np.clip(q, -m, m, out=q)
    q /= s
    return q


@numba.njit(cache=True, nogil=True)
def _grid_precision(x: np.ndarray, limit: int) -> int:
    """0 when some value is not k·2^-15 with |k| <= limit; else 16 - (trailing zero bits of
    the OR of all |k|) (1 when every value is 0)."""
    acc = 0
    for i in range(x.size):
        v = np.float64(x[i]) * 32768.0
        if not abs(v) <= limit:  # NaN fails too
            return 0
        k = np.int64(v)
        if np.float64(k) != v:
            return 0
        acc |= k if k >= 0 else -k
    if acc == 0:
        return 1
    tz = 0
    while acc & 1 == 0:
        acc >>= 1
        tz += 1
    return 16 - tz


def grid_precision(x: np.ndarray, clip: float = 0.5) -> int:
    """The coarsest grid precision p (bits, 2..16) holding every value of ``x`` (float32,
    any shape) within ±clip; 1 for an all-zero array, 0 when no grid ≤ 16 bits holds it."""
    flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    if flat.size == 0:
        return 1
    return int(_grid_precision(flat, level_max(GRID_BITS, clip)))


@numba.njit(cache=True, nogil=True)
def _apply_pair_table(x: np.ndarray, half: int, scale: float, m: int, table: np.ndarray,
                      out: np.ndarray) -> None:
    """A per-position two-channel dequantizer as a table: in each block of ``2*half``
    elements, element i and element i + half are looked up together (levels on the grid
    ``scale``, offset by ``m``; a padded partner is level 0)."""
    n = x.size
    n_levels = 2 * m + 1
    block = 2 * half
    for start in range(0, n, block):
        for i in range(half):
            a = start + i
            if a >= n:
                break
            b = a + half
            ia = np.int64(np.rint(np.float64(x[a]) * scale)) + m
            ib = np.int64(np.rint(np.float64(x[b]) * scale)) + m if b < n else m
            row = ia * n_levels + ib
            out[a] = table[row, 0]
            if b < n:
                out[b] = table[row, 1]


def apply_pair_table(x: np.ndarray, half: int, bits: int, table: np.ndarray, clip: float = 0.5) -> np.ndarray:
    """Dequantize the flat float32 layer ``x`` (every value on the ``bits`` grid) with the
    lookup table ``table`` (float32 [L·L, 2], L = 2·m_bits + 1, row ``ia·L + ib``) of a
    per-position network over blocks of 2 channels of ``half`` elements; returns a new
    float32 array."""
    flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    out = np.empty_like(flat)
    _apply_pair_table(flat, int(half), level_scale(bits), level_max(bits, clip), table, out)
    return out


def pair_levels(bits: int, clip: float = 0.5) -> tuple[np.ndarray, np.ndarray]:
    """Every (a, b) level pair of the ``bits`` grid as two float32 arrays of weights, in the
    row order of :func:`apply_pair_table`'s table."""
    m = level_max(bits, clip)
    levels = np.arange(-m, m + 1, dtype=np.float32) / np.float32(level_scale(bits))
    a = np.repeat(levels, levels.size)
    b = np.tile(levels, levels.size)
    return a, b
