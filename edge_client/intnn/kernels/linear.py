"""Fully connected layers: forward, backward-data and the int32 weight gradient.

The forward computes 2-sample x 4-output dot products with ternary weights (int32
``[N, O]`` scratch). Backward-data and the weight gradient share one pairwise
row-combination kernel (``_rows_combination``): two non-zero errors per pass over a row.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from edge_client.intnn.kernels.arith import _dots_rows, _finish


@njit(cache=True)
def linear_forward(a, t, shift, amax, relu, out, acc):
    """a: [N, F]; t: [O, F] int8 ternary; out: [N, O] = finish(a @ t.T); acc: int32
    scratch [>= N, O]. Dot products of 2 samples x 4 outputs per pass (t is read from
    memory N/2 times, not N times)."""
    n = a.shape[0]
    n_out = t.shape[0]
    acc2 = acc[:n]
    acc2[...] = 0
    _dots_rows(a, t, a.shape[1], acc2, n, n_out)
    for i in range(n):
        for o in range(n_out):
            out[i, o] = _finish(acc2[i, o], shift, amax, relu)


@njit(cache=True)
def _rows_combination(row, coef, mat):
    """row[:] = sum_k coef[k] * mat[k, :] in int32 (row int32 [F], coef [K], mat [K, F]),
    two non-zero coefficients per pass over the row (most errors are zero)."""
    f = row.shape[0]
    for i in range(f):
        row[i] = 0
    have = False
    c1 = np.int32(0)
    k1 = 0
    for k in range(coef.shape[0]):
        c = np.int32(coef[k])
        if c == 0:
            continue
        if not have:
            c1 = c
            k1 = k
            have = True
            continue
        have = False
        x1 = mat[k1]
        x2 = mat[k]
        for i in range(f):
            row[i] = np.int32(row[i] + c1 * np.int32(x1[i]) + c * np.int32(x2[i]))
    if have:
        x1 = mat[k1]
        for i in range(f):
            row[i] = np.int32(row[i] + c1 * np.int32(x1[i]))


@njit(cache=True)
def linear_backward_data(eq, t, out):
    """out[n, :] = sum_o eq[n, o] * t[o, :]; eq [N, O], t [O, F] ternary, out [N, F] int32.
    Two non-zero errors per pass over the row."""
    for n in range(eq.shape[0]):
        _rows_combination(out[n], eq[n], t)


@njit(cache=True)
def linear_weight_grad(eq, a, g_out):
    """g_out[o, :] = sum_n eq[n, o] * a[n, :]; g_out [O, F] int32 or int64.

    One output row at a time (it stays in L1 while the samples are added); for int32,
    two non-zero errors per pass."""
    f = g_out.shape[1]
    n_s = eq.shape[0]
    wide = g_out.itemsize > 4
    for o in range(g_out.shape[0]):
        row = g_out[o]
        if not wide:
            _rows_combination(row, eq[:, o], a)
            continue
        for j in range(f):
            row[j] = 0
        for n in range(n_s):
            e = np.int64(eq[n, o])
            if e != 0:
                x = a[n]
                for j in range(f):
                    row[j] += e * x[j]
