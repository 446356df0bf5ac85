"""Fully connected layers: forward, backward-data and the weight gradient, driven by the
non-zero activations.

Weights are stored input-major, ``t [F, O]`` (a row per input feature, the O outputs
contiguous), so that every kernel adds whole rows: most inputs of a layer are zero (they
come out of a ReLU, often through a max-pool: 50-75% zeros), and a zero input costs
nothing in the forward or the weight gradient. Backward-data computes the error only at
inputs whose activation is positive when the input is post-ReLU (``masked``): the ReLU
backward would zero the others, so they are written as 0.

s <= 8 (|values| <= 127): the forward sums ``a * t`` in int16 for up to 256 inputs
(|sum| <= 256 * 127 < 2^15), 16-bit lanes (twice as many per vector as int32).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from edge_client.intnn.kernels.arith import _finish
from edge_client.intnn.kernels.layout import _transpose_fours

U = np.uint64


@njit(cache=True, nogil=True, inline="always")
def _nonzeros(row, idx, val):
    """Compact the non-zero entries of ``row`` into idx/val (branch-free); returns their
    number."""
    cnt = 0
    for f in range(row.shape[0]):
        v = row[f]
        idx[cnt] = f
        val[cnt] = v
        cnt += np.int64(v != 0)
    return cnt


@njit(cache=True, nogil=True)
def linear_forward(a, t, shift, amax, relu, out, acc, acc16, idx, val, n0, n1):
    """out [N, O] = finish(a @ t) for a [N, F] (s-bit) and ternary t [F, O] int8.

    acc: int32 [>= O]; acc16: int16 [>= O] (used when amax <= 127; else may be empty);
    idx/val: int32/int64 [>= F] scratch for a row's non-zero inputs. Per sample, every
    non-zero input adds (two at a time) its value times a row of t. Samples n0 <= n < n1.
    """
    n_out = t.shape[1]
    tf = t.reshape(-1)
    narrow = amax <= 127 and acc16.shape[0] >= n_out
    for n in range(n0, n1):
        cnt = _nonzeros(a[n], idx, val)
        for o in range(n_out):
            acc[o] = 0
        if narrow:
            for s0 in range(0, cnt, 256):
                s1 = min(cnt, s0 + 256)
                for o in range(n_out):
                    acc16[o] = 0
                # int32 arithmetic truncated to int16 at the store: exact (the partial
                # sums fit), and LLVM 14 (numba 0.60, Python 3.9) vectorizes it, where
                # int16 operands made it run 3x slower than newer LLVMs
                j = s0
                while j + 2 <= s1:
                    v1 = np.int32(val[j])
                    v2 = np.int32(val[j + 1])
                    r1 = idx[j] * n_out
                    r2 = idx[j + 1] * n_out
                    for o in range(n_out):
                        acc16[o] = np.int16(np.int32(acc16[o]) + v1 * np.int32(tf[U(r1 + o)])
                                            + v2 * np.int32(tf[U(r2 + o)]))
                    j += 2
                if j < s1:
                    v1 = np.int32(val[j])
                    r1 = idx[j] * n_out
                    for o in range(n_out):
                        acc16[o] = np.int16(np.int32(acc16[o]) + v1 * np.int32(tf[U(r1 + o)]))
                for o in range(n_out):
                    acc[o] = np.int32(acc[o] + np.int32(acc16[o]))
        else:
            for j in range(cnt):
                v1 = np.int32(val[j])
                r1 = idx[j] * n_out
                for o in range(n_out):
                    acc[o] = np.int32(acc[o] + v1 * np.int32(tf[U(r1 + o)]))
        for o in range(n_out):
            out[n, o] = _finish(np.int64(acc[o]), shift, amax, relu)


@njit(cache=True, nogil=True)
def linear_backward_data(eq, t, a_in, masked, out, idx, n0, n1):
    """out [N, F] int32 = eq @ t.T (eq [N, O] s-bit, t [F, O] ternary); where ``masked``
    and a_in [N, F] <= 0, out is 0 (not computed). Per sample, the inputs that need it
    are listed (idx: int32 [>= F] scratch), then int32 dot products of the sample's
    errors with four rows of t at a time (one load of the errors for four outputs).
    Samples n0 <= n < n1."""
    n_in = t.shape[0]
    n_out = t.shape[1]
    tf = t.reshape(-1)
    ef = eq.reshape(-1)
    for n in range(n0, n1):
        cnt = 0
        for f in range(n_in):
            out[n, f] = 0
            idx[cnt] = f
            cnt += np.int64((not masked) or a_in[n, f] > 0)
        b0 = n * n_out
        j = 0
        while j + 4 <= cnt:
            f0 = idx[j]
            f1 = idx[j + 1]
            f2 = idx[j + 2]
            f3 = idx[j + 3]
            r0 = f0 * n_out
            r1 = f1 * n_out
            r2 = f2 * n_out
            r3 = f3 * n_out
            s0 = np.int32(0)
            s1 = np.int32(0)
            s2 = np.int32(0)
            s3 = np.int32(0)
            for o in range(n_out):
                ev = np.int32(ef[U(b0 + o)])
                s0 = np.int32(s0 + ev * np.int32(tf[U(r0 + o)]))
                s1 = np.int32(s1 + ev * np.int32(tf[U(r1 + o)]))
                s2 = np.int32(s2 + ev * np.int32(tf[U(r2 + o)]))
                s3 = np.int32(s3 + ev * np.int32(tf[U(r3 + o)]))
            out[n, f0] = s0
            out[n, f1] = s1
            out[n, f2] = s2
            out[n, f3] = s3
            j += 4
        while j < cnt:
            f0 = idx[j]
            r0 = f0 * n_out
            s0 = np.int32(0)
            for o in range(n_out):
                s0 = np.int32(s0 + np.int32(ef[U(b0 + o)]) * np.int32(tf[U(r0 + o)]))
            out[n, f0] = s0
            j += 1


@njit(cache=True, nogil=True)
def linear_weight_grad(eq, a, g_out, idx, val, a_t, f0, f1):
    """g_out [F, O] = a.T @ eq (a [N, F], eq [N, O], s-bit); int32 or int64 g_out (the
    caller picks a width that cannot overflow). Returns max |g| (int64).

    a_t: [F, >= N] scratch (a's dtype) receives a transposed; row f of g then adds, for
    every sample whose input f is non-zero (listed branch-free; idx/val: int32 [>= N]),
    that input times the sample's errors, two samples per pass, in int32 lanes when g is
    int32 (the true sums fit). Rows f0 <= f < f1 only (their max |g| is returned).
    """
    n_s = a.shape[0]
    n_out = g_out.shape[1]
    ef = eq.reshape(-1)
    gf = g_out.reshape(-1)
    if a.itemsize == 1 and a_t.shape[1] % 4 == 0:
        _transpose_fours(a, a_t, f0, f1)  # four samples a word (docs/performance.md)
    else:
        for n in range(n_s):
            for f in range(f0, f1):
                a_t[f, n] = a[n, f]
    narrow = g_out.itemsize <= 4
    gmax = np.int64(0)
    for f in range(f0, f1):
        cnt = 0
        for n in range(n_s):
            v = a_t[f, n]
            idx[cnt] = n * n_out
            val[cnt] = v
            cnt += np.int64(v != 0)
        r = f * n_out
        for o in range(n_out):
            gf[U(r + o)] = 0
        if narrow:
            j = 0
            while j + 2 <= cnt:
                v1 = np.int32(val[j])
                v2 = np.int32(val[j + 1])
                e1 = idx[j]
                e2 = idx[j + 1]
                for o in range(n_out):
                    gf[U(r + o)] = np.int32(gf[U(r + o)] + v1 * np.int32(ef[U(e1 + o)])
                                            + v2 * np.int32(ef[U(e2 + o)]))
                j += 2
            if j < cnt:
                v1 = np.int32(val[j])
                e1 = idx[j]
                for o in range(n_out):
                    gf[U(r + o)] = np.int32(gf[U(r + o)] + v1 * np.int32(ef[U(e1 + o)]))
        else:
            for j in range(cnt):
                v1 = np.int64(val[j])
                e1 = idx[j]
                for o in range(n_out):
                    gf[U(r + o)] = gf[U(r + o)] + v1 * np.int64(ef[U(e1 + o)])
        for o in range(n_out):
            v = np.int64(gf[U(r + o)])
            v = -v if v < 0 else v
            gmax = v if v > gmax else gmax
    return gmax
