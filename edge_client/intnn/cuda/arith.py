"""The CPU engine's integer helpers as CUDA device functions, the same formulas bit for bit
(``kernels.arith``, ``kernels.rng``): the rounding shift, exact ``round(log2)``, the
forward's finish, the SplitMix64 counter stream and its stochastic rounding.

Every value read from an array is cast to the width its arithmetic needs before it is
used: under Numba's CUDA simulator the arithmetic is numpy's (an ``int8 * int8`` product
wraps at 8 bits there), on the GPU it is Numba's (integers widen to int64).
"""

from __future__ import annotations

import numpy as np

from edge_client.intnn.cuda.device import cuda
from edge_client.intnn.kernels.arith import LOG2_HALF_THRESH
from edge_client.intnn.kernels.loss import EXP2_NEG_FRAC_Q30
from edge_client.intnn.kernels.rng import _GOLDEN, _MASK62, _MIX1, _MIX2

# module-level arrays a kernel reads are copied into the kernel as constants
_THRESH = LOG2_HALF_THRESH.copy()
_EXP2 = EXP2_NEG_FRAC_Q30.copy()
_SEED_OFFSET = np.int64(0x1234567)


@cuda.jit(device=True, inline=True)
def lsr(z, k):
    """Logical right shift of a 64-bit pattern held in an int64 (0 < k < 64)."""
    return (z >> k) & ((np.int64(1) << (64 - k)) - np.int64(1))


@cuda.jit(device=True, inline=True)
def mix64(z):
    """SplitMix64's finalizer (wrapping int64 arithmetic)."""
    z = (z ^ lsr(z, 30)) * _MIX1
    z = (z ^ lsr(z, 27)) * _MIX2
    return z ^ lsr(z, 31)


@cuda.jit(device=True, inline=True)
def rand62(key, j):
    """Draw ``j`` of the counter-based stream ``key`` (``kernels.rng.rand62``)."""
    return (mix64(key + (np.int64(j) + np.int64(1)) * _GOLDEN) >> 2) & _MASK62


@cuda.jit(device=True, inline=True)
def stream_key(seed, step, layer, stream):
    """``kernels.rng.stream_key``: the stream of (device seed, step, layer, stream id)."""
    z = mix64(np.int64(seed) * _GOLDEN + _SEED_OFFSET)
    return mix64(z ^ (np.int64(step) * np.int64(1048583) + np.int64(layer) * np.int64(131)
                      + np.int64(stream)))


@cuda.jit(device=True, inline=True)
def stoch_round_shift(v, sh, key, j):
    """``v / 2^sh`` stochastically rounded with draw ``j`` of ``key``
    (``kernels.rng._stoch_round_shift``)."""
    v = np.int64(v)
    if sh <= 0:
        return v << (-sh)
    av = -v if v < 0 else v
    if sh > 62:
        av = av >> (sh - 62)
        sh = 62
    fl = av >> sh
    fr = av - (fl << sh)
    if fr > 0 and (rand62(key, j) >> (62 - sh)) < fr:
        fl += 1
    return -fl if v < 0 else fl


@cuda.jit(device=True, inline=True)
def round_shift(v, k):
    """``v / 2^k`` rounded half away from zero (k > 0), ``v * 2^-k`` (k <= 0)."""
    v = np.int64(v)
    if k > 0:
        half = np.int64(1) << (k - 1)
        av = -v if v < 0 else v
        r = (av + half) >> k
        return -r if v < 0 else r
    if k < 0:
        return v << (-k)
    return v


@cuda.jit(device=True, inline=True)
def round_log2(m):
    """``round(log2 m)`` of an integer ``m >= 1``, exactly."""
    m = np.int64(m)
    b = 0
    while (m >> (b + 1)) > 0:
        b += 1
    if m > _THRESH[b]:
        return b + 1
    return b


@cuda.jit(device=True, inline=True)
def finish(acc, shift, amax, relu):
    """The forward's finish: rounding shift, the fused ReLU, the clip to ``+-amax``."""
    v = round_shift(acc, shift)
    if relu and v < 0:
        v = np.int64(0)
    if v > amax:
        v = np.int64(amax)
    elif v < -amax:
        v = np.int64(-amax)
    return v


@cuda.jit(device=True, inline=True)
def exp2_neg(q, j):
    """``2^-(q + j/16)`` in Q30 (the integer softmax's table, ``kernels.loss``)."""
    if q < 62:
        return _EXP2[j] >> q
    return np.int64(0)
