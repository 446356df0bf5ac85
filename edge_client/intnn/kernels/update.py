"""Error quantization (paper eq. 12) and the weight update (eq. 15-16).

- :func:`quantize_error`: ``k = round(log2 max|e|)``, ``e_q = clip(round_shift(e, k -
  (s - 1)), +-(S(s) - 1))``;
- :func:`sgd_update`: ``k_g = round(log2 max|G|)``, ``d = stoch_round(G * 2^lr_log2 /
  2^k_g)`` in LSBs of the storage grid, plus an optional fixed-point FedProx / FedFOR term
  on its own random stream, then clip and re-ternarize. The usual case (no extra term)
  runs ``_update_common``, branch-free so that it vectorizes;
- :func:`regularizer_terms`: the FedProx / FedFOR numerators of that extra term (FedFOR's
  g on a finer grid than the weights, so that a step of 1e-3 survives on Int8).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from edge_client.intnn.kernels.arith import max_abs, round_log2, round_shift
from edge_client.intnn.kernels.rng import _GOLDEN, _MASK62, _MIX1, _MIX2, _stoch_round_shift


@njit(cache=True)
def quantize_error(e, bits, out):
    """Paper eq. 12 with WAGE rounding: k = round(log2 max|e|),
    out = clip(round_shift(e, k - (bits - 1)), +-(2^(bits-1) - 1)); flat arrays.

    Returns k (or -1 when e is all zero, in which case out is zeroed).
    """
    m = max_abs(e)
    amax = (np.int64(1) << (bits - 1)) - 1
    if m == 0:
        for i in range(e.shape[0]):
            out[i] = 0
        return -1
    k = round_log2(m)
    sh = k - (bits - 1)
    for i in range(e.shape[0]):
        v = round_shift(np.int64(e[i]), sh)
        if v > amax:
            v = amax
        elif v < -amax:
            v = -amax
        out[i] = v
    return k


@njit(cache=True)
def sgd_update(w, g, lr_log2, wmax, thr, key, t, extra, extra_shift, key2):
    """Paper eq. 15-16 on flat arrays, then re-ternarize.

    k_g = round(log2 max|g|);  d = stoch_round(g * 2^lr_log2 / 2^k_g)  (LSB units);
    when ``extra_shift >= 0`` a second term d2 = stoch_round(extra / 2^extra_shift) (FedProx /
    FedFOR, fixed point, own random stream ``key2``) is added;
    w <- clip(w - d - d2, +-wmax);  t <- +1 if w > thr, -1 if w < -thr, else 0.

    w: stored weights (int8/int16); g: gradient (int32/int64); t: int8 ternary out;
    extra: int64 (ignored when extra_shift < 0). Returns k_g (-1 when g is all zero).
    """
    m = max_abs(g)
    kg = -1
    sh = 0
    if m > 0:
        kg = round_log2(m)
        sh = kg - lr_log2
        if 0 < sh <= 62 and extra_shift < 0:
            _update_common(w, g, sh, wmax, thr, key, t)
            return kg
    for j in range(w.shape[0]):
        v = np.int64(w[j])
        if m > 0:
            v -= _stoch_round_shift(np.int64(g[j]), sh, key, j)
        if extra_shift >= 0:
            v -= _stoch_round_shift(extra[j], extra_shift, key2, j)
        if v > wmax:
            v = wmax
        elif v < -wmax:
            v = -wmax
        w[j] = v
        if v > thr:
            t[j] = 1
        elif v < -thr:
            t[j] = -1
        else:
            t[j] = 0
    return kg


@njit(cache=True, inline="always")
def _update_common(w, g, sh, wmax, thr, key, t):
    """The usual case of :func:`sgd_update` (0 < sh <= 62, no extra term), branch-free so
    that it vectorizes; same results as the general loop. Blocks of 256 all-zero gradients
    (whole rows of a linear layer whose errors are all zero) skip the random draws: their
    update is zero, only the clip and the ternarization remain."""
    frac_mask = (np.int64(1) << sh) - 1
    top = 62 - sh
    n = w.shape[0]
    for b0 in range(0, n, 256):
        m = min(n, b0 + 256) - b0
        gb = g[b0:b0 + m]
        wb = w[b0:b0 + m]
        tb = t[b0:b0 + m]
        nz = np.int64(0)
        for j in range(m):
            nz |= np.int64(gb[j])
        if nz == 0:
            for j in range(m):
                v = np.int64(wb[j])
                v = wmax if v > wmax else v
                v = -wmax if v < -wmax else v
                wb[j] = v
                tb[j] = 1 if v > thr else (-1 if v < -thr else 0)
            continue
        z0 = key + b0 * _GOLDEN  # z = key + (j + 1) * GOLDEN as an induction variable
        for j in range(m):
            gv = np.int64(gb[j])
            av = -gv if gv < 0 else gv
            fl = av >> sh
            fr = av & frac_mask
            z0 += _GOLDEN
            z = z0
            z = (z ^ ((z >> 30) & 0x3FFFFFFFF)) * _MIX1
            z = (z ^ ((z >> 27) & 0x1FFFFFFFFF)) * _MIX2
            z = z ^ ((z >> 31) & 0x1FFFFFFFF)
            r = ((z >> 2) & _MASK62) >> top
            fl += np.int64(r < fr)
            d = -fl if gv < 0 else fl
            v = np.int64(wb[j]) - d
            v = wmax if v > wmax else v
            v = -wmax if v < -wmax else v
            wb[j] = v
            tb[j] = 1 if v > thr else (-1 if v < -thr else 0)


@njit(cache=True)
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
