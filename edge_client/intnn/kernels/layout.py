"""Layout conversions between the spec's tensors and the kernels' buffers.

Activations and errors are NHWC (``[N, H, W, C]``) or ``[N, F]``; conv weights, their
ternary copies and gradients ``[K, K, C, O]`` (the innermost loops run over contiguous
output channels), backward-data's ternary copy ``[O, K, K, C]`` (:func:`transpose_kkco_okkc`).
The spec's ``[O, C, K, K]`` is only used at the engine's boundary (the layers' ``to_spec``).
:func:`ternarize` (``|w| > thr``), :func:`ternary_lists` (a stride-1 conv's +1 and -1
weights per output channel), ``_im2col_t``, ``_to_plane`` (the padded planar layout of
stride-1 convs), ``_pad_nhwc``, ``_transpose_fours`` (a linear layer's input, four samples
a word), :func:`quantize_inputs_nhwc` (NCHW integers into NHWC).
"""

from __future__ import annotations

import numpy as np
from numba import njit

U = np.uint64


@njit(cache=True, nogil=True, inline="always")
def _im2col_t(a, n0, n1, h_out, w_out, k, stride, pad, col_t):
    """col_t[(kh*k + kw)*C + c, (n - n0)*Ho*Wo + y*Wo + x] = a[n, iy, ix, c] (0 if padded)."""
    h_in = a.shape[1]
    w_in = a.shape[2]
    c_in = a.shape[3]
    n_pix = h_out * w_out
    for n in range(n0, n1):
        for y in range(h_out):
            for x in range(w_out):
                p = (n - n0) * n_pix + y * w_out + x
                for kh in range(k):
                    iy = y * stride + kh - pad
                    for kw in range(k):
                        ix = x * stride + kw - pad
                        r0 = (kh * k + kw) * c_in
                        if iy >= 0 and iy < h_in and ix >= 0 and ix < w_in:
                            for c in range(c_in):
                                col_t[r0 + c, p] = a[n, iy, ix, c]
                        else:
                            for c in range(c_in):
                                col_t[r0 + c, p] = 0


@njit(cache=True, nogil=True)
def ternary_lists(t_o, lst, cnt):
    """Per output channel o: lst[o, :cnt[o, 1]] = the flat indices r of the non-zero
    ternary weights t_o[o] ([O, K, K, C] flattened per o), the +1 weights first
    (cnt[o, 0] of them), then the -1 weights. lst: int32 [O, K*K*C + 1] (the last column
    is slack: the compaction is branch-free, every index is written and only the kept
    ones advance); cnt: int32 [O, 2]."""
    n_out = t_o.shape[0]
    t2 = t_o.reshape(n_out, -1)
    r_len = t2.shape[1]
    for o in range(n_out):
        m = 0
        for r in range(r_len):
            lst[o, m] = r
            m += np.int64(t2[o, r] > 0)
        cnt[o, 0] = m
        for r in range(r_len):
            lst[o, m] = r
            m += np.int64(t2[o, r] < 0)
        cnt[o, 1] = m


@njit(cache=True, nogil=True)
def ternary_copies(t, tb, lst, cnt, want_lists):
    """The derived copies of conv ternary weights t [K, K, C, O]: tb [O, K, K, C] (the
    backward-data layout) and, when ``want_lists``, :func:`ternary_lists` of tb."""
    transpose_kkco_okkc(t, tb)
    if want_lists:
        ternary_lists(tb, lst, cnt)


@njit(cache=True, nogil=True, inline="always")
def _to_plane(a, pad, plane, n0, n1):
    """plane[c, s0 + n*hs + iy*wp + ix] = a[n, iy, ix, c] for samples n0 <= n < n1, their
    gaps zeroed (and the leading s0 = pad*wp + pad zeros when n0 == 0); wp = W + pad,
    hs = (H + pad) * wp: one zero column / row of each pair of neighbours is shared. A
    channel at a time (contiguous writes)."""
    h_in = a.shape[1]
    w_in = a.shape[2]
    c_in = a.shape[3]
    wp = w_in + pad
    hs = (h_in + pad) * wp
    s0 = pad * wp + pad
    af = a.reshape(-1)
    for c in range(c_in):
        pc = plane[c]
        if n0 == 0:
            for i in range(s0):
                pc[i] = 0
        for n in range(n0, n1):
            for iy in range(h_in):
                base = s0 + n * hs + iy * wp
                src = ((n * h_in + iy) * w_in) * c_in + c
                for ix in range(w_in):
                    pc[U(base + ix)] = af[U(src + ix * c_in)]
                for ix in range(w_in, wp):
                    pc[U(base + ix)] = 0
            for iy in range(h_in, h_in + pad):
                base = s0 + n * hs + iy * wp
                for ix in range(wp):
                    pc[U(base + ix)] = 0


