"""Convolution backward: the error at the layer's input and the weight gradient.

Backward-data (through the ternary weights' ``[O, K, K, C]`` copy) sums per pixel in
int16 when ``O * amax`` fits (:func:`conv_backward_data_narrow`), else in int32
(:func:`conv_backward_data`). The error-driven kernels list the non-zero errors
branch-free first (a branch per error would be mispredicted at 5-20% density) and index
flat arrays with unsigned offsets, so the runs over K*C values vectorize.

Weight gradient ``G = sum_batch e_q (x) a`` (the conv layer's ``choose_grad`` picks one):
:func:`conv_weight_grad` (``"int64"``: when ``amax^2 * batch * pixels`` may exceed int32),
:func:`conv_weight_grad_sparse` (``"sparse"``: driven by the non-zero errors, when a
patch row's K*C values are enough to vectorize), :func:`conv_weight_grad_plane`
(``"plane"``: dot products over the stride-1 plane's positions, :func:`eq_to_planar`),
:func:`conv_weight_grad_dot` (``"dot"``: over pixels of the transposed im2col).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from edge_client.intnn.kernels.arith import _dots_rows
from edge_client.intnn.kernels.layout import _im2col_t, _pad_nhwc

U = np.uint64


@njit(cache=True, nogil=True)
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


@njit(cache=True, nogil=True)
def conv_backward_data_narrow(eq, t, stride, pad, out, pbuf16, oi, ov, n0, n1):
    """Same result as :func:`conv_backward_data` when ``O * max|eq| <= 32767``: the
    per-pixel sum over output channels sum_o eq * t[o] is then exact in int16 (32 lanes
    per vector instead of 16). Per pixel the non-zero errors are listed (branch-free;
    oi/ov: int32 scratch [>= O + 4]) and combined four rows of t at a time; the sum is
    added to ``out`` one run of K*C (fewer at the borders) contiguous values per kernel
    row.

    eq: [N, Ho, Wo, O]; t: [O, K, K, C]; out: [N, H, W, C] int32; pbuf16: int16 [K*K*C].
    Samples n0 <= n < n1 only (out[n0:n1] is zeroed first).
    """
    k = t.shape[1]
    c_in = t.shape[3]
    h_in = out.shape[1]
    w_in = out.shape[2]
    n_out = t.shape[0]
    r_len = k * k * c_in
    kc = k * c_in
    h_out = eq.shape[1]
    w_out = eq.shape[2]
    tf = t.reshape(-1)
    ef = eq.reshape(-1)
    of = out.reshape(-1)
    out[n0:n1] = 0
    p = n0 * h_out * w_out
    for n in range(n0, n1):
        for y in range(h_out):
            for x in range(w_out):
                cnt = _nonzero_channels(ef, p * n_out, n_out, r_len, oi, ov)
                p += 1
                if cnt == 0:
                    continue
                for j in range(0, cnt, 4):
                    g1 = np.int16(ov[j])
                    g2 = np.int16(ov[j + 1])
                    g3 = np.int16(ov[j + 2])
                    g4 = np.int16(ov[j + 3])
                    r1 = oi[j]
                    r2 = oi[j + 1]
                    r3 = oi[j + 2]
                    r4 = oi[j + 3]
                    if j == 0:
                        for r in range(r_len):
                            pbuf16[U(r)] = np.int16(
                                g1 * np.int16(tf[U(r1 + r)]) + g2 * np.int16(tf[U(r2 + r)])
                                + g3 * np.int16(tf[U(r3 + r)]) + g4 * np.int16(tf[U(r4 + r)]))
                    else:
                        for r in range(r_len):
                            pbuf16[U(r)] = np.int16(
                                pbuf16[U(r)] + g1 * np.int16(tf[U(r1 + r)])
                                + g2 * np.int16(tf[U(r2 + r)]) + g3 * np.int16(tf[U(r3 + r)])
                                + g4 * np.int16(tf[U(r4 + r)]))
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
                    d0 = ((n * h_in + iy) * w_in + ix0 + kw_lo) * c_in
                    r0 = kh * kc + kw_lo * c_in
                    for j in range(ln):
                        of[U(d0 + j)] = of[U(d0 + j)] + pbuf16[U(r0 + j)]


@njit(cache=True, nogil=True, inline="always")
def _nonzero_channels(ef, b, n_out, r_len, oi, ov):
    """The non-zero errors of one pixel (ef[b:b + O]) as (row offset o * r_len, value),
    branch-free, padded with zero terms to a multiple of 4; returns their number."""
    cnt = 0
    for o in range(n_out):
        g = ef[U(b + o)]
        oi[cnt] = o * r_len
        ov[cnt] = g
        cnt += np.int64(g != 0)
    if cnt == 0:
        return 0
    while cnt & 3:
        oi[cnt] = 0
        ov[cnt] = 0
        cnt += 1
    return cnt


@njit(cache=True, nogil=True)
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


@njit(cache=True, nogil=True)
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


@njit(cache=True, nogil=True)
def eq_to_planar(eq, wp, hs, eqp, n0, n1):
    """eqp[o, n*hs + y*wp + x] = eq[n, y, x, o] (NHWC errors -> the positions of the
    stride-1 plane layout, zero at the positions that are not output pixels), samples
    n0 <= n < n1."""
    h_out = eq.shape[1]
    w_out = eq.shape[2]
    n_out = eq.shape[3]
    ef = eq.reshape(-1)
    for o in range(n_out):
        row = eqp[o]
        for i in range(n0 * hs, min(n1 * hs, row.shape[0])):
            row[U(i)] = 0
        for n in range(n0, n1):
            for y in range(h_out):
                b = n * hs + y * wp
                src = ((n * h_out + y) * w_out) * n_out + o
                for x in range(w_out):
                    row[U(b + x)] = ef[U(src + x * n_out)]


@njit(cache=True, nogil=True)
def conv_weight_grad_plane(eqp, plane, offs, n_pos, g_out, r0, r1):
    """Same result as :func:`conv_weight_grad` for stride 1 and an int32 ``g_out``
    [K, K, C, O], as int32 dot products over the positions of the padded plane layout,
    for the weight rows r0 <= r < r1 (r = (kh*K + kw)*C + c). Returns their max |G|.

    eqp: [O, >= n_pos] the quantized errors at the plane positions (zero where no output
    pixel: :func:`eq_to_planar` or the pool's routing writes it); plane / offs: the
    input plane and run offsets :func:`conv_forward_plane` left; n_pos = (N-1)*hs +
    (Ho-1)*wp + Wo. G[r, o] = sum_q plane[offs[r] + q] * eqp[o, q]: two weight rows x
    four output channels per pass over the positions (no copy of the plane).
    """
    n_out = g_out.shape[3]
    g2 = g_out.reshape(-1, n_out)
    pf = plane.reshape(-1)
    ef = eqp.reshape(-1)
    le = eqp.shape[1]
    o = 0
    while o + 4 <= n_out:
        e0 = U(o * le)
        e1 = U((o + 1) * le)
        e2 = U((o + 2) * le)
        e3 = U((o + 3) * le)
        r = r0
        while r < r1:
            pa = U(offs[r])
            pb = U(offs[r + 1]) if r + 1 < r1 else pa
            a0 = np.int32(0)
            a1 = np.int32(0)
            a2 = np.int32(0)
            a3 = np.int32(0)
            b0 = np.int32(0)
            b1 = np.int32(0)
            b2 = np.int32(0)
            b3 = np.int32(0)
            for q in range(n_pos):
                qu = U(q)
                u = np.int32(pf[pa + qu])
                v = np.int32(pf[pb + qu])
                x0 = np.int32(ef[e0 + qu])
                x1 = np.int32(ef[e1 + qu])
                x2 = np.int32(ef[e2 + qu])
                x3 = np.int32(ef[e3 + qu])
                a0 = np.int32(a0 + u * x0)
                a1 = np.int32(a1 + u * x1)
                a2 = np.int32(a2 + u * x2)
                a3 = np.int32(a3 + u * x3)
                b0 = np.int32(b0 + v * x0)
                b1 = np.int32(b1 + v * x1)
                b2 = np.int32(b2 + v * x2)
                b3 = np.int32(b3 + v * x3)
            g2[r, o] = a0
            g2[r, o + 1] = a1
            g2[r, o + 2] = a2
            g2[r, o + 3] = a3
            if r + 1 < r1:
                g2[r + 1, o] = b0
                g2[r + 1, o + 1] = b1
                g2[r + 1, o + 2] = b2
                g2[r + 1, o + 3] = b3
            r += 2
        o += 4
    while o < n_out:
        e0 = U(o * le)
        for r in range(r0, r1):
            pa = U(offs[r])
            a0 = np.int32(0)
            for q in range(n_pos):
                a0 = np.int32(a0 + np.int32(pf[pa + U(q)]) * np.int32(ef[e0 + U(q)]))
            g2[r, o] = a0
        o += 1
    gmax = np.int64(0)
    for r in range(r0, r1):
        for oo in range(n_out):
            v = np.int64(g2[r, oo])
            v = -v if v < 0 else v
            gmax = v if v > gmax else gmax
    return gmax


@njit(cache=True, nogil=True)
def pad_nhwc(a, pad, a_pad, n0, n1):
    """a_pad[n, pad + iy, pad + ix, c] = a[n, iy, ix, c] with zero borders, samples
    n0 <= n < n1 (the input of :func:`conv_weight_grad_sparse`)."""
    _pad_nhwc(a, pad, a_pad, n0, n1)


@njit(cache=True, nogil=True, inline="always")
def _list_errors(ef, o, n_out, n_s, h_out, w_out, hp, rowstep, stride, c_in, pi, pv):
    """The non-zero errors of output channel o (ef: eq flat, NHWC) as (offset of the
    pixel's patch in the padded input, value) in pi/pv, branch-free, padded with zero terms
    to a multiple of 4; returns (their number, the sum of all of o's errors)."""
    cnt = 0
    p = 0
    esum = np.int64(0)
    for n in range(n_s):
        for y in range(h_out):
            rb = (n * hp + y * stride) * rowstep
            for x in range(w_out):
                e = ef[U(p * n_out + o)]
                p += 1
                pi[cnt] = rb + x * stride * c_in
                pv[cnt] = e
                esum += e
                cnt += np.int64(e != 0)
    while cnt & 3:
        pi[cnt] = 0
        pv[cnt] = 0
        cnt += 1
    return cnt, esum


@njit(cache=True, nogil=True, inline="always")
def _add_four_patches(gf, d, apf, s1, s2, s3, s4, e1, e2, e3, e4, j0, j1):
    """gf[d + j] += e1*apf[s1 + j] + e2*apf[s2 + j] + e3*apf[s3 + j] + e4*apf[s4 + j] for
    j0 <= j < j1, in int32 (the caller's bound keeps the sums in range)."""
    for jj in range(j0, j1):
        gf[U(d + jj)] = np.int32(
            gf[U(d + jj)] + np.int32(e1) * np.int32(apf[U(s1 + jj)])
            + np.int32(e2) * np.int32(apf[U(s2 + jj)])
            + np.int32(e3) * np.int32(apf[U(s3 + jj)])
            + np.int32(e4) * np.int32(apf[U(s4 + jj)]))


@njit(cache=True, nogil=True, inline="always")
def _gt_out(gt, g2, o0, o1):
    """g2 [K*K*C, O] columns o0..o1 = gt [O, K*K*C] transposed; returns their max |G|."""
    gmax = np.int64(0)
    for r in range(g2.shape[0]):
        for o in range(o0, o1):
            v = np.int64(gt[o, r])
            g2[r, o] = v
            v = -v if v < 0 else v
            gmax = v if v > gmax else gmax
    return gmax


@njit(cache=True, nogil=True)
def conv_weight_grad_sparse(eq, a_pad, stride, g_out, gt, pi, pv, o0, o1):
    """Same result as :func:`conv_weight_grad`, driven by the non-zero errors (after ReLU
    masking and max-pool routing most are zero), for output channels o0 <= o < o1.
    Returns their max |G| (int64).

    For output channel o, the non-zero eq[n, y, x, o] are listed (branch-free; pi/pv:
    int32 scratch [>= N*Ho*Wo + 4]), then each adds eq * patch to row o of gt
    [O, K*K*C] (scratch of g_out's dtype, one row stays in L1), four errors per pass: the
    patch is K rows of K*C contiguous values of a_pad [N, H+2p, W+2p, C] (:func:`pad_nhwc`
    of the input). g_out [K, K, C, O] = gt transposed (columns o0..o1 written here).
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
    apf = a_pad.reshape(-1)
    ef = eq.reshape(-1)
    gf = gt.reshape(-1)
    for o in range(o0, o1):
        go = o * r_len
        for r in range(r_len):
            gf[U(go + r)] = 0
        cnt, _ = _list_errors(ef, o, n_out, n_s, h_out, w_out, hp, rowstep, stride, c_in, pi, pv)
        for j in range(0, cnt, 4):
            e1 = np.int64(pv[j])
            e2 = np.int64(pv[j + 1])
            e3 = np.int64(pv[j + 2])
            e4 = np.int64(pv[j + 3])
            for kh in range(k):
                s1 = pi[j] + kh * rowstep
                s2 = pi[j + 1] + kh * rowstep
                s3 = pi[j + 2] + kh * rowstep
                s4 = pi[j + 3] + kh * rowstep
                d = go + kh * kc
                if gt.itemsize <= 4:
                    _add_four_patches(gf, d, apf, s1, s2, s3, s4, e1, e2, e3, e4, 0, kc)
                else:
                    for jj in range(kc):
                        gf[U(d + jj)] = (gf[U(d + jj)] + e1 * np.int64(apf[U(s1 + jj)])
                                         + e2 * np.int64(apf[U(s2 + jj)])
                                         + e3 * np.int64(apf[U(s3 + jj)])
                                         + e4 * np.int64(apf[U(s4 + jj)]))
    return _gt_out(gt, g2, o0, o1)
