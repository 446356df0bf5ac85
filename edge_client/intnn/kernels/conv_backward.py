"""Convolution backward: the error at the layer's input and the weight gradient.

Backward-data (the error through the ternary weights, ``[O, K, K, C]`` copy) sums per
pixel in int16 when ``O * amax`` fits (:func:`conv_backward_data_narrow`), else in int32
(:func:`conv_backward_data`).

Weight gradient ``G = sum_batch e_q (x) a`` (``IntModel._grad_mode`` picks one per layer):

- :func:`conv_weight_grad` (``"int64"``): row-blocked accumulation in int64, when
  ``amax^2 * batch * pixels`` may exceed int32 (s > 8 as a rule);
- :func:`conv_weight_grad_sparse` (``"sparse"``): driven by the non-zero errors (after
  ReLU masking and max-pool routing 5-20% are non-zero), when the ``K*C`` values of a
  patch row are enough to vectorize (``>= SPARSE_GRAD_MIN_ROW``);
- :func:`conv_weight_grad_plane` (``"plane"``): int32 dot products over pixels from runs
  of the stride-1 plane, copied for ``PLANE_GRAD_GROUP`` samples at a time;
- :func:`conv_weight_grad_dot` (``"dot"``): int32 dot products over pixels from the
  transposed im2col (kept by the forward, or rebuilt).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from edge_client.intnn.kernels.arith import _dots_rows
from edge_client.intnn.kernels.layout import _im2col_t, _pad_nhwc, _to_plane


@njit(cache=True)
def conv_backward_data(eq, t, stride, pad, out, pbuf):
    """Error to the conv input: out[n] = col2im(sum_o eq[n, y, x, o] * t[o]); int32 out.

    eq: [N, Ho, Wo, O] quantized errors; t: [O, K, K, C]; out: [N, H, W, C] int32;
    pbuf: int32 scratch of K*K*C elements.
    """
    k = t.shape[1]
    c_in = t.shape[3]
    h_in = out.shape[1]
    w_in = out.shape[2]
    n_out = t.shape[0]
    t2 = t.reshape(n_out, -1)
    r_len = t2.shape[1]
    out[...] = 0
    for n in range(eq.shape[0]):
        for y in range(eq.shape[1]):
            for x in range(eq.shape[2]):
                nz = False
                for o in range(n_out):
                    g = np.int32(eq[n, y, x, o])
                    if g == 0:
                        continue
                    if not nz:
                        for r in range(r_len):
                            pbuf[r] = np.int32(g * np.int32(t2[o, r]))
                        nz = True
                    else:
                        for r in range(r_len):
                            pbuf[r] = np.int32(pbuf[r] + g * np.int32(t2[o, r]))
                if not nz:
                    continue
                r = 0
                for kh in range(k):
                    iy = y * stride + kh - pad
                    for kw in range(k):
                        ix = x * stride + kw - pad
                        if iy >= 0 and iy < h_in and ix >= 0 and ix < w_in:
                            for c in range(c_in):
                                out[n, iy, ix, c] += pbuf[r + c]
                        r += c_in


@njit(cache=True, inline="always")
def _acc_pair(buf, ta, tb, g1, g2, init):
    """buf = g1*ta + g2*tb (init False) or buf += g1*ta + g2*tb, wrapping to buf's width."""
    if init:
        for r in range(buf.shape[0]):
            buf[r] = buf[r] + g1 * ta[r] + g2 * tb[r]
    else:
        for r in range(buf.shape[0]):
            buf[r] = g1 * ta[r] + g2 * tb[r]


