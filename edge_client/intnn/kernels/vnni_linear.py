"""The linear layers' int8 dot products on AVX-512 VNNI (:mod:`.vnni`; compiled only where
the CPU has it), on input-major ternary weights ``t [F, O]``, bit-identical to
:mod:`.linear`'s (tests/packages/edge_client/test_intnn_vnni.py):

- :func:`linear_forward_vnni` (O >= 16): a block of weight rows at a time for every
  sample, the rows staying in L1 while the samples' non-zero inputs add into their sums;
- :func:`linear_backward_data_vnni` (O >= 64);
- :func:`linear_weight_grad_vnni` (O a multiple of 64: four samples' products per
  instruction into 16 outputs' lanes); :func:`linear_grad_max_vnni` +
  :func:`linear_update_vnni`: the gradient's max, then the stochastic update with the
  gradient made again two rows at a time, so a large layer's int32 gradient is never
  written and read back (docs/performance.md).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from edge_client.intnn.kernels.arith import _finish
from edge_client.intnn.kernels.layout import _transpose_fours
from edge_client.intnn.kernels.rng import _GOLDEN
from edge_client.intnn.kernels.update import _update_rows
from edge_client.intnn.kernels.vnni import _pad_to_fours, _rows_dot
from edge_client.intnn.kernels.vnni_intrinsics import VEC, _dot_block, _outer_block

U = np.uint64
#: weight rows the VNNI linear forward takes at a time (64 KB of fc1's at O = 512: in L2,
#: each row in L1 while it is used; docs/performance.md#the-kernels)
FORWARD_ROWS = 128
#: samples whose sums the VNNI linear forward keeps at a time (its acc scratch: this x O)
FORWARD_SAMPLES = 32


@njit(cache=True, nogil=True)
def linear_forward_vnni(a, t, shift, amax, relu, out, acc, idx, val, n0, n1):
    """:func:`~.linear.linear_forward` (out [N, O] = finish(a @ t), a [N, F] int8 with
    |a| <= 127, t [F, O] int8 ternary) with vpdpbusd, for O >= 16 and F * 255 * 128 <
    2^31. Up to :data:`FORWARD_SAMPLES` samples at a time: for each block of
    :data:`FORWARD_ROWS` rows, each sample's non-zero inputs in the block (idx/val: int32
    [>= min(F, FORWARD_ROWS) + 4] scratch) in fours against their rows interleaved
    (:func:`~.vnni._rows_dot`), into the sample's int32 sums (acc: int32 [>=
    FORWARD_SAMPLES * O] scratch); the last O % 16 outputs in plain integers. Samples
    n0 <= n < n1."""
    n_in = t.shape[0]
    n_out = t.shape[1]
    tf = t.reshape(-1)
    af = a.reshape(-1)
    m16 = n_out - n_out % 16
    for s0 in range(n0, n1, FORWARD_SAMPLES):
        s1 = min(n1, s0 + FORWARD_SAMPLES)
        acc[:(s1 - s0) * n_out] = 0
        for f0 in range(0, n_in, FORWARD_ROWS):
            f1 = min(n_in, f0 + FORWARD_ROWS)
            for n in range(s0, s1):
                cnt = 0
                s = 0
                for f in range(f0, f1):  # the block's non-zero inputs, branch-free
                    v = np.int32(af[U(n * n_in + f)])
                    idx[cnt] = f * n_out
                    val[cnt] = v
                    s += v
                    cnt += np.int64(v != 0)
                if cnt == 0:
                    continue
                cnt = _pad_to_fours(idx, val, cnt)
                d = (n - s0) * n_out
                _rows_dot(acc, d, tf, idx, val, 0, cnt, 0, m16, 128 * s)
                for o in range(m16, n_out):
                    v = np.int32(0)
                    for q in range(cnt):
                        v = np.int32(v + np.int32(val[q]) * np.int32(tf[U(idx[q] + o)]))
                    acc[d + o] = np.int32(acc[d + o] + v)
        for n in range(s0, s1):
            d = (n - s0) * n_out
            for o in range(n_out):
                out[n, o] = _finish(np.int64(acc[d + o]), shift, amax, relu)


@njit(cache=True, nogil=True)
def linear_backward_data_vnni(eq, t, a_in, masked, out, corr, n0, n1):
    """:func:`~.linear.linear_backward_data` (out [N, F] int32 = eq @ t.T, 0 where
    ``masked`` and a_in <= 0) with vpdpbusd, for O >= 64: four rows of t (the unsigned
    side, flipped) x two samples' errors per block, every row of t read once per call;
    the last O % 64 outputs in plain integers. corr: int32 [>= n1 - n0] scratch (128 x
    each sample's error sum: the flip's correction). Samples n0 <= n < n1."""
    n_in = t.shape[0]
    n_out = t.shape[1]
    tf = t.reshape(-1)
    ef = eq.reshape(-1)
    n64 = n_out // VEC
    tail = n64 * VEC
    for n in range(n0, n1):
        s = np.int32(0)
        for o in range(tail):
            s = np.int32(s + np.int32(ef[U(n * n_out + o)]))
        corr[n - n0] = np.int32(s * 128)
    last = n_in - 1
    for f in range(0, n_in, 4):
        fi = (f, min(f + 1, last), min(f + 2, last), min(f + 3, last))
        rows = (fi[0] * n_out, fi[1] * n_out, fi[2] * n_out, fi[3] * n_out)
        for n in range(n0, n1, 2):
            nb = min(n + 1, n1 - 1)
            s = _dot_block(tf, rows, ef, (n * n_out, nb * n_out), n64)
            for i in range(4):
                for j in range(2):
                    nn = n if j == 0 else nb
                    v = np.int32(s[2 * i + j] - corr[nn - n0])
                    for o in range(tail, n_out):
                        v = np.int32(v + np.int32(ef[U(nn * n_out + o)])
                                     * np.int32(tf[U(rows[i] + o)]))
                    if masked and a_in[nn, fi[i]] <= 0:
                        v = np.int32(0)
                    out[nn, fi[i]] = v


@njit(cache=True, nogil=True, inline="always")
def _pack_linear(eq, a, a_t, ep, f0, f1):
    """a_t[f, :N4] = a[:, f] (zero past N) for f0 <= f < f1, ep = eq packed [N4/4, O, 4]
    (zero past N); returns 128 x each output's error sum (int32 [O], the flip's
    correction)."""
    n_s = a.shape[0]
    n_out = eq.shape[1]
    n4 = (n_s + 3) // 4 * 4
    ef = eq.reshape(-1)
    _transpose_fours(a, a_t, f0, f1)
    for k in range(n4 // 4):
        for o in range(n_out):
            for j in range(4):
                n = 4 * k + j
                ep[U((k * n_out + o) * 4 + j)] = ef[U(n * n_out + o)] if n < n_s else 0
    corr = np.zeros(n_out, np.int32)
    for n in range(n_s):
        for o in range(n_out):
            corr[o] = np.int32(corr[o] + np.int32(ef[U(n * n_out + o)]))
    for o in range(n_out):
        corr[o] = np.int32(corr[o] * 128)
    return corr


@njit(cache=True, nogil=True, inline="always")
def _grad_rows(af, la, nq, ep, corr, f, fb, gf, g0, g1):
    """Rows f and fb of the gradient into gf at offsets g0 and g1 (O a multiple of 64)."""
    n_out = corr.shape[0]
    for o in range(0, n_out, 64):
        _outer_block(af, (f * la, fb * la), nq, ep, n_out * 4, (o, o + 16, o + 32, o + 48),
                     corr, gf, (g0, g1), nq, 0)


@njit(cache=True, nogil=True, inline="always")
def _max_abs_run(gf, i0, i1, m):
    for i in range(i0, i1):
        v = np.int64(gf[U(i)])
        v = -v if v < 0 else v
        m = v if v > m else m
    return m


@njit(cache=True, nogil=True)
def linear_weight_grad_vnni(eq, a, g_out, a_t, ep, f0, f1):
    """:func:`~.linear.linear_weight_grad` (int32 g_out [F, O] = a.T @ eq, rows
    f0 <= f < f1; returns their max |g|) with vpdpbusd, for O a multiple of 64: each
    instruction adds four samples' products to 16 outputs of a row, two rows x 64 outputs
    per block, so no sum is reduced across lanes. a_t: [F, >= N4] scratch (N4: N rounded
    up to 4) receives a transposed, zero past N; ep: [>= N4 * O] int8 scratch receives
    eq packed in groups of four samples ([N4/4, O, 4])."""
    n_out = g_out.shape[1]
    corr = _pack_linear(eq, a, a_t, ep, f0, f1)
    gf = g_out.reshape(-1)
    nq = (a.shape[0] + 3) // 4
    for f in range(f0, f1, 2):
        fb = min(f + 1, f1 - 1)
        _grad_rows(a_t.reshape(-1), a_t.shape[1], nq, ep, corr, f, fb, gf, f * n_out,
                   fb * n_out)
    return _max_abs_run(gf, f0 * n_out, f1 * n_out, np.int64(0))


@njit(cache=True, nogil=True)
def linear_grad_max_vnni(eq, a, a_t, ep, f0, f1):
    """The max |g| :func:`linear_weight_grad_vnni` returns, with the gradient's rows made
    two at a time in a small buffer and not stored (the update makes them again:
    :func:`linear_update_vnni`)."""
    n_out = eq.shape[1]
    corr = _pack_linear(eq, a, a_t, ep, f0, f1)
    buf = np.empty(2 * n_out, np.int32)
    nq = (a.shape[0] + 3) // 4
    m = np.int64(0)
    for f in range(f0, f1, 2):
        _grad_rows(a_t.reshape(-1), a_t.shape[1], nq, ep, corr, f, min(f + 1, f1 - 1), buf, 0,
                   n_out)
        m = _max_abs_run(buf, 0, 2 * n_out, m)
    return m


@njit(cache=True, nogil=True)
def linear_update_vnni(eq, a, a_t, ep, w, t, sh, wmax, thr, key, rows, f0, f1):
    """:func:`~.update.sgd_update` on rows f0 <= f < f1 of a linear layer ([F, O] storage,
    counters over [O, F]: ``rows`` = F) in its usual case (0 < sh <= 62, no extra term),
    each pair of gradient rows made again (:func:`linear_grad_max_vnni`) in a small
    buffer just before its weights are updated: the gradient never goes to memory."""
    n_out = eq.shape[1]
    corr = _pack_linear(eq, a, a_t, ep, f0, f1)
    buf = np.empty(2 * n_out, np.int32)
    nq = (a.shape[0] + 3) // 4
    for f in range(f0, f1, 2):
        fb = min(f + 1, f1 - 1)
        _grad_rows(a_t.reshape(-1), a_t.shape[1], nq, ep, corr, f, fb, buf, 0, n_out)
        _update_rows(w, buf, t, f * n_out, 0, n_out, sh, wmax, thr, key + (f + 1) * _GOLDEN,
                     rows * _GOLDEN)
        if fb != f:
            _update_rows(w, buf, t, fb * n_out, n_out, n_out, sh, wmax, thr,
                         key + (fb + 1) * _GOLDEN, rows * _GOLDEN)
