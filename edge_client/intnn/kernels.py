"""Numba kernels of the integer-only training step (ProWD appendix B / WAGE).

Every kernel here takes and returns integers (or booleans) only; no float value exists
in any of them (``tests/test_intnn_kernels.py`` inspects the compiled type maps).

Layout: activations and errors are NHWC (``[N, H, W, C]``) or ``[N, F]``; convolution
weights, their ternary copies and gradients are kept as ``[K, K, C, O]`` so that the
innermost loops run over contiguous output channels (they vectorize); backward-data uses
a second ternary copy in ``[O, K, K, C]``. The spec's ``[O, C, K, K]`` layout is only
used at the module boundary (``model.py``).

Integer widths: activations and quantized errors are ``int8`` (s <= 8) or ``int16``;
ternary weights ``int8``; stored weights ``int8``/``int16``; raw (pre-quantization)
errors and forward accumulators ``int32``; weight gradients ``int32`` when the bound
``amax^2 * pixels`` fits, else ``int64``.

Convolution forward comes in three bit-identical variants: :func:`conv_forward_plane`
(the default for stride 1: the input in a padded planar layout that fits in L2, and per
output channel lists of its +1 and -1 weights; each list entry adds or subtracts a
contiguous run of the plane to a block of output positions, int16 partial sums for
s <= 8, no im2col), :func:`conv_forward_col` (other strides: a transposed im2col of the
batch, then each non-zero ternary weight adds or subtracts a whole block of pixels; the
im2col is kept for the weight gradient) and :func:`conv_forward` (per output pixel, the
non-zero inputs are compacted and accumulated over contiguous output channels; it wins
when inputs are very sparse). The weight gradient is driven by the non-zero errors
(:func:`conv_weight_grad_sparse`: after ReLU masking and max-pool routing 5-20% of them
are non-zero; used when the K*C values of a patch row are enough to vectorize), a dot
product over pixels (:func:`conv_weight_grad_plane` from runs of the stride-1 plane, or
:func:`conv_weight_grad_dot` from the im2col, int32) or a row-blocked accumulation
(:func:`conv_weight_grad`, any width, int64 for s > 8).
Backward-data sums per pixel in int16 when O * amax fits
(:func:`conv_backward_data_narrow`), else in int32 (:func:`conv_backward_data`).

Rounding: ``round_shift(v, k)`` divides by ``2^k`` rounding half away from zero
(``k > 0``), multiplies by ``2^-k`` (``k < 0``), and is the identity for ``k == 0``.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

# floor(2^(b + 1/2)) for b = 0..62: m > 2^(b+1/2)  <=>  m > LOG2_HALF_THRESH[b] (integers).
LOG2_HALF_THRESH = np.array([math.isqrt(1 << (2 * b + 1)) for b in range(63)], dtype=np.int64)

# SplitMix64 constants as two's-complement int64.
_GOLDEN = np.int64(0x9E3779B97F4A7C15 - (1 << 64))
_MIX1 = np.int64(0xBF58476D1CE4E5B9 - (1 << 64))
_MIX2 = np.int64(0x94D049BB133111EB - (1 << 64))
_MASK62 = np.int64((1 << 62) - 1)


# --------------------------------------------------------------------------- scalars


@njit(cache=True, inline="always")
def round_shift(v: int, k: int) -> int:
    """``v / 2^k`` rounded half away from zero (k > 0), ``v * 2^-k`` (k <= 0)."""
    if k > 0:
        half = np.int64(1) << (k - 1)
        if v >= 0:
            return (v + half) >> k
        return -((half - v) >> k)
    if k < 0:
        return v << (-k)
    return v


@njit(cache=True, inline="always")
def round_log2(m: int) -> int:
    """``round(log2 m)`` for an integer ``m >= 1``, exactly (no float)."""
    b = 0
    while (m >> (b + 1)) > 0:
        b += 1
    if m > LOG2_HALF_THRESH[b]:
        return b + 1
    return b


@njit(cache=True, inline="always")
def _lsr(z: int, k: int) -> int:
    """Logical right shift of a 64-bit pattern held in an int64 (0 < k < 64)."""
    return (z >> k) & ((np.int64(1) << (64 - k)) - 1)


@njit(cache=True, inline="always")
def mix64(z: int) -> int:
    """SplitMix64 finalizer on an int64 bit pattern (wrapping arithmetic)."""
    z = (z ^ _lsr(z, 30)) * _MIX1
    z = (z ^ _lsr(z, 27)) * _MIX2
    return z ^ _lsr(z, 31)


@njit(cache=True, inline="always")
def rand62(key: int, j: int) -> int:
    """The ``j``-th 62-bit random integer of the counter-based stream ``key``."""
    return (mix64(key + (j + 1) * _GOLDEN) >> 2) & _MASK62


@njit(cache=True)
def stream_key(seed: int, step: int, layer: int, stream: int) -> int:
    """Key of the random stream for (device seed, step counter, layer, stream id)."""
    z = mix64(seed * _GOLDEN + 0x1234567)
    z = mix64(z ^ (step * 1048583 + layer * 131 + stream))
    return z


@njit(cache=True, inline="always")
def _stoch_round_shift(v: int, sh: int, key: int, j: int) -> int:
    """``v / 2^sh`` stochastically rounded: sign(v)(floor|.| + Bernoulli(frac|.|))."""
    if sh <= 0:
        return v << (-sh)
    av = -v if v < 0 else v
    if sh > 62:  # only the 62 leading fraction bits take part in the draw
        av = av >> (sh - 62)
        sh = 62
    fl = av >> sh
    fr = av - (fl << sh)
    if fr > 0 and (rand62(key, j) >> (62 - sh)) < fr:
        fl += 1
    return -fl if v < 0 else fl


# --------------------------------------------------------------------------- forward


@njit(cache=True, inline="always")
def _finish(acc: int, shift: int, amax: int, relu: bool) -> int:
    v = round_shift(acc, shift)
    if relu and v < 0:
        v = 0
    if v > amax:
        v = amax
    elif v < -amax:
        v = -amax
    return v


@njit(cache=True)
def conv_forward(a, t, stride, pad, shift, amax, relu, out, acc):
    """Fused direct conv: ternary accumulate + rounding shift + clip (+ ReLU).

    a: [N, H, W, C] activations; t: [K, K, C, O] int8 in {-1, 0, 1};
    out: [N, Ho, Wo, O] = ``clip(round_shift(sum t*a, shift), +-amax)`` (ReLU'd if relu);
    acc: int32 scratch of O elements. The non-zero channels of every input pixel are first
    compacted (branch-free, once per sample: ReLU zeros and padded cells then cost
    nothing); each is accumulated over the O contiguous output channels (vectorized).
    """
    k = t.shape[0]
    c_in = t.shape[2]
    n_out = t.shape[3]
    t2 = t.reshape(-1, n_out)
    h_in = a.shape[1]
    w_in = a.shape[2]
    nz_c = np.empty((h_in * w_in, c_in), np.int32)
    nz_v = np.empty((h_in * w_in, c_in), np.int32)
    nz_n = np.empty(h_in * w_in, np.int32)
    lr = np.empty(k * k * c_in + 4, np.int32)
    lv = np.empty(k * k * c_in + 4, np.int32)
    for n in range(out.shape[0]):
        for iy in range(h_in):
            for ix in range(w_in):
                pix = iy * w_in + ix
                cnt = 0
                for c in range(c_in):
                    v = np.int32(a[n, iy, ix, c])
                    nz_c[pix, cnt] = c
                    nz_v[pix, cnt] = v
                    cnt += np.int64(v != 0)
                nz_n[pix] = cnt
        for y in range(out.shape[1]):
            for x in range(out.shape[2]):
                cnt = 0
                for kh in range(k):
                    iy = y * stride + kh - pad
                    if iy < 0 or iy >= h_in:
                        continue
                    for kw in range(k):
                        ix = x * stride + kw - pad
                        if ix < 0 or ix >= w_in:
                            continue
                        pix = iy * w_in + ix
                        r0 = (kh * k + kw) * c_in
                        for j in range(nz_n[pix]):
                            lr[cnt] = r0 + nz_c[pix, j]
                            lv[cnt] = nz_v[pix, j]
                            cnt += 1
                while cnt % 4:  # pad with zero terms (row 0, value 0)
                    lr[cnt] = 0
                    lv[cnt] = 0
                    cnt += 1
                for o in range(n_out):
                    acc[o] = 0
                for j in range(0, cnt, 4):
                    v0 = lv[j]
                    v1 = lv[j + 1]
                    v2 = lv[j + 2]
                    v3 = lv[j + 3]
                    q0 = lr[j]
                    q1 = lr[j + 1]
                    q2 = lr[j + 2]
                    q3 = lr[j + 3]
                    for o in range(n_out):
                        acc[o] = np.int32(acc[o] + v0 * np.int32(t2[q0, o])
                                          + v1 * np.int32(t2[q1, o])
                                          + v2 * np.int32(t2[q2, o])
                                          + v3 * np.int32(t2[q3, o]))
                for o in range(n_out):
                    out[n, y, x, o] = _finish(acc[o], shift, amax, relu)


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
def maxpool_forward(a, k, stride, pad, out, idx, want_idx):
    """Max pool, NHWC; padded cells never win; ties go to the first cell in (kh, kw) order.

    When ``want_idx``, idx[n, y, x, c] receives the flat index (iy*W + ix)*C + c of the
    winner in sample n (for backward); otherwise idx is not touched (may be a dummy).
    The channel loops are branch-free (selects) so that they vectorize.
    """
    h_in = a.shape[1]
    w_in = a.shape[2]
    c_in = a.shape[3]
    for n in range(out.shape[0]):
        for y in range(out.shape[1]):
            for x in range(out.shape[2]):
                o_row = out[n, y, x]
                i_row = idx[n, y, x] if want_idx else idx[0, 0, 0]
                first = True
                for kh in range(k):
                    iy = y * stride + kh - pad
                    if iy < 0 or iy >= h_in:
                        continue
                    for kw in range(k):
                        ix = x * stride + kw - pad
                        if ix < 0 or ix >= w_in:
                            continue
                        b32 = np.int32((iy * w_in + ix) * c_in)
                        src = a[n, iy, ix]
                        if first:
                            for c in range(c_in):
                                o_row[c] = src[c]
                            if want_idx:
                                for c in range(c_in):
                                    i_row[c] = np.int32(b32 + np.int32(c))
                            first = False
                        elif want_idx:
                            for c in range(c_in):
                                v = src[c]
                                cur = o_row[c]
                                o_row[c] = max(v, cur)
                                i_row[c] = np.int32(b32 + np.int32(c)) if v > cur else i_row[c]
                        else:
                            for c in range(c_in):
                                o_row[c] = max(src[c], o_row[c])


@njit(cache=True)
def relu_forward(a, out):
    """Stand-alone ReLU on flat views (a ReLU right after a conv/linear is fused there)."""
    for i in range(a.shape[0]):
        v = a[i]
        out[i] = v if v > 0 else 0


# --------------------------------------------------------------------------- loss


@njit(cache=True)
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


@njit(cache=True)
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


@njit(cache=True)
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


# --------------------------------------------------------------------------- backward


@njit(cache=True)
def relu_mask(e, act):
    """Zero e (flat int32) where the layer's output activation is <= 0 (a select: it
    vectorizes)."""
    for i in range(e.shape[0]):
        e[i] = e[i] if act[i] > 0 else 0


@njit(cache=True, inline="always")
def max_abs(v):
    """max |v| over a flat integer array, as int64."""
    m = np.int64(0)
    for i in range(v.shape[0]):
        x = np.int64(v[i])
        if x < 0:
            x = -x
        if x > m:
            m = x
    return m


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


@njit(cache=True, inline="always")
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


@njit(cache=True, inline="always")
def _finish_row(acc, m, shift, amax, relu, tile, o):
    """tile[o, :m] = clip(round_shift(acc[:m], shift), +-amax) (ReLU'd if relu), written
    branch-free so that it vectorizes; same values as :func:`_finish`."""
    lo = 0 if relu else -amax
    if shift > 0:
        half = np.int64(1) << (shift - 1)
        for j in range(m):
            v = np.int64(acc[j])
            av = -v if v < 0 else v
            r = (av + half) >> shift
            v = -r if v < 0 else r
            v = amax if v > amax else v
            tile[o, j] = lo if v < lo else v
    else:
        for j in range(m):
            v = np.int64(acc[j]) << (-shift)
            v = amax if v > amax else v
            tile[o, j] = lo if v < lo else v


@njit(cache=True)
def conv_forward_col(a, t_o, stride, pad, shift, amax, relu, out, col_t, acc, acc16, tile):
    """Same result as :func:`conv_forward`, vectorized over output pixels instead.

    t_o: ternary weights [O, K, K, C]; col_t: scratch [K*K*C, G*Ho*Wo] (dtype of ``a``)
    that receives the im2col of G samples at a time (G = all of them when it is large
    enough: the weight gradient then reuses it); acc: int32 scratch and acc16 int16
    scratch (used when |activations| <= 127, i.e. s <= 8; else length 0) of a pixel block;
    tile: [O, block] scratch of out's dtype (finished values, stored pixel-major after).
    For every non-zero ternary weight, a block of pixels is added or subtracted (no
    multiplication), then rounding shift + clip (+ ReLU) write NHWC ``out``.
    """
    n_out = t_o.shape[0]
    k = t_o.shape[1]
    t2 = t_o.reshape(n_out, -1)
    r_len = t2.shape[1]
    h_out = out.shape[1]
    w_out = out.shape[2]
    n_pix = h_out * w_out
    group = max(1, col_t.shape[1] // n_pix)
    n_total = out.shape[0]
    block = acc.shape[0]
    narrow = amax <= 127 and acc16.shape[0] >= block
    out2 = out.reshape(-1, n_out)  # [N*Ho*Wo, O]: one row per output pixel
    for n0 in range(0, n_total, group):
        n1 = min(n_total, n0 + group)
        cols = (n1 - n0) * n_pix
        _im2col_t(a, n0, n1, h_out, w_out, k, stride, pad, col_t)
        for p0 in range(0, cols, block):
            m = min(cols, p0 + block) - p0
            for o in range(n_out):
                for j in range(m):
                    acc[j] = 0
                if narrow:
                    # int16 partial sums over <= 256 rows (|sum| <= 256 * 127 < 2^15): exact
                    for r_start in range(0, r_len, 256):
                        for j in range(m):
                            acc16[j] = 0
                        for r in range(r_start, min(r_len, r_start + 256)):
                            tv = t2[o, r]
                            row = col_t[r, p0:p0 + m]
                            if tv > 0:
                                for j in range(m):
                                    acc16[j] = np.int16(acc16[j] + np.int16(row[j]))
                            elif tv < 0:
                                for j in range(m):
                                    acc16[j] = np.int16(acc16[j] - np.int16(row[j]))
                        for j in range(m):
                            acc[j] = np.int32(acc[j] + np.int32(acc16[j]))
                else:
                    for r in range(r_len):
                        tv = t2[o, r]
                        row = col_t[r, p0:p0 + m]
                        if tv > 0:
                            for j in range(m):
                                acc[j] = np.int32(acc[j] + np.int32(row[j]))
                        elif tv < 0:
                            for j in range(m):
                                acc[j] = np.int32(acc[j] - np.int32(row[j]))
                _finish_row(acc, m, shift, amax, relu, tile, o)
            base = n0 * n_pix + p0
            for j in range(m):
                for o in range(n_out):
                    out2[base + j, o] = tile[o, j]


@njit(cache=True, inline="always")
def _dots_rows(col_t, e_t, cols, g2, r_len, n_out):
    """g2[r, o] += sum_{p < cols} col_t[r, p] * e_t[o, p] (int32), 2 rows x 4 outputs
    per pass."""
    o = 0
    while o + 4 <= n_out:
        r = 0
        while r + 2 <= r_len:
            a0 = np.int32(0)
            a1 = np.int32(0)
            a2 = np.int32(0)
            a3 = np.int32(0)
            b0 = np.int32(0)
            b1 = np.int32(0)
            b2 = np.int32(0)
            b3 = np.int32(0)
            for p in range(cols):
                u = np.int32(col_t[r, p])
                v = np.int32(col_t[r + 1, p])
                e0 = np.int32(e_t[o, p])
                e1 = np.int32(e_t[o + 1, p])
                e2 = np.int32(e_t[o + 2, p])
                e3 = np.int32(e_t[o + 3, p])
                a0 = np.int32(a0 + u * e0)
                a1 = np.int32(a1 + u * e1)
                a2 = np.int32(a2 + u * e2)
                a3 = np.int32(a3 + u * e3)
                b0 = np.int32(b0 + v * e0)
                b1 = np.int32(b1 + v * e1)
                b2 = np.int32(b2 + v * e2)
                b3 = np.int32(b3 + v * e3)
            g2[r, o] = np.int32(g2[r, o] + a0)
            g2[r, o + 1] = np.int32(g2[r, o + 1] + a1)
            g2[r, o + 2] = np.int32(g2[r, o + 2] + a2)
            g2[r, o + 3] = np.int32(g2[r, o + 3] + a3)
            g2[r + 1, o] = np.int32(g2[r + 1, o] + b0)
            g2[r + 1, o + 1] = np.int32(g2[r + 1, o + 1] + b1)
            g2[r + 1, o + 2] = np.int32(g2[r + 1, o + 2] + b2)
            g2[r + 1, o + 3] = np.int32(g2[r + 1, o + 3] + b3)
            r += 2
        while r < r_len:
            for oo in range(o, o + 4):
                a0 = np.int32(0)
                for p in range(cols):
                    a0 = np.int32(a0 + np.int32(col_t[r, p]) * np.int32(e_t[oo, p]))
                g2[r, oo] = np.int32(g2[r, oo] + a0)
            r += 1
        o += 4
    while o < n_out:
        for r in range(r_len):
            a0 = np.int32(0)
            for p in range(cols):
                a0 = np.int32(a0 + np.int32(col_t[r, p]) * np.int32(e_t[o, p]))
            g2[r, o] = np.int32(g2[r, o] + a0)
        o += 1


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


# --------------------------------------------------------------------------- stride-1 conv
#
# Padded planar layout ("plane") of a stride-1 convolution input: channel c of sample n,
# row iy, column ix is stored at plane[c, s0 + n*hs + iy*wp + ix] with wp = W + pad,
# hs = (H + pad) * wp and s0 = pad*wp + pad; the `pad` columns after every row and the
# `pad` rows after every sample are zeros and serve as the right/bottom padding of one
# row/sample and the left/top padding of the next. The output pixel (n, y, x) has the
# position q = n*hs + y*wp + x and reads its input (kh, kw, c) at plane[c, q + kh*wp + kw]:
# weight index r = (kh*k + kw)*C + c contributes a contiguous run of the plane to a
# contiguous run of output positions (positions with x >= Wo or y >= Ho are computed and
# discarded). The plane of a layer is small (it fits in L2), unlike an im2col.


@njit(cache=True)
def ternary_lists(t_o, lst, cnt):
    """Per output channel o: lst[o, :cnt[o, 1]] = the flat indices r of the non-zero
    ternary weights t_o[o] ([O, K, K, C] flattened per o), the +1 weights first
    (cnt[o, 0] of them), then the -1 weights. lst: int32 [O, K*K*C]; cnt: int32 [O, 2]."""
    n_out = t_o.shape[0]
    t2 = t_o.reshape(n_out, -1)
    for o in range(n_out):
        m = 0
        for r in range(t2.shape[1]):
            if t2[o, r] > 0:
                lst[o, m] = r
                m += 1
        cnt[o, 0] = m
        for r in range(t2.shape[1]):
            if t2[o, r] < 0:
                lst[o, m] = r
                m += 1
        cnt[o, 1] = m


@njit(cache=True, inline="always")
def _to_plane(a, pad, plane):
    """plane[c, s0 + n*hs + iy*wp + ix] = a[n, iy, ix, c], gaps zeroed (see above)."""
    n_s = a.shape[0]
    h_in = a.shape[1]
    w_in = a.shape[2]
    c_in = a.shape[3]
    wp = w_in + pad
    hs = (h_in + pad) * wp
    s0 = pad * wp + pad
    for c in range(c_in):
        for i in range(s0):
            plane[c, i] = 0
    for n in range(n_s):
        for iy in range(h_in):
            base = s0 + n * hs + iy * wp
            for ix in range(w_in):
                for c in range(c_in):
                    plane[c, base + ix] = a[n, iy, ix, c]
            for c in range(c_in):
                for ix in range(w_in, wp):
                    plane[c, base + ix] = 0
        for iy in range(h_in, h_in + pad):
            base = s0 + n * hs + iy * wp
            for c in range(c_in):
                for ix in range(wp):
                    plane[c, base + ix] = 0


@njit(cache=True, inline="always")
def _add_runs(accv, pf, offs, lst_o, i0, i1, npos, q0, m):
    """accv[:m] += sum of the plane runs pf[offs[r] + q0:][:m] for the list entries
    i0 <= i < i1 (added below npos, subtracted from npos on), eight runs per pass."""
    i = i0
    pe = min(i1, npos)
    while i + 8 <= pe:
        r0, r1, r2, r3, r4, r5, r6, r7 = _eight_runs(pf, offs, lst_o, i, q0, m)
        for j in range(m):
            accv[j] = accv[j] + (((r0[j] + r1[j]) + (r2[j] + r3[j]))
                                 + ((r4[j] + r5[j]) + (r6[j] + r7[j])))
        i += 8
    while i < pe:
        b0 = offs[lst_o[i]] + q0
        r0 = pf[b0:b0 + m]
        for j in range(m):
            accv[j] = accv[j] + r0[j]
        i += 1
    if i < npos:
        i = npos
    while i + 8 <= i1:
        r0, r1, r2, r3, r4, r5, r6, r7 = _eight_runs(pf, offs, lst_o, i, q0, m)
        for j in range(m):
            accv[j] = accv[j] - (((r0[j] + r1[j]) + (r2[j] + r3[j]))
                                 + ((r4[j] + r5[j]) + (r6[j] + r7[j])))
        i += 8
    while i < i1:
        b0 = offs[lst_o[i]] + q0
        r0 = pf[b0:b0 + m]
        for j in range(m):
            accv[j] = accv[j] - r0[j]
        i += 1


@njit(cache=True, inline="always")
def _eight_runs(pf, offs, lst_o, i, q0, m):
    b0 = offs[lst_o[i]] + q0
    b1 = offs[lst_o[i + 1]] + q0
    b2 = offs[lst_o[i + 2]] + q0
    b3 = offs[lst_o[i + 3]] + q0
    b4 = offs[lst_o[i + 4]] + q0
    b5 = offs[lst_o[i + 5]] + q0
    b6 = offs[lst_o[i + 6]] + q0
    b7 = offs[lst_o[i + 7]] + q0
    return (pf[b0:b0 + m], pf[b1:b1 + m], pf[b2:b2 + m], pf[b3:b3 + m],
            pf[b4:b4 + m], pf[b5:b5 + m], pf[b6:b6 + m], pf[b7:b7 + m])


@njit(cache=True)
def conv_forward_plane(a, lst, cnt, k, pad, shift, amax, relu, out, plane, offs, acc, acc16,
                       tile):
    """Same result as :func:`conv_forward` for stride 1, from the padded planar layout.

    lst/cnt: the weights' :func:`ternary_lists`; plane: scratch [C, >= pad*wp + pad +
    N*hs] (dtype of ``a``; left holding this input's plane for the weight gradient);
    offs: int32 scratch [K*K*C]; acc: int32 scratch and acc16 int16 scratch (s <= 8;
    else length 0) of a block of positions; tile: [O, block] scratch of out's dtype.
    For every non-zero ternary weight a run of the plane is added or subtracted (no
    multiplication, eight runs per pass; int16 partial sums over <= 256 runs when
    |a| <= 127, which cannot overflow), then rounding shift + clip (+ ReLU) write the valid
    positions of ``out``.
    """
    n_s = a.shape[0]
    h_in = a.shape[1]
    w_in = a.shape[2]
    c_in = a.shape[3]
    h_out = out.shape[1]
    w_out = out.shape[2]
    n_out = out.shape[3]
    wp = w_in + pad
    hs = (h_in + pad) * wp
    lp = plane.shape[1]
    _to_plane(a, pad, plane)
    for kh in range(k):
        for kw in range(k):
            for c in range(c_in):
                offs[(kh * k + kw) * c_in + c] = c * lp + kh * wp + kw
    pf = plane.reshape(-1)
    q_end = (n_s - 1) * hs + (h_out - 1) * wp + w_out
    block = acc.shape[0]
    narrow = amax <= 127 and acc16.shape[0] >= block
    for q0 in range(0, q_end, block):
        m = min(q_end, q0 + block) - q0
        for o in range(n_out):
            npos = cnt[o, 0]
            nnz = cnt[o, 1]
            lst_o = lst[o]
            for j in range(m):
                acc[j] = 0
            if narrow:
                for s in range(0, nnz, 256):
                    for j in range(m):
                        acc16[j] = 0
                    _add_runs(acc16, pf, offs, lst_o, s, min(nnz, s + 256), npos, q0, m)
                    for j in range(m):
                        acc[j] = np.int32(acc[j] + np.int32(acc16[j]))
            else:
                _add_runs(acc, pf, offs, lst_o, 0, nnz, npos, q0, m)
            _finish_row(acc, m, shift, amax, relu, tile, o)
        n = q0 // hs
        rem = q0 - n * hs
        y = rem // wp
        x = rem - y * wp
        for j in range(m):
            if y < h_out and x < w_out:
                for o in range(n_out):
                    out[n, y, x, o] = tile[o, j]
            x += 1
            if x == wp:
                x = 0
                y += 1
                if y * wp == hs:
                    y = 0
                    n += 1


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


@njit(cache=True, inline="always")
def _pad_nhwc(a, pad, a_pad):
    """a_pad[n, pad + iy, pad + ix, c] = a[n, iy, ix, c], zero borders ([N, H+2p, W+2p, C])."""
    n_s = a.shape[0]
    h_in = a.shape[1]
    w_in = a.shape[2]
    c_in = a.shape[3]
    hp = a_pad.shape[1]
    wpp = a_pad.shape[2]
    for n in range(n_s):
        for iy in range(hp):
            yy = iy - pad
            if yy < 0 or yy >= h_in:
                for ix in range(wpp):
                    for c in range(c_in):
                        a_pad[n, iy, ix, c] = 0
                continue
            for ix in range(pad):
                for c in range(c_in):
                    a_pad[n, iy, ix, c] = 0
            for ix in range(w_in):
                for c in range(c_in):
                    a_pad[n, iy, pad + ix, c] = a[n, yy, ix, c]
            for ix in range(pad + w_in, wpp):
                for c in range(c_in):
                    a_pad[n, iy, ix, c] = 0


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


@njit(cache=True)
def maxpool_backward(e, idx, out):
    """Route e [N, Ho, Wo, C] to the winners: out [N, H, W, C] int32 (zeroed first)."""
    out[...] = 0
    n_samples = e.shape[0]
    e2 = e.reshape(n_samples, -1)
    i2 = idx.reshape(n_samples, -1)
    o2 = out.reshape(n_samples, -1)
    for n in range(n_samples):
        for j in range(e2.shape[1]):
            o2[n, i2[n, j]] += e2[n, j]


# --------------------------------------------------------------------------- update


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
def regularizer_terms(w, anchor, mu_q, step_g, alpha_q, extra):
    """FedProx + FedFOR gradient numerators in fixed point (flat arrays, int64 out).

    extra[j] = mu_q*(w[j] - anchor[j]) + alpha_q*step_g[j] if step_g[j]*(w[j]-anchor[j]) > 0.
    ``mu_q``/``alpha_q`` are the coefficients with 16 fractional bits; w/anchor/step_g are
    integers on the storage grid.
    """
    for j in range(w.shape[0]):
        d = np.int64(w[j]) - np.int64(anchor[j])
        v = mu_q * d
        s = np.int64(step_g[j])
        if alpha_q != 0 and s * d > 0:
            v += alpha_q * s
        extra[j] = v


@njit(cache=True)
def transpose_kkco_okkc(t, out):
    """Ternary conv weights [K, K, C, O] -> [O, K, K, C] (the backward-data layout)."""
    for kh in range(t.shape[0]):
        for kw in range(t.shape[1]):
            for c in range(t.shape[2]):
                for o in range(t.shape[3]):
                    out[o, kh, kw, c] = t[kh, kw, c, o]


@njit(cache=True)
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


@njit(cache=True)
def quantize_inputs_nhwc(xq, out):
    """Copy NCHW integers into the NHWC activation layout (data loading, integers)."""
    for n in range(xq.shape[0]):
        for c in range(xq.shape[1]):
            for h in range(xq.shape[2]):
                for w in range(xq.shape[3]):
                    out[n, h, w, c] = xq[n, c, h, w]


# The kernels a training step runs from Python (their compiled signatures must be
# integer-only). The jitted helpers they call are all inline="always": their bodies are
# typed inside these kernels.
TRAINING_KERNELS = (
    conv_forward, conv_forward_col, linear_forward, maxpool_forward, relu_forward,
    sse_error, softmax_error, relu_mask, quantize_error, conv_backward_data, conv_weight_grad,
    conv_weight_grad_dot, linear_backward_data, linear_weight_grad, maxpool_backward,
    sgd_update, regularizer_terms, ternarize, transpose_kkco_okkc,
    argmax_correct, stream_key, ternary_lists, conv_forward_plane, conv_weight_grad_plane,
    conv_weight_grad_sparse, conv_backward_data_narrow,
)