@njit(cache=True)
def conv_backward_data_narrow(eq, t, stride, pad, out, pbuf16):
    """Same result as :func:`conv_backward_data` when ``O * max|eq| <= 32767``: the
    per-pixel sum over output channels sum_o eq * t[o] is then exact in int16 (16 lanes
    per vector instead of 8), two non-zero errors per pass; it is added to ``out`` one
    run of K*C (fewer at the borders) contiguous values per kernel row.

    eq: [N, Ho, Wo, O]; t: [O, K, K, C]; out: [N, H, W, C] int32; pbuf16: int16 [K*K*C].
    """
    k = t.shape[1]
    c_in = t.shape[3]
    h_in = out.shape[1]
    w_in = out.shape[2]
    n_out = t.shape[0]
    t2 = t.reshape(n_out, -1)
    kc = k * c_in
    out[...] = 0
    for n in range(eq.shape[0]):
        for y in range(eq.shape[1]):
            for x in range(eq.shape[2]):
                init = False
                have = False
                g1 = np.int32(0)
                o1 = 0
                for o in range(n_out):
                    g = np.int32(eq[n, y, x, o])
                    if g == 0:
                        continue
                    if not have:
                        g1 = g
                        o1 = o
                        have = True
                        continue
                    have = False
                    _acc_pair(pbuf16, t2[o1], t2[o], np.int16(g1), np.int16(g), init)
                    init = True
                if have:
                    _acc_pair(pbuf16, t2[o1], t2[o1], np.int16(g1), np.int16(0), init)
                    init = True
                if not init:
                    continue
                ix0 = x * stride - pad
                kw_lo = 0 if ix0 >= 0 else -ix0
                kw_hi = k if ix0 + k <= w_in else w_in - ix0
                if kw_hi <= kw_lo:
                    continue
                ln = (kw_hi - kw_lo) * c_in
                for kh in range(k):
                    iy = y * stride + kh - pad
                    if iy < 0 or iy >= h_in:
                        continue
                    dst = out[n, iy].reshape(-1)[(ix0 + kw_lo) * c_in:(ix0 + kw_hi) * c_in]
                    r0 = kh * kc + kw_lo * c_in
                    src = pbuf16[r0:r0 + ln]
                    for j in range(ln):
                        dst[j] = dst[j] + src[j]


@njit(cache=True)
def conv_weight_grad(eq, a, stride, pad, g_out, acc):
    """Weight gradient G[kh, kw, c, o] = sum_{n,y,x} eq[n,y,x,o] * a[n, iy, ix, c].

    g_out: [K, K, C, O] int32 or int64 (the caller picks a width that cannot overflow);
    acc: scratch of O elements of g_out's dtype. One output row (n, y) is accumulated
    per weight row in ``acc`` before it is added to G (G traffic / Wo); zero activations
    are skipped.
    """
    k = g_out.shape[0]
    c_in = g_out.shape[2]
    n_out = g_out.shape[3]
    g2 = g_out.reshape(-1, n_out)
    h_in = a.shape[1]
    w_in = a.shape[2]
    w_out = eq.shape[2]
    g_out[...] = 0
    for n in range(eq.shape[0]):
        for y in range(eq.shape[1]):
            for kh in range(k):
                iy = y * stride + kh - pad
                if iy < 0 or iy >= h_in:
                    continue
                for kw in range(k):
                    r0 = (kh * k + kw) * c_in
                    for c in range(c_in):
                        for o in range(n_out):
                            acc[o] = 0
                        hit = False
                        for x in range(w_out):
                            ix = x * stride + kw - pad
                            if ix < 0 or ix >= w_in:
                                continue
                            v = np.int64(a[n, iy, ix, c])
                            if v == 0:
                                continue
                            hit = True
                            for o in range(n_out):
                                acc[o] += v * eq[n, y, x, o]
                        if hit:
                            for o in range(n_out):
                                g2[r0 + c, o] += acc[o]


