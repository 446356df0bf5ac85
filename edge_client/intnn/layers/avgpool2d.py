"""The integer engine's average pool (``firmware_models.layers.avgpool2d``): the rounded
mean of each k x k window, and its backward, which gives every cell of a window the
window's error undivided (eq. 12 normalizes each layer's error by its own power of two:
the factor 1 / k^2 would only cost low bits; cells past the last window get 0). Its
kernels are here: no other layer uses them.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from edge_client.intnn.layers.base import IntLayer, Numerics, ParamPass, implements
from edge_client.intnn.workspace import Workspace
from firmware_models.layers.avgpool2d import AvgPool2d


@njit(cache=True, nogil=True)
def avgpool_forward(a, k, out, lo, hi):  # pragma: no cover (compiled)
    """``out[s, y, x, c] = sign(v) ((|v| + k*k // 2) // (k*k))`` with ``v`` the sum of
    ``a[s, ky:ky+k, kx:kx+k, c]`` (NHWC, s-bit), for samples lo..hi."""
    ho, wo, ch = out.shape[1], out.shape[2], out.shape[3]
    d = k * k
    half = d // 2
    for s in range(lo, hi):
        for y in range(ho):
            for x in range(wo):
                for c in range(ch):
                    v = 0
                    for dy in range(k):
                        for dx in range(k):
                            v += a[s, y * k + dy, x * k + dx, c]
                    q = (abs(v) + half) // d
                    out[s, y, x, c] = q if v >= 0 else -q


@njit(cache=True, nogil=True)
def avgpool_backward(e, k, dst):  # pragma: no cover (compiled)
    """``dst[s, y, x, c] = e[s, y // k, x // k, c]`` inside the windows, 0 past them
    (int32, NHWC)."""
    n, h, w, ch = dst.shape
    ho, wo = e.shape[1], e.shape[2]
    for s in range(n):
        for y in range(h):
            for x in range(w):
                inside = y // k < ho and x // k < wo
                for c in range(ch):
                    dst[s, y, x, c] = e[s, y // k, x // k, c] if inside else 0


#: the kernels a training step runs (integer-only, as kernels.TRAINING_KERNELS)
KERNELS = (avgpool_forward, avgpool_backward)


@implements(AvgPool2d)
class CpuAvgPool2d(IntLayer):
    """Average pool on NHWC activations; split over samples as the layer before it is.
    Its output does not keep the ReLU's zeros meaning zero errors (a mean rounded to 0
    may come from positive cells): ``relu_out`` is False."""

    layer: AvgPool2d

    split_like_input = True

    def forward_task(self, model: Numerics, ws: Workspace, prev: np.ndarray, out: np.ndarray,
                     n: int):
        k = self.layer.kernel
        return avgpool_forward, lambda t, lo, hi: (prev, k, out, lo, hi)

    def backward(self, model: Numerics, ws: Workspace, cur: np.ndarray, kq: int, n: int,
                 front: ParamPass | None) -> tuple[np.ndarray, int]:
        dst = ws.err_in[self.index][:n]
        avgpool_backward(cur.reshape(n, *self.out_shape), self.layer.kernel, dst)
        return dst, kq
