"""Convolution forward: three bit-identical variants of ``out = clip(round_shift(relu?(
sum t*a), shift), +-amax)`` with ternary weights ``t``.

- :func:`conv_forward_plane`: the default for stride 1 (``IntModel`` with
  ``conv_impl="col"`` and a stride-1 layer). The input in a padded planar layout that
  fits in L2 and, per output channel, lists of its +1 and -1 weights; each list entry
  adds or subtracts a contiguous run of the plane to a block of output positions, int16
  partial sums for s <= 8, no im2col.
- :func:`conv_forward_col`: other strides with ``conv_impl="col"``. A transposed im2col
  of the batch, then each non-zero ternary weight adds or subtracts a whole block of
  pixels; the im2col is kept for the weight gradient (``conv_weight_grad_dot``).
- :func:`conv_forward`: ``conv_impl="sparse"``. Per output pixel the non-zero inputs are
  compacted and accumulated over contiguous output channels; it wins when inputs are
  very sparse.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from edge_client.intnn.kernels.arith import _finish
from edge_client.intnn.kernels.layout import _im2col_t, _to_plane

U = np.uint64


@njit(cache=True, nogil=True)
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


@njit(cache=True, nogil=True, inline="always")
def _finish_run(src, s0, dst, d0, m, shift, amax, relu):
    """dst[d0 + j] = clip(round_shift(src[s0 + j], shift), +-amax) (ReLU'd if relu) for
    j < m, flat arrays, written branch-free so that it vectorizes; same values as
    :func:`_finish`."""
    lo = 0 if relu else -amax
    if shift > 0:
        half = np.int64(1) << (shift - 1)
        for j in range(m):
            v = np.int64(src[U(s0 + j)])
            av = -v if v < 0 else v
            r = (av + half) >> shift
            v = -r if v < 0 else r
            v = amax if v > amax else v
            dst[U(d0 + j)] = lo if v < lo else v
    else:
        for j in range(m):
            v = np.int64(src[U(s0 + j)]) << (-shift)
            v = amax if v > amax else v
            dst[U(d0 + j)] = lo if v < lo else v


@njit(cache=True, nogil=True, inline="always")
def _finish_row(acc, m, shift, amax, relu, tile, o):
    """tile[o, :m] = the finished acc[:m] (:func:`_finish_run`)."""
    _finish_run(acc, 0, tile.reshape(-1), o * tile.shape[1], m, shift, amax, relu)


@njit(cache=True, nogil=True)
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


@njit(cache=True, nogil=True, inline="always")
def _scatter_rows(tile, m, q0, hs, wp, h_out, w_out, out):
    """out (NHWC) at the output pixels among plane positions q0..q0+m = tile [O, block]
    transposed, one output row segment (contiguous x) at a time."""
    n_out = out.shape[3]
    block = tile.shape[1]
    tf = tile.reshape(-1)
    of = out.reshape(-1)
    j = 0
    while j < m:
        q = q0 + j
        n = q // hs
        rem = q - n * hs
        y = rem // wp
        x = rem - y * wp
        run = min(m - j, wp - x)  # positions up to the end of this plane row
        if y < h_out and x < w_out:
            valid = min(run, w_out - x)
            base = ((n * h_out + y) * w_out + x) * n_out
            for xx in range(valid):
                d = base + xx * n_out
                for o in range(n_out):
                    of[U(d + o)] = tf[U(o * block + j + xx)]
        j += run


@njit(cache=True, nogil=True, inline="always")
def _add_runs(accv, pf, offs, lst_o, i0, i1, npos, q0, m):
    """accv[:m] += sum of the plane runs pf[offs[r] + q0:][:m] for the list entries
    i0 <= i < i1 (added below npos, subtracted from npos on), eight runs per pass (flat
    unsigned offsets: no array views, no wraparound checks)."""
    i = i0
    pe = min(i1, npos)
    while i + 8 <= pe:
        _eight_runs(accv, pf, offs, lst_o, i, q0, m, False)
        i += 8
    while i < pe:
        b0 = U(offs[lst_o[i]] + q0)
        for j in range(m):
            accv[U(j)] = accv[U(j)] + pf[b0 + U(j)]
        i += 1
    if i < npos:
        i = npos
    while i + 8 <= i1:
        _eight_runs(accv, pf, offs, lst_o, i, q0, m, True)
        i += 8
    while i < i1:
        b0 = U(offs[lst_o[i]] + q0)
        for j in range(m):
            accv[U(j)] = accv[U(j)] - pf[b0 + U(j)]
        i += 1


@njit(cache=True, nogil=True, inline="always")
def _eight_runs(accv, pf, offs, lst_o, i, q0, m, neg):
    b0 = U(offs[lst_o[i]] + q0)
    b1 = U(offs[lst_o[i + 1]] + q0)
    b2 = U(offs[lst_o[i + 2]] + q0)
    b3 = U(offs[lst_o[i + 3]] + q0)
    b4 = U(offs[lst_o[i + 4]] + q0)
    b5 = U(offs[lst_o[i + 5]] + q0)
    b6 = U(offs[lst_o[i + 6]] + q0)
    b7 = U(offs[lst_o[i + 7]] + q0)
    if neg:
        for j in range(m):
            ju = U(j)
            accv[ju] = accv[ju] - (((pf[b0 + ju] + pf[b1 + ju]) + (pf[b2 + ju] + pf[b3 + ju]))
                                   + ((pf[b4 + ju] + pf[b5 + ju]) + (pf[b6 + ju] + pf[b7 + ju])))
    else:
        for j in range(m):
            ju = U(j)
            accv[ju] = accv[ju] + (((pf[b0 + ju] + pf[b1 + ju]) + (pf[b2 + ju] + pf[b3 + ju]))
                                   + ((pf[b4 + ju] + pf[b5 + ju]) + (pf[b6 + ju] + pf[b7 + ju])))


@njit(cache=True, nogil=True)
def conv_forward_plane(a, lst, cnt, k, pad, shift, amax, relu, out, plane, offs, acc, acc16,
                       tile, n0, n1):
    """Same result as :func:`conv_forward` for stride 1, from the padded planar layout,
    for samples n0 <= n < n1 (disjoint sample ranges may run on other threads at once).

    lst/cnt: the weights' :func:`ternary_lists`; plane: [C, >= plane_len(N, H, W, pad)]
    (dtype of ``a``; this call writes the rows of its samples, and they stay there for
    the weight gradient); offs: int32 scratch [K*K*C]; acc: int32 scratch and acc16 int16
    scratch (s <= 8; else length 0) of a block of positions; tile: [O, block] scratch of
    out's dtype. For every non-zero ternary weight a run of the plane is added or
    subtracted (no multiplication, eight runs per pass; int16 partial sums over <= 256
    runs when |a| <= 127, which cannot overflow), then rounding shift + clip (+ ReLU)
    write the valid positions of ``out``.
    """
    h_in = a.shape[1]
    w_in = a.shape[2]
    c_in = a.shape[3]
    h_out = out.shape[1]
    w_out = out.shape[2]
    n_out = out.shape[3]
    wp = w_in + pad
    hs = (h_in + pad) * wp
    lp = plane.shape[1]
    if n1 <= n0:
        return
    _to_plane(a, pad, plane, n0, n1)
    for kh in range(k):
        for kw in range(k):
            for c in range(c_in):
                offs[(kh * k + kw) * c_in + c] = c * lp + kh * wp + kw
    pf = plane.reshape(-1)
    q_begin = n0 * hs
    q_end = (n1 - 1) * hs + (h_out - 1) * wp + w_out
    block = acc.shape[0]
    narrow = amax <= 127 and acc16.shape[0] >= block
    for q0 in range(q_begin, q_end, block):
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
        _scatter_rows(tile, m, q0, hs, wp, h_out, w_out, out)