@njit(cache=True)
def conv_weight_grad_dot(eq, a, stride, pad, g_out, col_t, e_t, have_cols):
    """Same result as :func:`conv_weight_grad` for an int32 ``g_out`` [K, K, C, O], as
    dot products over the output pixels of a group of samples (they vectorize well).

    col_t: scratch [K*K*C, G*Ho*Wo] (dtype of ``a``); e_t: scratch [O, G*Ho*Wo] (dtype of
    eq); G = col_t.shape[1] // (Ho*Wo) samples are processed together. ``have_cols``:
    col_t already holds the im2col of all samples (left there by conv_forward_col).
    """
    k = g_out.shape[0]
    n_out = g_out.shape[3]
    g2 = g_out.reshape(-1, n_out)
    r_len = g2.shape[0]
    h_out = eq.shape[1]
    w_out = eq.shape[2]
    n_pix = h_out * w_out
    group = max(1, col_t.shape[1] // n_pix)
    g_out[...] = 0
    n_total = eq.shape[0]
    for n0 in range(0, n_total, group):
        n1 = min(n_total, n0 + group)
        cols = (n1 - n0) * n_pix
        if not (have_cols and group >= n_total):
            _im2col_t(a, n0, n1, h_out, w_out, k, stride, pad, col_t)
        for n in range(n0, n1):
            for y in range(h_out):
                for x in range(w_out):
                    p = (n - n0) * n_pix + y * w_out + x
                    for o in range(n_out):
                        e_t[o, p] = eq[n, y, x, o]
        _dots_rows(col_t, e_t, cols, g2, r_len, n_out)


@njit(cache=True)
def conv_weight_grad_plane(eq, a, k, pad, g_out, plane, col_t, e_t, have_plane):
    """Same result as :func:`conv_weight_grad` for stride 1 and an int32 ``g_out``
    [K, K, C, O], as dot products over output positions.

    plane: [C, >= pad*wp + pad + N*hs] (left there by :func:`conv_forward_plane` when
    ``have_plane``, else rebuilt from ``a``); col_t: scratch [K*K*C, G*Ho*wp] that
    receives, for G samples at a time, for every weight index r and sample one contiguous
    run of Ho*wp plane positions (a copy, no gather); e_t: scratch [O, G*Ho*wp] (dtype of
    eq), the errors at the same positions, zero at the wp - Wo columns that are not
    output pixels.
    """
    c_in = g_out.shape[2]
    n_out = g_out.shape[3]
    g2 = g_out.reshape(-1, n_out)
    r_len = g2.shape[0]
    n_s = eq.shape[0]
    h_out = eq.shape[1]
    w_out = eq.shape[2]
    h_in = a.shape[1]
    w_in = a.shape[2]
    wp = w_in + pad
    hs = (h_in + pad) * wp
    seg = h_out * wp
    group = max(1, col_t.shape[1] // seg)
    if not have_plane:
        _to_plane(a, pad, plane)
    g_out[...] = 0
    for n0 in range(0, n_s, group):
        n1 = min(n_s, n0 + group)
        for kh in range(k):
            for kw in range(k):
                off = kh * wp + kw
                for c in range(c_in):
                    row = col_t[(kh * k + kw) * c_in + c]
                    for n in range(n0, n1):
                        src = plane[c, n * hs + off:n * hs + off + seg]
                        dst = row[(n - n0) * seg:(n - n0) * seg + seg]
                        for j in range(seg):
                            dst[j] = src[j]
        for n in range(n0, n1):
            for y in range(h_out):
                p = (n - n0) * seg + y * wp
                for x in range(w_out):
                    for o in range(n_out):
                        e_t[o, p + x] = eq[n, y, x, o]
                for o in range(n_out):
                    for x in range(w_out, wp):
                        e_t[o, p + x] = 0
        _dots_rows(col_t, e_t, (n1 - n0) * seg, g2, r_len, n_out)


@njit(cache=True)
def conv_weight_grad_sparse(eq, a, stride, pad, g_out, a_pad, gt):
    """Same result as :func:`conv_weight_grad`, driven by the non-zero errors (after ReLU
    masking and max-pool routing most are zero).

    For output channel o, every non-zero eq[n, y, x, o] adds eq * patch to row o of
    gt [O, K*K*C] (scratch of g_out's dtype, one row stays in L1): the patch is K rows of
    K*C contiguous values of a_pad [N, H+2p, W+2p, C] (scratch of a's dtype, the input
    with zero borders), two non-zero errors per pass. g_out [K, K, C, O] = gt transposed.
    """
    k = g_out.shape[0]
    c_in = g_out.shape[2]
    n_out = g_out.shape[3]
    g2 = g_out.reshape(-1, n_out)
    r_len = g2.shape[0]
    n_s = eq.shape[0]
    h_out = eq.shape[1]
    w_out = eq.shape[2]
    hp = a_pad.shape[1]
    wpp = a_pad.shape[2]
    kc = k * c_in
    rowstep = wpp * c_in
    _pad_nhwc(a, pad, a_pad)
    apf = a_pad.reshape(-1)
    e2d = eq.reshape(-1, n_out)
    gt[...] = 0
    for o in range(n_out):
        gro = gt[o]
        have = False
        e1 = np.int32(0)
        b1 = 0
        p = 0
        for n in range(n_s):
            for y in range(h_out):
                for x in range(w_out):
                    e = np.int32(e2d[p, o])
                    p += 1
                    if e == 0:
                        continue
                    base = ((n * hp + y * stride) * wpp + x * stride) * c_in
                    if not have:
                        e1 = e
                        b1 = base
                        have = True
                        continue
                    have = False
                    for kh in range(k):
                        s1 = apf[b1 + kh * rowstep:b1 + kh * rowstep + kc]
                        s2 = apf[base + kh * rowstep:base + kh * rowstep + kc]
                        dst = gro[kh * kc:kh * kc + kc]
                        for j in range(kc):
                            dst[j] = dst[j] + e1 * s1[j] + e * s2[j]
        if have:
            for kh in range(k):
                s1 = apf[b1 + kh * rowstep:b1 + kh * rowstep + kc]
                dst = gro[kh * kc:kh * kc + kc]
                for j in range(kc):
                    dst[j] = dst[j] + e1 * s1[j]
    for r in range(r_len):
        for o in range(n_out):
            g2[r, o] = gt[o, r]
