"""The CUDA engine's max-pool: the winners kept as one int8 cell number per output (as the
CPU engine's: the first maximum in (kh, kw) order, padded cells never win, -1 where the
input comes out of a ReLU and the maximum is <= 0) and the error routed back to them,
each input cell gathering the outputs it won (no atomics, overlapping windows add up).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from edge_client.errors import ConfigError
from edge_client.intnn.cuda import device as dev
from edge_client.intnn.cuda.device import cuda
from edge_client.intnn.cuda.layers.base import CudaLayer
from edge_client.intnn.layers.base import IntLayer, Numerics, implements
from firmware_models import MaxPool2d

if TYPE_CHECKING:  # pragma: no cover
    from edge_client.intnn.cuda.device import DeviceArray
    from edge_client.intnn.cuda.stack import Stack, Weights
    from edge_client.intnn.model import IntModel

MAX_POOL_KERNEL = 11  # winners are int8 cell numbers kh * k + kw


@cuda.jit(cache=True)
def maxpool_forward(a, k, stride, pad, out, win, want_win, relu_in, n):
    d = cuda.blockIdx.y
    hi, wi = a.shape[2], a.shape[3]
    ho, wo, ch = out.shape[2], out.shape[3], out.shape[4]
    for e in range(cuda.grid(1), n[d] * ho * wo * ch, cuda.gridsize(1)):
        c = e % ch
        r = e // ch
        x = r % wo
        r = r // wo
        y = r % ho
        s = r // ho
        best = np.int32(0)
        cell = -1
        for kh in range(k):
            iy = y * stride - pad + kh
            if iy >= 0 and iy < hi:
                for kw in range(k):
                    ix = x * stride - pad + kw
                    if ix >= 0 and ix < wi:
                        v = np.int32(a[d, s, iy, ix, c])
                        if cell < 0 or v > best:
                            best = v
                            cell = kh * k + kw
        out[d, s, y, x, c] = best
        if want_win:
            win[d, s, y, x, c] = cell if (best > 0 or not relu_in) else -1


@cuda.jit(cache=True)
def maxpool_backward(e, win, k, stride, pad, dst, n):
    """``dst[d, s, iy, ix, c]``: the sum of the errors of the outputs (int32) that cell won."""
    d = cuda.blockIdx.y
    hi, wi, ch = dst.shape[2], dst.shape[3], dst.shape[4]
    ho, wo = e.shape[2], e.shape[3]
    for i in range(cuda.grid(1), n[d] * hi * wi * ch, cuda.gridsize(1)):
        c = i % ch
        r = i // ch
        ix = r % wi
        r = r // wi
        iy = r % hi
        s = r // hi
        acc = np.int32(0)
        for kh in range(k):
            ty = iy + pad - kh
            if ty >= 0 and ty % stride == 0 and ty // stride < ho:
                y = ty // stride
                for kw in range(k):
                    tx = ix + pad - kw
                    if tx >= 0 and tx % stride == 0 and tx // stride < wo:
                        x = tx // stride
                        if win[d, s, y, x, c] == kh * k + kw:
                            acc = np.int32(acc + np.int32(e[d, s, y, x, c]))
        dst[d, s, iy, ix, c] = acc


#: the kernels of a training step (integer-only)
KERNELS = (maxpool_forward, maxpool_backward)


@implements(MaxPool2d, backend="cuda")
class CudaMaxPool2d(CudaLayer, IntLayer):
    """Max-pool on ``[D, N, H, W, C]`` activations."""

    layer: MaxPool2d

    def relu_out(self, relu_in: bool) -> bool:
        return relu_in

    def check(self, model: Numerics) -> None:
        if self.layer.kernel > MAX_POOL_KERNEL:
            raise ConfigError(f"{self.layer.name}: pool kernel {self.layer.kernel} > "
                              f"{MAX_POOL_KERNEL}")

    def cuda_buffers(self, model: IntModel, stack: Stack) -> dict[str, DeviceArray]:
        shape = (stack.devices, stack.capacity, *self.out_shape) if stack.train else (1, 1, 1, 1, 1)
        return {"win": dev.zeros(shape, np.int8)}

    def cuda_forward(self, model: IntModel, stack: Stack, weights: Weights,
                     prev: DeviceArray, out: DeviceArray, n: DeviceArray) -> None:
        lay = self.layer
        dev.launch(maxpool_forward, stack.capacity * int(np.prod(self.out_shape)), stack.devices,
                   prev, lay.kernel, lay.step, lay.padding, out, stack.extra[self.index]["win"],
                   stack.train, self.relu_in, n)

    def cuda_backward(self, model: IntModel, stack: Stack, cur: DeviceArray,
                      n: DeviceArray) -> DeviceArray:
        lay = self.layer
        dst = stack.err_in[self.index]
        e = cur.reshape(stack.devices, stack.capacity, *self.out_shape)
        dev.launch(maxpool_backward, stack.capacity * int(np.prod(self.in_shape)), stack.devices,
                   e, stack.extra[self.index]["win"], lay.kernel, lay.step, lay.padding, dst, n)
        return dst