@njit(cache=True, nogil=True, inline="always")
def _pad_nhwc(a, pad, a_pad, n0, n1):
    """a_pad[n, pad + iy, pad + ix, c] = a[n, iy, ix, c], zero borders ([N, H+2p, W+2p, C]),
    samples n0 <= n < n1."""
    h_in = a.shape[1]
    w_in = a.shape[2]
    c_in = a.shape[3]
    hp = a_pad.shape[1]
    wpp = a_pad.shape[2]
    af = a.reshape(-1)
    pf = a_pad.reshape(-1)
    row = wpp * c_in
    for n in range(n0, n1):
        for iy in range(hp):
            b = (n * hp + iy) * row
            yy = iy - pad
            if yy < 0 or yy >= h_in:
                for j in range(row):
                    pf[U(b + j)] = 0
                continue
            for j in range(pad * c_in):
                pf[U(b + j)] = 0
            src = (n * h_in + yy) * w_in * c_in
            d = b + pad * c_in
            for j in range(w_in * c_in):
                pf[U(d + j)] = af[U(src + j)]
            for j in range((pad + w_in) * c_in, row):
                pf[U(b + j)] = 0


@njit(cache=True, nogil=True, inline="always")
def transpose_kkco_okkc(t, out):
    """Ternary conv weights [K, K, C, O] -> [O, K, K, C] (the backward-data layout)."""
    for kh in range(t.shape[0]):
        for kw in range(t.shape[1]):
            for c in range(t.shape[2]):
                for o in range(t.shape[3]):
                    out[o, kh, kw, c] = t[kh, kw, c, o]


@njit(cache=True, nogil=True)
def ternarize(w, thr, t):
    """t = +1 where w > thr, -1 where w < -thr, 0 elsewhere (flat)."""
    for j in range(w.shape[0]):
        v = w[j]
        if v > thr:
            t[j] = 1
        elif v < -thr:
            t[j] = -1
        else:
            t[j] = 0


@njit(cache=True, nogil=True)
def quantize_inputs_nhwc(xq, out):
    """Copy NCHW integers into the NHWC activation layout (data loading, integers)."""
    for n in range(xq.shape[0]):
        for c in range(xq.shape[1]):
            for h in range(xq.shape[2]):
                for w in range(xq.shape[3]):
                    out[n, h, w, c] = xq[n, c, h, w]


@njit(cache=True, nogil=True, inline="always")
def _transpose_fours(a, a_t, f0, f1):
    """a_t[f, :N4] = a[:, f] (zero past N) for f0 <= f < f1, four samples a 32-bit word:
    each word from four rows of a read along f (a [N, F] int8, a_t [F, L] int8 with L a
    multiple of 4); reading a byte at a time down a's columns is several times slower
    (docs/performance.md#several-cores)."""
    n_s = a.shape[0]
    n_f = a.shape[1]
    af = a.reshape(-1).view(np.uint8)
    atw = a_t.reshape(-1).view(np.uint32)
    lw = a_t.shape[1] // 4
    for k in range((n_s + 3) // 4):
        n = 4 * k
        last = n_s - 1
        r0, r1, r2, r3 = (n * n_f, min(n + 1, last) * n_f, min(n + 2, last) * n_f,
                          min(n + 3, last) * n_f)
        m1 = np.uint32(0xFF) if n + 1 < n_s else np.uint32(0)
        m2 = np.uint32(0xFF) if n + 2 < n_s else np.uint32(0)
        m3 = np.uint32(0xFF) if n + 3 < n_s else np.uint32(0)
        for f in range(f0, f1):
            atw[U(f * lw + k)] = (np.uint32(af[U(r0 + f)])
                                  | ((np.uint32(af[U(r1 + f)]) & m1) << np.uint32(8))
                                  | ((np.uint32(af[U(r2 + f)]) & m2) << np.uint32(16))
                                  | ((np.uint32(af[U(r3 + f)]) & m3) << np.uint32(24)))
