"""Error quantization (paper eq. 12) and the weight update (eq. 15-16).

- :func:`quantize_error`: ``e_q = clip(round_shift(e, round(log2 max|e|) - (s - 1)),
  +-(S(s) - 1))``; :func:`mask_quantize_error` zeroes e first where the layer's output is
  <= 0 (its ReLU), in the same two passes;
- :func:`sgd_update`: ``d = stoch_round(G * 2^lr_log2 / 2^round(log2 max|G|))`` LSBs,
  plus an optional fixed-point FedProx / FedFOR term on its own stream
  (:func:`regularizer_terms` makes its numerators), then clip and re-ternarize.

The stochastic-rounding counter ``j`` of a weight is its index in the layer's canonical
order (conv ``[K, K, C, O]``, linear ``[O, F]``), whatever order the weights are stored
in: a linear layer stored ``[F, O]`` passes ``rows = F, cols = O`` and weight ``(f, o)``
draws number ``o * F + f``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from edge_client.intnn.kernels.arith import max_abs, round_log2, round_shift_sel
from edge_client.intnn.kernels.rng import _GOLDEN, _MASK62, _MIX1, _MIX2, _stoch_round_shift

U = np.uint64


@njit(cache=True, nogil=True)
def quantize_error(e, bits, out):
    """Paper eq. 12 with WAGE rounding: k = round(log2 max|e|),
    out = clip(round_shift(e, k - (bits - 1)), +-(2^(bits-1) - 1)); flat arrays.

    Returns k (or -1 when e is all zero, in which case out is zeroed).
    """
    m = max_abs(e)
    if m == 0:
        for i in range(e.shape[0]):
            out[i] = 0
        return -1
    k = round_log2(m)
    _quantize(e, k - (bits - 1), bits, out)
    return k


@njit(cache=True, nogil=True, inline="always")
def _quantize(e, sh, bits, out):
    amax = (np.int64(1) << (bits - 1)) - 1
    for i in range(e.shape[0]):
        v = round_shift_sel(np.int64(e[i]), sh)
        v = amax if v > amax else v
        out[i] = -amax if v < -amax else v


@njit(cache=True, nogil=True)
def mask_quantize_error(e, act, bits, out):
    """:func:`quantize_error` of ``e`` zeroed where ``act <= 0`` (flat arrays; e is left
    masked)."""
    m = np.int64(0)
    for i in range(e.shape[0]):
        v = np.int64(e[i]) if act[i] > 0 else np.int64(0)
        e[i] = v
        v = -v if v < 0 else v
        m = v if v > m else m
    if m == 0:
        for i in range(e.shape[0]):
            out[i] = 0
        return -1
    k = round_log2(m)
    _quantize(e, k - (bits - 1), bits, out)
    return k


@njit(cache=True, nogil=True)
def grad_max(g):
    """max |g| of a flat gradient (int64), for :func:`sgd_update`'s ``gmax``."""
    return max_abs(g)


@njit(cache=True, nogil=True, inline="always")
def _counter(i, rows, cols):
    """Stochastic-rounding counter of stored weight i (see the module docstring)."""
    if cols == 0:
        return i
    f = i // cols
    return (i - f * cols) * rows + f


