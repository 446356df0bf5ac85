"""Max-pool (the winners kept for backward as one int8 per output), ReLU and the errors
through them: exact in integers.

Winners: ``win[n, y, x, c]`` is ``kh * k + kw`` of the window's first maximum ((kh, kw)
order; padded cells never win), or -1 when the pool's input comes out of a ReLU and the
maximum is 0: the ReLU would zero that error anyway (``relu_in``), so the mask is folded
into the winner. :func:`pool_error_quantize` routes the error at a pool's output to the
winners *and* quantizes it (eq. 12) in one pass at the pool's resolution when the windows
do not overlap: ``max |e|`` over the routed errors is the max over the unmasked pool
outputs, and rounding zero gives zero.

Array accesses inside the channel loops use flat unsigned indices: no array view is made
per pixel (a view costs reference counting) and no negative-index wraparound is emitted,
so the loops over channels vectorize.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from edge_client.intnn.kernels.arith import round_log2, round_shift_sel

U = np.uint64


@njit(cache=True, nogil=True)
def maxpool_forward(a, k, stride, pad, out, win, want_win, relu_in, n0, n1):
    """Max pool, NHWC; padded cells never win; ties go to the first cell in (kh, kw) order.

    a: [N, H, W, C]; out: [N, Ho, Wo, C] (dtype of a). When ``want_win``, win (int8, shape
    of out) receives ``kh * k + kw`` of the winner, -1 where ``relu_in`` and the maximum
    is <= 0; otherwise win is not touched (may be a 1-element dummy). k <= 11. Samples
    n0 <= n < n1.
    """
    h_in = a.shape[1]
    w_in = a.shape[2]
    c_in = a.shape[3]
    h_out = out.shape[1]
    w_out = out.shape[2]
    af = a.reshape(-1)
    of = out.reshape(-1)
    wf = win.reshape(-1)
    quad = k == 2
    for n in range(n0, n1):
        for y in range(h_out):
            iy0 = y * stride - pad
            rows_in = iy0 >= 0 and iy0 + k <= h_in
            for x in range(w_out):
                ix0 = x * stride - pad
                ob = ((n * h_out + y) * w_out + x) * c_in
                if quad and rows_in and ix0 >= 0 and ix0 + 2 <= w_in:
                    b0 = ((n * h_in + iy0) * w_in + ix0) * c_in
                    b2 = b0 + w_in * c_in
                    _pool_quad(af, of, wf, b0, b0 + c_in, b2, b2 + c_in, ob, c_in, want_win,
                               relu_in)
                    continue
                first = True
                for kh in range(k):
                    iy = iy0 + kh
                    if iy < 0 or iy >= h_in:
                        continue
                    for kw in range(k):
                        ix = ix0 + kw
                        if ix < 0 or ix >= w_in:
                            continue
                        ib = ((n * h_in + iy) * w_in + ix) * c_in
                        cell = np.int8(kh * k + kw)
                        if first:
                            for c in range(c_in):
                                of[U(ob + c)] = af[U(ib + c)]
                            if want_win:
                                for c in range(c_in):
                                    wf[U(ob + c)] = cell
                            first = False
                        elif want_win:
                            for c in range(c_in):
                                v = af[U(ib + c)]
                                cur = of[U(ob + c)]
                                better = v > cur
                                of[U(ob + c)] = v if better else cur
                                wf[U(ob + c)] = cell if better else wf[U(ob + c)]
                        else:
                            for c in range(c_in):
                                of[U(ob + c)] = max(af[U(ib + c)], of[U(ob + c)])
                if want_win and relu_in:
                    for c in range(c_in):
                        wf[U(ob + c)] = wf[U(ob + c)] if of[U(ob + c)] > 0 else np.int8(-1)


@njit(cache=True, nogil=True, inline="always")
def _pool_quad(af, of, wf, b0, b1, b2, b3, ob, c_in, want_win, relu_in):
    """One 2x2 window with every cell inside: the four rows at b0..b3 (cells 0..3). The
    maximum first, then the first cell equal to it: two loops with one output each, which
    every LLVM numba uses vectorizes (one loop writing both does not on LLVM 14:
    docs/performance.md#the-kernels)."""
    for c in range(c_in):
        of[U(ob + c)] = max(max(af[U(b0 + c)], af[U(b1 + c)]), max(af[U(b2 + c)], af[U(b3 + c)]))
    if want_win:
        for c in range(c_in):
            best = of[U(ob + c)]
            bi = np.int8(3)
            bi = np.int8(2) if af[U(b2 + c)] == best else bi
            bi = np.int8(1) if af[U(b1 + c)] == best else bi
            bi = np.int8(0) if af[U(b0 + c)] == best else bi
            if relu_in:
                bi = bi if best > 0 else np.int8(-1)
            wf[U(ob + c)] = bi


@njit(cache=True, nogil=True, inline="always")
def _route(e, win, k, stride, pad, of, ns, ys, xs, cs, quantize, sh, amax, rdst, rval, n0, n1):
    """Each pool output's error to its winner's cell (n, iy, ix, c) of the flat of, at
    offset n*ns + iy*ys + ix*xs + c*cs (``+=`` when not ``quantize``, else the quantized
    value is stored), for samples n0 <= n < n1. One row of pool outputs at a time:
    first their destinations and values (branch-free, vectorized; a masked output (-1)
    sends 0 to its window's first cell inside the input, which changes nothing), then a
    plain scatter. rdst/rval: int32 [>= Wo * C] scratch. ``win`` must come from
    :func:`maxpool_forward` (a winner is never a padded cell)."""
    h_out = e.shape[1]
    w_out = e.shape[2]
    c_in = e.shape[3]
    ef = e.reshape(-1)
    wf = win.reshape(-1)
    div = 65536 // k + 1  # (w * div) >> 16 == w // k for 0 <= w < k^2 <= 121
    m = w_out * c_in
    for n in range(n0, n1):
        for y in range(h_out):
            iy0 = y * stride - pad
            kh0 = -iy0 if iy0 < 0 else 0
            for x in range(w_out):
                ix0 = x * stride - pad
                kw0 = -ix0 if ix0 < 0 else 0
                w0 = kh0 * k + kw0
                base = n * ns + iy0 * ys + ix0 * xs
                b = ((n * h_out + y) * w_out + x) * c_in
                q = x * c_in
                for c in range(c_in):
                    w = np.int64(wf[U(b + c)])
                    v = np.int64(ef[U(b + c)])
                    if quantize:
                        v = round_shift_sel(v, sh)
                        v = amax if v > amax else v
                        v = -amax if v < -amax else v
                    v = v if w >= 0 else np.int64(0)
                    w = w if w >= 0 else w0
                    kh = (w * div) >> 16
                    rdst[U(q + c)] = base + kh * ys + (w - kh * k) * xs + c * cs
                    rval[U(q + c)] = v
            if quantize:
                for i in range(m):
                    of[U(rdst[U(i)])] = rval[U(i)]
            else:
                for i in range(m):
                    of[U(rdst[U(i)])] += rval[U(i)]


@njit(cache=True, nogil=True)
def maxpool_backward(e, win, k, stride, pad, out, rdst, rval):
    """Route e [N, Ho, Wo, C] to the winners (:func:`maxpool_forward`'s ``win``; -1 routes
    nothing): out [N, H, W, C] int32, zeroed first; overlapping windows add up.
    rdst/rval: int32 [>= Wo * C] scratch."""
    out[...] = 0
    h_in = out.shape[1]
    w_in = out.shape[2]
    c_in = out.shape[3]
    _route(e, win, k, stride, pad, out.reshape(-1), h_in * w_in * c_in, w_in * c_in, c_in, 1,
           False, 0, 0, rdst, rval, 0, e.shape[0])


@njit(cache=True, nogil=True)
def pool_error_quantize(e, win, k, stride, pad, bits, out, ns, ys, xs, cs, rdst, rval):
    """The error at a max-pool's output routed to its winners and quantized (eq. 12), for
    non-overlapping windows (k <= stride): ``out`` (s-bit dtype, any shape) holds the
    quantized error at the pool's input, zero off the winners, element (n, iy, ix, c) at
    flat offset n*ns + iy*ys + ix*xs + c*cs (NHWC, or the positions of the stride-1 plane
    layout, channel-major, for the conv's weight gradient). Same values as
    :func:`maxpool_backward` then :func:`quantize_error` (and the ReLU mask, folded into
    ``win``). e: [N, Ho, Wo, C] int32; rdst/rval: int32 [>= Wo * C] scratch. Returns
    k = round(log2 max|e|) (-1: all zero). The whole batch at once: :func:`pool_error_scale`
    then :func:`pool_error_route` over all samples (which may be split over threads)."""
    kq = pool_error_scale(e, win)
    pool_error_route(e, win, k, stride, pad, bits, kq, out, ns, ys, xs, cs, rdst, rval, 0,
                     e.shape[0])
    return kq


@njit(cache=True, nogil=True)
def pool_error_scale(e, win):
    """k = round(log2 max|e|) over the pool outputs that route an error (``win >= 0``), the
    scale of eq. 12 for the whole batch; -1 when all of them are zero. e: [N, Ho, Wo, C]
    int32; win: int8, e's shape."""
    ef = e.reshape(-1)
    wf = win.reshape(-1)
    m = np.int64(0)
    for i in range(ef.shape[0]):
        v = np.int64(ef[U(i)])
        v = -v if v < 0 else v
        v = v if wf[U(i)] >= 0 else np.int64(0)
        m = v if v > m else m
    if m == 0:
        return -1
    return round_log2(m)


@njit(cache=True, nogil=True)
def pool_error_route(e, win, k, stride, pad, bits, kq, out, ns, ys, xs, cs, rdst, rval, n0, n1):
    """Samples n0 <= n < n1 of :func:`pool_error_quantize` at the batch's scale ``kq``
    (:func:`pool_error_scale`): their elements of ``out`` (offsets n*ns + [0, ns) of every
    channel row c*cs; all of them when cs == 1, NHWC) zeroed, then their errors routed and
    quantized. Disjoint sample ranges may run on other threads at once."""
    of = out.reshape(-1)
    if cs == 1:
        for i in range(n0 * ns, n1 * ns):
            of[U(i)] = 0
    else:
        for c in range(e.shape[3]):
            for i in range(c * cs + n0 * ns, c * cs + n1 * ns):
                of[U(i)] = 0
    if kq < 0:
        return
    _route(e, win, k, stride, pad, of, ns, ys, xs, cs, True, kq - (bits - 1),
           (np.int64(1) << (bits - 1)) - 1, rdst, rval, n0, n1)


@njit(cache=True, nogil=True)
def relu_forward(a, out):
    """Stand-alone ReLU on flat views (a ReLU right after a conv/linear is fused there)."""
    for i in range(a.shape[0]):
        v = a[i]
        out[i] = v if v > 0 else 0


@njit(cache=True, nogil=True)
def relu_mask(e, act):
    """Zero e (flat int32) where the layer's output activation is <= 0 (a select: it
    vectorizes)."""
    for i in range(e.shape[0]):
        e[i] = e[i] if act[i] > 0 else 0
