"""The output error. WAGE's SSE against ``target * onehot`` (the default: the error is
an integer difference) or an integer softmax cross-entropy, NITI style (base-2 softmax
by shifts, probabilities in Q15), and the count of correct predictions."""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def sse_error(z, y, target, e):
    """Output error of the SSE loss on one-hot targets: e = z - target*onehot(y).

    z: [N, O] logits (activation integers); y: [N] int64 class ids; e: [N, O] int32.
    Returns the integer sum of squared errors (int64).
    """
    sse = np.int64(0)
    for n in range(z.shape[0]):
        for o in range(z.shape[1]):
            v = np.int64(z[n, o])
            if o == y[n]:
                v -= target
            e[n, o] = v
            sse += v * v
    return sse


# round(2^(30 - j/16)) for j = 0..15: 2^-fraction in Q30 for the base-2 softmax.
EXP2_NEG_FRAC_Q30 = np.array([round(2.0 ** (30 - j / 16)) for j in range(16)], dtype=np.int64)


SOFTMAX_ONE = 1 << 15  # probabilities in Q15


@njit(cache=True, nogil=True)
def softmax_error(z, y, bits, temp_shift, e):
    """Integer softmax cross-entropy error (NITI style): e = Q15(softmax) - Q15(onehot).

    Base-2 softmax of the logits z [N, O] (s-bit activations, real value z / 2^(s-1)) at
    temperature 2^-temp_shift: p_i = 2^(u_i) / sum_j 2^(u_j), u = z * 2^temp_shift /
    2^(s-1). With d = (max z - z_i) * 2^temp_shift: 2^(-d / 2^(s-1)) is a right shift by
    the integer part and a 16-entry Q30 table for the fraction (1/16 steps, truncated);
    p_i = (2^-d_i << 15) // sum (Q15, floor). e [N, O] int32. Returns the integer sum over
    samples of (2^15 - p_true): a bounded loss proxy for reporting.
    """
    frac_bits = bits - 1
    total = np.int64(0)
    n_out = z.shape[1]
    for n in range(z.shape[0]):
        m = np.int64(z[n, 0])
        for o in range(1, n_out):
            if z[n, o] > m:
                m = np.int64(z[n, o])
        ssum = np.int64(0)
        for o in range(n_out):
            d = (m - np.int64(z[n, o])) << temp_shift  # >= 0, units of 2^-frac_bits
            q = d >> frac_bits
            f = d - (q << frac_bits)
            if frac_bits >= 4:
                j = f >> (frac_bits - 4)
            else:
                j = f << (4 - frac_bits)
            v = EXP2_NEG_FRAC_Q30[j] >> q if q < 62 else np.int64(0)
            e[n, o] = v  # <= 2^30: fits the int32 output, overwritten below
            ssum += v
        for o in range(n_out):
            p = (np.int64(e[n, o]) << 15) // ssum
            if o == y[n]:
                total += SOFTMAX_ONE - p
                p -= SOFTMAX_ONE
            e[n, o] = p
    return total


@njit(cache=True, nogil=True)
def argmax_correct(z, y):
    """Number of rows of z whose first maximum is at column y[n]."""
    hits = 0
    for n in range(z.shape[0]):
        best = 0
        for o in range(1, z.shape[1]):
            if z[n, o] > z[n, best]:
                best = o
        if best == y[n]:
            hits += 1
    return hits