@njit(cache=True, nogil=True)
def sgd_update(w, g, gmax, lr_log2, wmax, thr, key, t, extra, extra_shift, key2, rows, cols,
               i0, i1):
    """Paper eq. 15-16 on flat arrays, then re-ternarize.

    k_g = round(log2 max|g|);  d = stoch_round(g * 2^lr_log2 / 2^k_g)  (LSB units);
    when ``extra_shift >= 0`` a second term d2 = stoch_round(extra / 2^extra_shift) (FedProx /
    FedFOR, fixed point, own random stream ``key2``) is added;
    w <- clip(w - d - d2, +-wmax);  t <- +1 if w > thr, -1 if w < -thr, else 0.

    w: stored weights (int8/int16); g: gradient (int32/int64), ``gmax`` its max |g| when
    known (-1: computed here); t: int8 ternary out; extra: int64 (ignored when
    extra_shift < 0); rows/cols: the storage order (``cols == 0``: canonical, else
    ``[rows, cols]`` holding the canonical ``[cols, rows]``); i0 <= i < i1: the stored
    weights this call updates (a multiple of 256, or of cols, for i0; disjoint ranges may
    run on other threads at once, each with the same ``gmax``). Returns k_g (-1 when g is
    all zero).
    """
    m = gmax if gmax >= 0 else max_abs(g)
    kg = -1
    sh = 0
    if m > 0:
        kg = round_log2(m)
        sh = kg - lr_log2
        if 0 < sh <= 62 and extra_shift < 0:
            if cols == 0:
                for b0 in range(i0, i1, 256):
                    _update_rows(w, g, t, b0, b0, min(i1, b0 + 256) - b0, sh, wmax, thr,
                                 key + (b0 + 1) * _GOLDEN, _GOLDEN)
            else:
                for f in range(i0 // cols, i1 // cols):
                    _update_rows(w, g, t, f * cols, f * cols, cols, sh, wmax, thr,
                                 key + (f + 1) * _GOLDEN, rows * _GOLDEN)
            return kg
    for i in range(i0, i1):
        _update_one(w, g, t, i, i, _counter(i, rows, cols), m > 0, sh, wmax, thr, key, extra,
                    extra_shift, key2)
    return kg


@njit(cache=True, nogil=True, inline="always")
def _update_one(w, g, t, i, gi, j, data, sh, wmax, thr, key, extra, extra_shift, key2):
    """The general case of :func:`sgd_update` for stored weight i (gradient g[gi],
    counter j): any shift, the extra term when ``extra_shift >= 0``."""
    v = np.int64(w[i])
    if data:
        v -= _stoch_round_shift(np.int64(g[gi]), sh, key, j)
    if extra_shift >= 0:
        v -= _stoch_round_shift(extra[i], extra_shift, key2, j)
    if v > wmax:
        v = wmax
    elif v < -wmax:
        v = -wmax
    w[i] = v
    if v > thr:
        t[i] = 1
    elif v < -thr:
        t[i] = -1
    else:
        t[i] = 0


@njit(cache=True, nogil=True, inline="always")
def _update_rows(w, g, t, b0, gb0, m, sh, wmax, thr, z_first, z_step):
    """The usual case of :func:`sgd_update` (0 < sh <= 62, no extra term) on the run
    ``[b0, b0 + m)`` of weights (their gradients at ``[gb0, gb0 + m)`` of g) whose
    counters form an arithmetic progression: the SplitMix64 state of the run's first
    weight is ``z_first = key + (j0 + 1) * GOLDEN``, the next one's ``z_step`` further. Branch-free so that it vectorizes; same results as the general
    loop. A run of all-zero gradients (a row of a layer whose inputs or errors were all
    zero) skips the random draws: its update is zero, only the clip and the ternarization
    remain."""
    frac_mask = (np.int64(1) << sh) - 1
    top = 62 - sh
    nz = np.int64(0)
    for j in range(m):
        nz |= np.int64(g[U(gb0 + j)])
    if nz == 0:
        for j in range(m):
            v = np.int64(w[U(b0 + j)])
            v = wmax if v > wmax else v
            v = -wmax if v < -wmax else v
            w[U(b0 + j)] = v
            t[U(b0 + j)] = 1 if v > thr else (-1 if v < -thr else 0)
        return
    z0 = z_first - z_step
    for j in range(m):
        gv = np.int64(g[U(gb0 + j)])
        av = -gv if gv < 0 else gv
        fl = av >> sh
        fr = av & frac_mask
        z0 += z_step
        z = z0
        z = (z ^ ((z >> 30) & 0x3FFFFFFFF)) * _MIX1
        z = (z ^ ((z >> 27) & 0x1FFFFFFFFF)) * _MIX2
        z = z ^ ((z >> 31) & 0x1FFFFFFFF)
        r = ((z >> 2) & _MASK62) >> top
        fl += np.int64(r < fr)
        d = -fl if gv < 0 else fl
        v = np.int64(w[U(b0 + j)]) - d
        v = wmax if v > wmax else v
        v = -wmax if v < -wmax else v
        w[U(b0 + j)] = v
        t[U(b0 + j)] = 1 if v > thr else (-1 if v < -thr else 0)


@njit(cache=True, nogil=True)
def regularizer_terms(w, anchor, mu_q, d_shift, step_g, alpha_q, extra):
    """FedProx + FedFOR step numerators in fixed point (flat arrays, int64 out).

    extra[j] = (mu_q * (w[j] - anchor[j])) << d_shift
               + alpha_q * step_g[j]   if step_g[j] * (w[j] - anchor[j]) > 0.
    ``w``/``anchor``: integers on the storage grid (LSBs); ``step_g``: FedFOR's g on a grid
    ``2^d_shift`` times finer than the storage grid (int32); ``mu_q``/``alpha_q``: the
    coefficients (step size included) in fixed point. The caller sizes them so that no
    term overflows int64 (``IntTrainer``) and divides by ``2^(F + d_shift)``.
    """
    for j in range(w.shape[0]):
        d = np.int64(w[j]) - np.int64(anchor[j])
        v = (mu_q * d) << d_shift
        s = np.int64(step_g[j])
        if alpha_q != 0 and s * d > 0:
            v += alpha_q * s
        extra[j] = v
