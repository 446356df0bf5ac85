"""Max-pool (with the winners' indices for the backward pass) and ReLU: exact in
integers. ``relu_mask`` zeroes an error where the layer's output activation is <= 0."""

from __future__ import annotations

import numpy as np
from numba import njit


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


@njit(cache=True)
def relu_mask(e, act):
    """Zero e (flat int32) where the layer's output activation is <= 0 (a select: it
    vectorizes)."""
    for i in range(e.shape[0]):
        e[i] = e[i] if act[i] > 0 else 0


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
