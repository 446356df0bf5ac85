"""The CUDA engine's average pool (``layers.avgpool2d``'s integer form): the rounded mean
of each k x k window, and the window's error given undivided to each of its cells (0 past
the last window)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from edge_client.intnn.cuda import device as dev
from edge_client.intnn.cuda.device import cuda
from edge_client.intnn.cuda.layers.base import CudaLayer
from edge_client.intnn.layers.base import IntLayer, implements
from firmware_models.layers.avgpool2d import AvgPool2d

if TYPE_CHECKING:  # pragma: no cover
    from edge_client.intnn.cuda.device import DeviceArray
    from edge_client.intnn.cuda.stack import Stack, Weights
    from edge_client.intnn.model import IntModel


@cuda.jit(cache=True)
def avgpool_forward(a, k, out, n):
    """``out = sign(v) ((|v| + k*k // 2) // (k*k))``, ``v`` the window's sum."""
    d = cuda.blockIdx.y
    ho, wo, ch = out.shape[2], out.shape[3], out.shape[4]
    div = k * k
    half = div // 2
    for e in range(cuda.grid(1), n[d] * ho * wo * ch, cuda.gridsize(1)):
        c = e % ch
        r = e // ch
        x = r % wo
        r = r // wo
        y = r % ho
        s = r // ho
        v = np.int32(0)
        for dy in range(k):
            for dx in range(k):
                v = np.int32(v + np.int32(a[d, s, y * k + dy, x * k + dx, c]))
        q = ((v if v >= 0 else -v) + half) // div
        out[d, s, y, x, c] = q if v >= 0 else -q


@cuda.jit(cache=True)
def avgpool_backward(e, k, dst, n):
    """``dst[d, s, y, x, c] = e[d, s, y // k, x // k, c]`` inside the windows, else 0."""
    d = cuda.blockIdx.y
    h, w, ch = dst.shape[2], dst.shape[3], dst.shape[4]
    ho, wo = e.shape[2], e.shape[3]
    for i in range(cuda.grid(1), n[d] * h * w * ch, cuda.gridsize(1)):
        c = i % ch
        r = i // ch
        x = r % w
        r = r // w
        y = r % h
        s = r // h
        inside = y // k < ho and x // k < wo
        dst[d, s, y, x, c] = e[d, s, y // k, x // k, c] if inside else 0


#: the kernels of a training step (integer-only)
KERNELS = (avgpool_forward, avgpool_backward)


@implements(AvgPool2d, backend="cuda")
class CudaAvgPool2d(CudaLayer, IntLayer):
    """Average pool on ``[D, N, H, W, C]`` activations (``relu_out`` False, as the CPU's)."""

    layer: AvgPool2d

    def cuda_forward(self, model: IntModel, stack: Stack, weights: Weights,
                     prev: DeviceArray, out: DeviceArray, n: DeviceArray) -> None:
        dev.launch(avgpool_forward, stack.capacity * int(np.prod(self.out_shape)), stack.devices,
                   prev, self.layer.kernel, out, n)

    def cuda_backward(self, model: IntModel, stack: Stack, cur: DeviceArray,
                      n: DeviceArray) -> DeviceArray:
        dst = stack.err_in[self.index]
        e = cur.reshape(stack.devices, stack.capacity, *self.out_shape)
        dev.launch(avgpool_backward, stack.capacity * int(np.prod(self.in_shape)), stack.devices,
                   e, self.layer.kernel, dst, n)
        return dst
