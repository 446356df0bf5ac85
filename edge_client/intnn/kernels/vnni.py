"""Int8 dot products on x86's AVX-512 VNNI (``vpdpbusd``: 64 unsigned x 64 signed bytes
added in fours into 16 int32 lanes, 64 multiply-accumulates an instruction), through the
intrinsics of :mod:`.vnni_intrinsics` (which explains the sign-bit flip and its
correction: any int8 works, results are exact). :data:`AVAILABLE`: whether the CPU Numba
compiles for has it; the kernels are only compiled where it does, the generic ones stay
the reference and the fallback. Bit-identical to them (tests/packages/edge_client/test_intnn_vnni.py).

- :func:`conv_forward_vnni`: the conv forward straight from the zero-padded input (four
  input bytes broadcast x the weights packed in fours per kernel row, :func:`pad_rows`);
  :func:`plane_for_grad` makes the planar input a stride-1 conv's gradient reads;
- :func:`conv_weight_grad_plane_vnni`, :func:`conv_weight_grad_sparse_vnni` (four errors'
  patches interleaved, a channel's error list with its sums in registers) and
  :func:`conv_backward_data_vnni` (per output pixel its non-zero errors against their
  weight rows). The linear layers' are in :mod:`.vnni_linear`.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from edge_client.intnn.kernels.conv_backward import _add_four_patches, _gt_out
from edge_client.intnn.kernels.conv_forward import _finish_run
from edge_client.intnn.kernels.layout import _pad_nhwc, _to_plane
from edge_client.intnn.kernels.vnni_intrinsics import (  # noqa: F401 (re-exported)
    AVAILABLE,
    DISABLE_ENV,
    VEC,
    _dot_block,
    _finish16,
    _interleave4_rows,
    _lowest_bit,
    _nonzero_mask,
    _outer_block,
    _target_has_vnni,
    padded,
)

U = np.uint64
#: positions of the first conv's plane weight gradient a chunk (its errors and planes in L1)
PLANE_CHUNK = 3072
#: pixels whose non-zero errors the sparse conv gradient lists at a time (the workspace
#: sizes its pi/pv scratch for it)
SPARSE_CHUNK = 2048


@njit(cache=True, nogil=True)
def pad_rows(tb, tp, corr):
    """Conv ternary weights [O, K, K, C] (``tb``) packed for :func:`conv_forward_vnni`:
    each kernel row's K*C weights (kw, c) in ng = ceil(K*C / 4) groups of four, zeros past
    K*C; tp [K*ng, Op, 4] holds group g = kh*ng + q of channel o at (g, o, :) (channels
    padded with zeros to Op, a multiple of 16), and corr [Op] int32 = 128 x each channel's
    weight sum (the flip's correction)."""
    n_out = tb.shape[0]
    k = tb.shape[1]
    seg = tb.shape[2] * tb.shape[3]
    ng = tp.shape[0] // k
    n_op = tp.shape[1]
    tp[...] = 0
    corr[...] = 0
    for o in range(n_out):
        s = 0
        for kh in range(k):
            row = tb[o, kh].reshape(-1)
            for b in range(seg):
                v = row[b]
                tp[kh * ng + b // 4, o, b % 4] = v
                s += v
        corr[o] = np.int32(s * 128)
    for o in range(n_out, n_op):
        corr[o] = 0


@njit(cache=True, nogil=True)
def conv_weight_grad_plane_vnni(eqp, plane, offs, n_pos, g_out, r0, r1):
    """:func:`~.conv_backward.conv_weight_grad_plane` (same arguments, same G and max |G|)
    with vpdpbusd: two weight rows x four output channels a pass, over the positions in
    chunks of :data:`PLANE_CHUNK` (a chunk's errors and planes stay in L1 while every row
    and channel passes over it; whole passes stream them from L2 again and again); the
    last n_pos % 64 positions in plain integers."""
    n_out = g_out.shape[3]
    g2 = g_out.reshape(-1, n_out)
    pf = plane.reshape(-1)
    ef = eqp.reshape(-1)
    le = eqp.shape[1]
    n64 = n_pos // VEC
    tail = n64 * VEC
    corr = np.zeros(n_out, np.int32)  # 128 x each channel's error sum: the flip's correction
    for o in range(n_out):
        s = np.int32(0)
        for q in range(tail):
            s = np.int32(s + np.int32(ef[U(o * le + q)]))
        corr[o] = np.int32(s * 128)
    for r in range(r0, r1):
        for o in range(n_out):
            g2[r, o] = -corr[o]
    last = n_out - 1
    for c0 in range(0, tail, PLANE_CHUNK):
        nc = min(PLANE_CHUNK, tail - c0) // VEC
        for o in range(0, n_out, 4):
            # four output channels a pass (the last pass repeats the last channel when
            # fewer: its repeats are not added)
            oc = (o, min(o + 1, last), min(o + 2, last), min(o + 3, last))
            eo = (oc[0] * le + c0, oc[1] * le + c0, oc[2] * le + c0, oc[3] * le + c0)
            n_oc = min(4, n_out - o)
            for r in range(r0, r1, 2):
                rb = min(r + 1, r1 - 1)
                s = _dot_block(pf, (offs[r] + c0, offs[rb] + c0), ef, eo, nc)
                for j in range(n_oc):
                    g2[r, oc[j]] = np.int32(g2[r, oc[j]] + s[j])
                    if rb != r:
                        g2[rb, oc[j]] = np.int32(g2[rb, oc[j]] + s[4 + j])
    for r in range(r0, r1):
        pa = offs[r]
        for o in range(n_out):
            a = g2[r, o]
            for q in range(tail, n_pos):
                a = np.int32(a + np.int32(pf[U(pa + q)]) * np.int32(ef[U(o * le + q)]))
            g2[r, o] = a
    gmax = np.int64(0)
    for r in range(r0, r1):
        for o in range(n_out):
            v = np.int64(g2[r, o])
            v = -v if v < 0 else v
            gmax = v if v > gmax else gmax
    return gmax


@njit(cache=True, nogil=True, inline="always")
def _finish_fast(src, s0, dst, d0, m, shift, amax, relu):
    """:func:`~.conv_forward._finish_run` (same values) for int8 ``dst``, sixteen at a time
    in int32 lanes (:func:`_finish16`) where the rounding fits int32, the rest as it does."""
    lo = 0 if relu else -amax
    done = 0
    if 0 < shift <= 22 and (np.int64(amax + 1) << shift) + (np.int64(1) << shift) < 2 ** 31:
        lim = (amax + 1) << shift
        done = m - m % 16
        for j in range(0, done, 16):
            _finish16(src, s0 + j, dst, d0 + j, shift, lim, amax, lo)
    if done < m:
        _finish_run(src, s0 + done, dst, d0 + done, m - done, shift, amax, relu)


@njit(cache=True, nogil=True, inline="always")
def _next_pixel(cur, move, w_out, h_out, step_x, step_y, step_n):
    """The scan-order successor of an output pixel ``cur`` = (x, y, its row's patch offset,
    its patch offset) in the padded input (``move`` False: ``cur`` itself)."""
    x, y, row, base = cur
    if not move:
        return cur
    x += 1
    if x < w_out:
        return (x, y, row, base + step_x)
    y += 1
    row += step_y
    if y == h_out:
        y = 0
        row += step_n
    return (0, y, row, row)


@njit(cache=True, nogil=True)
def conv_forward_vnni(a, tp, corr, k, stride, pad, shift, amax, relu, out, a_pad, acc, n0, n1):
    """The conv forward (:func:`~.conv_forward.conv_forward`'s result) for samples
    n0 <= n < n1 with vpdpbusd, straight from the zero-padded input (no im2col): their
    input is first padded into ``a_pad`` ([N, H+2p, W+2p, C], zero borders; the
    error-driven weight gradient reads it too; at least 3 bytes must follow it in memory:
    a kernel row is read in groups of four), then every 4 output pixels x 64 (or 32, 16)
    channels: four input bytes broadcast x the packed weights ``tp`` [K*ng, Op, 4]
    (:func:`pad_rows`, its correction ``corr``) add into 16 channels' lanes per
    instruction, kernel row after kernel row, into ``acc`` int32 [B * Op] scratch (B
    pixels at a time, a multiple of 4); then ``clip(round_shift(sum, shift), +-amax)``
    (ReLU'd if relu) writes NHWC ``out``. A group past a kernel row's K*C bytes reads the
    next bytes of the input, whose weights are zero."""
    _pad_nhwc(a, pad, a_pad, n0, n1)
    hp = a_pad.shape[1]
    wpp = a_pad.shape[2]
    c_in = a.shape[3]
    h_out = out.shape[1]
    w_out = out.shape[2]
    n_out = out.shape[3]
    n_op = tp.shape[1]
    ng = tp.shape[0] // k
    row_bytes = wpp * c_in
    jump = row_bytes - 4 * ng  # from the end of one kernel row's groups to the next row
    block = acc.shape[0] // n_op
    tf = tp.reshape(-1)
    pf = a_pad.reshape(-1)
    of = out.reshape(-1)
    n_pix = h_out * w_out
    p_last = n1 * n_pix - 1
    o64 = n_op - n_op % 64
    step_x = stride * c_in
    step_y = stride * row_bytes
    step_n = (hp - h_out * stride) * row_bytes
    # the pixels' patch offsets advance in scan order (no division per pixel); a last
    # group past m repeats the last pixel (not written)
    cur = (0, 0, n0 * hp * row_bytes, n0 * hp * row_bytes)  # x, y, row's base, pixel's base
    for p0 in range(n0 * n_pix, p_last + 1, block):
        m = min(p_last + 1, p0 + block) - p0
        for j in range(0, m, 4):
            q = p0 + j
            b0 = cur[3]
            cur = _next_pixel(cur, q < p_last, w_out, h_out, step_x, step_y, step_n)
            b1 = cur[3]
            cur = _next_pixel(cur, q + 1 < p_last, w_out, h_out, step_x, step_y, step_n)
            b2 = cur[3]
            cur = _next_pixel(cur, q + 2 < p_last, w_out, h_out, step_x, step_y, step_n)
            b3 = cur[3]
            cur = _next_pixel(cur, q + 3 < p_last, w_out, h_out, step_x, step_y, step_n)
            rows = (b0, b1, b2, b3)
            dst = (j * n_op, (j + 1) * n_op, (j + 2) * n_op, (j + 3) * n_op)
            for o in range(0, o64, 64):
                _outer_block(pf, rows, k * ng, tf, n_op * 4, (o, o + 16, o + 32, o + 48), corr,
                             acc, dst, ng, jump)
            o = o64
            if o + 32 <= n_op:
                _outer_block(pf, rows, k * ng, tf, n_op * 4, (o, o + 16), corr, acc, dst, ng,
                             jump)
                o += 32
            if o < n_op:
                _outer_block(pf, rows, k * ng, tf, n_op * 4, (o,), corr, acc, dst, ng, jump)
        if n_op == n_out:  # the block's sums are its outputs' NHWC run: one pass
            _finish_fast(acc, 0, of, p0 * n_out, m * n_out, shift, amax, relu)
        else:
            for j in range(m):
                _finish_fast(acc, j * n_op, of, (p0 + j) * n_out, n_out, shift, amax, relu)


@njit(cache=True, nogil=True)
def plane_for_grad(a, k, pad, plane, offs, n0, n1):
    """The padded planar layout of a stride-1 conv's input (samples n0 <= n < n1) and its
    run offsets, as :func:`~.conv_forward.conv_forward_plane` leaves them for
    :func:`conv_weight_grad_plane_vnni` (the VNNI forward does not make them)."""
    c_in = a.shape[3]
    wp = a.shape[2] + pad
    lp = plane.shape[1]
    _to_plane(a, pad, plane, n0, n1)
    for kh in range(k):
        for kw in range(k):
            for c in range(c_in):
                offs[(kh * k + kw) * c_in + c] = c * lp + kh * wp + kw


@njit(cache=True, nogil=True, inline="always")
def _pad_to_fours(pi, pv, cnt):
    """Zero terms after the cnt listed in pi/pv up to a multiple of four (what
    :func:`_rows_dot` takes); returns the new count."""
    while cnt & 3:
        pi[cnt] = 0
        pv[cnt] = 0
        cnt += 1
    return cnt


@njit(cache=True, nogil=True, inline="always")
def _rows_dot(gf, d, a, pi, pv, q0, q1, row_off, n, bias):
    """gf[d + j] += sum_q (a[pi[q] + row_off + j] ^ 0x80) * pv[q] - bias for j < n (a
    multiple of 16), q0 <= q < q1: :func:`_interleave4_rows` on five chunks of 16 a call,
    then four, then one (the fastest split by two LLVM versions:
    docs/performance.md#the-kernels)."""
    c = 0
    while c + 80 <= n:
        _interleave4_rows(gf, d, a, pi, pv, q0, q1, row_off,
                          (c, c + 16, c + 32, c + 48, c + 64), bias)
        c += 80
    while c + 64 <= n:
        _interleave4_rows(gf, d, a, pi, pv, q0, q1, row_off, (c, c + 16, c + 32, c + 48),
                          bias)
        c += 64
    while c + 16 <= n:
        _interleave4_rows(gf, d, a, pi, pv, q0, q1, row_off, (c,), bias)
        c += 16


@njit(cache=True, nogil=True)
def conv_backward_data_vnni(eq, t, stride, pad, out, oi, ov, n0, n1):
    """:func:`~.conv_backward.conv_backward_data` (out [N, H, W, C] int32 = the input's
    error; eq int8 [N, Ho, Wo, O], t int8 [O, K, K, C]) with vpdpbusd: per output pixel,
    its non-zero errors (a bit mask per 64 channels; oi/ov int32 scratch [>= O + 4]) in
    fours, packed in one int32 against their four weight rows' bytes interleaved
    (:func:`_interleave4_rows`, the sums in registers), added straight into the K rows of
    ``out`` the pixel's patch covers (K*C contiguous values each, fewer at the borders);
    the last of a row that is not a multiple of 16 in plain integers. Samples
    n0 <= n < n1 only (out[n0:n1] is zeroed first)."""
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
                cnt = 0
                esum = 0
                for ob in range(0, n_out, 64):
                    mask = _nonzero_mask(ef, p * n_out + ob, min(64, n_out - ob))
                    while mask != 0:
                        j = _lowest_bit(mask)
                        mask &= mask - np.uint64(1)
                        e = ef[U(p * n_out + ob + j)]
                        oi[cnt] = (ob + j) * r_len
                        ov[cnt] = e
                        esum += e
                        cnt += 1
                p += 1
                if cnt == 0:
                    continue
                cnt = _pad_to_fours(oi, ov, cnt)
                ix0 = x * stride - pad
                kw_lo = 0 if ix0 >= 0 else -ix0
                kw_hi = k if ix0 + k <= w_in else w_in - ix0
                if kw_hi <= kw_lo:
                    continue
                ln = (kw_hi - kw_lo) * c_in
                m16 = ln - ln % 16
                for kh in range(k):
                    iy = y * stride + kh - pad
                    if iy < 0 or iy >= h_in:
                        continue
                    d0 = ((n * h_in + iy) * w_in + ix0 + kw_lo) * c_in
                    r0 = kh * kc + kw_lo * c_in
                    _rows_dot(of, d0, tf, oi, ov, 0, cnt, r0, m16, 128 * esum)
                    for j in range(m16, ln):
                        s = np.int32(0)
                        for q in range(cnt):
                            s = np.int32(s + np.int32(ov[q]) * np.int32(tf[U(oi[q] + r0 + j)]))
                        of[U(d0 + j)] = np.int32(of[U(d0 + j)] + s)


@njit(cache=True, nogil=True)
def conv_weight_grad_sparse_vnni(eq, a_pad, stride, g_out, gt, pi, pv, o0, o1):
    """:func:`~.conv_backward.conv_weight_grad_sparse` (same arguments and results, an
    int32 ``gt``; pi/pv int32 scratch of at least 8 x min(64, o1 - o0), best
    :data:`SPARSE_CHUNK` + 4 times that) with vpdpbusd: each pass's four non-zero errors,
    packed in one int32, against their four patches' bytes interleaved
    (:func:`_interleave4_rows`), 16 gradient elements an instruction; the last K*C % 16 of
    a patch row in plain integers. The errors are listed in one pass over ``eq`` for up to
    64 channels at once (a pixel's non-zero channels as a bit mask, into per-channel
    buckets of pi/pv), a chunk of pixels at a time. Returns max |G| of channels
    o0 <= o < o1."""
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
    chunks = kc // 16
    tail = chunks * 16
    rowstep = wpp * c_in
    apf = a_pad.reshape(-1)
    ef = eq.reshape(-1)
    gf = gt.reshape(-1)
    n_pos = n_s * h_out * w_out
    for ob in range(o0, o1, 64):
        nb = min(64, o1 - ob)
        cap = pi.size // nb // 4 * 4  # a channel's bucket: a chunk's errors + 3 zero terms
        if cap < 8:
            raise ValueError("conv_weight_grad_sparse_vnni: pi/pv hold under 8 per channel")
        chunk = cap - 3
        fill = np.zeros(nb, np.int64)
        esum = np.zeros(nb, np.int64)
        for r in range(ob * r_len, (ob + nb) * r_len):
            gf[U(r)] = 0
        x = 0
        y = 0
        row = 0  # the patch offset of output row (n, y)'s first pixel in a_pad
        for p0 in range(0, n_pos, chunk):
            fill[:] = 0
            for p in range(p0, min(n_pos, p0 + chunk)):
                base = row + x * stride * c_in
                mask = _nonzero_mask(ef, p * n_out + ob, nb)
                while mask != 0:
                    j = _lowest_bit(mask)
                    mask &= mask - np.uint64(1)
                    e = ef[U(p * n_out + ob + j)]
                    q = j * cap + fill[j]
                    pi[q] = base
                    pv[q] = e
                    fill[j] += 1
                    esum[j] += e
                x += 1
                if x == w_out:
                    x = 0
                    y += 1
                    row += stride * rowstep
                    if y == h_out:
                        y = 0
                        row += (hp - h_out * stride) * rowstep
            for j in range(nb):
                q0 = j * cap
                cnt = fill[j]
                while cnt & 3:  # zero terms up to a multiple of four
                    pi[q0 + cnt] = 0
                    pv[q0 + cnt] = 0
                    cnt += 1
                go = (ob + j) * r_len
                for kh in range(k):
                    _rows_dot(gf, go + kh * kc, apf, pi, pv, q0, q0 + cnt, kh * rowstep, tail,
                              0)
                if tail < kc:  # the last K*C % 16 of each patch row
                    for q in range(q0, q0 + cnt, 4):
                        for kh in range(k):
                            _add_four_patches(gf, go + kh * kc, apf, pi[q] + kh * rowstep,
                                              pi[q + 1] + kh * rowstep,
                                              pi[q + 2] + kh * rowstep,
                                              pi[q + 3] + kh * rowstep, np.int64(pv[q]),
                                              np.int64(pv[q + 1]), np.int64(pv[q + 2]),
                                              np.int64(pv[q + 3]), tail, kc)
        for j in range(nb):  # the flip's correction: 128 x the channel's error sum
            corr = np.int32(esum[j] * 128)
            for kh in range(k):
                d = (ob + j) * r_len + kh * kc
                for jj in range(tail):
                    gf[U(d + jj)] = np.int32(gf[U(d + jj)] - corr)
    return _gt_out(gt, g2, o0, o1)
