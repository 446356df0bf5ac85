"""The counter-based random stream of stochastic rounding (SplitMix64, integers only).

``stream_key(seed, step, layer, stream)`` keys one stream per (device seed, step, layer,
stream id); ``rand62(key, j)`` is its ``j``-th 62-bit draw, so a weight's draw depends on
its index only, not on the order in which kernels visit weights. ``_stoch_round_shift``
is ``v / 2^sh`` rounded stochastically: ``sign(v)(floor|.| + Bernoulli(frac|.|))``
(truncation toward zero plus the draw, never floor: docs/algorithms.md §1).
"""

from __future__ import annotations

import numpy as np
from numba import njit

# SplitMix64 constants as two's-complement int64.
_GOLDEN = np.int64(0x9E3779B97F4A7C15 - (1 << 64))


_MIX1 = np.int64(0xBF58476D1CE4E5B9 - (1 << 64))


_MIX2 = np.int64(0x94D049BB133111EB - (1 << 64))


_MASK62 = np.int64((1 << 62) - 1)


@njit(cache=True, nogil=True, inline="always")
def _lsr(z: int, k: int) -> int:
    """Logical right shift of a 64-bit pattern held in an int64 (0 < k < 64)."""
    return (z >> k) & ((np.int64(1) << (64 - k)) - 1)


@njit(cache=True, nogil=True, inline="always")
def mix64(z: int) -> int:
    """SplitMix64 finalizer on an int64 bit pattern (wrapping arithmetic)."""
    z = (z ^ _lsr(z, 30)) * _MIX1
    z = (z ^ _lsr(z, 27)) * _MIX2
    return z ^ _lsr(z, 31)


@njit(cache=True, nogil=True, inline="always")
def rand62(key: int, j: int) -> int:
    """The ``j``-th 62-bit random integer of the counter-based stream ``key``."""
    return (mix64(key + (j + 1) * _GOLDEN) >> 2) & _MASK62


@njit(cache=True, nogil=True)
def stream_key(seed: int, step: int, layer: int, stream: int) -> int:
    """Key of the random stream for (device seed, step counter, layer, stream id)."""
    z = mix64(seed * _GOLDEN + 0x1234567)
    z = mix64(z ^ (step * 1048583 + layer * 131 + stream))
    return z


@njit(cache=True, nogil=True, inline="always")
def _stoch_round_shift(v: int, sh: int, key: int, j: int) -> int:
    """``v / 2^sh`` stochastically rounded: sign(v)(floor|.| + Bernoulli(frac|.|))."""
    if sh <= 0:
        return v << (-sh)
    av = -v if v < 0 else v
    if sh > 62:  # only the 62 leading fraction bits take part in the draw
        av = av >> (sh - 62)
        sh = 62
    fl = av >> sh
    fr = av - (fl << sh)
    if fr > 0 and (rand62(key, j) >> (62 - sh)) < fr:
        fl += 1
    return -fl if v < 0 else fl
