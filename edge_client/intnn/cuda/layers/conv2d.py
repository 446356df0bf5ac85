"""The CUDA engine's 2-D convolution: weights ``[D, K, K, C, O]`` (``IntConv2d``'s layout
and counter order), activations ``[D, N, H, W, C]``; its forward, backward-data and
weight-gradient kernels, one thread per output element (channels fastest: the weights'
and the errors' reads coalesce over them), integer sums in int32 (int64 for a gradient
that may exceed it, ``needs_int64_grad``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from edge_client.intnn.cuda import device as dev
from edge_client.intnn.cuda.arith import finish
from edge_client.intnn.cuda.device import cuda
from edge_client.intnn.cuda.kernels import fill
from edge_client.intnn.cuda.layers.base import CudaWeightLayer
from edge_client.intnn.layers.base import implements
from edge_client.intnn.layers.conv2d import IntConv2d
from firmware_models import Conv2d

if TYPE_CHECKING:  # pragma: no cover
    from edge_client.intnn.cuda.device import DeviceArray
    from edge_client.intnn.cuda.stack import Stack, Weights
    from edge_client.intnn.model import IntModel

#: gradient threads wanted on the GPU (samples are split into parts summed with atomics
#: when the weights alone give fewer)
GRAD_THREADS = 1 << 17


@cuda.jit(cache=True)
def conv_forward(x, t, stride, pad, shift, amax, relu, out, n):
    """``out[d, s, y, x, o] = finish(sum_{kh, kw, c} x[d, s, y*stride - pad + kh, ...] t[d, kh,
    kw, c, o])`` (zero padding) for the device's ``n[d]`` samples."""
    d = cuda.blockIdx.y
    ho, wo, co = out.shape[2], out.shape[3], out.shape[4]
    hi, wi, ci = x.shape[2], x.shape[3], x.shape[4]
    k = t.shape[1]
    for e in range(cuda.grid(1), n[d] * ho * wo * co, cuda.gridsize(1)):
        o = e % co
        r = e // co
        ox = r % wo
        r = r // wo
        oy = r % ho
        s = r // ho
        acc = np.int32(0)
        for kh in range(k):
            iy = oy * stride - pad + kh
            if iy >= 0 and iy < hi:
                for kw in range(k):
                    ix = ox * stride - pad + kw
                    if ix >= 0 and ix < wi:
                        for c in range(ci):
                            acc = np.int32(acc + np.int32(x[d, s, iy, ix, c])
                                           * np.int32(t[d, kh, kw, c, o]))
        out[d, s, oy, ox, o] = finish(acc, shift, amax, relu)


@cuda.jit(cache=True)
def conv_backward_data(eq, t, stride, pad, dst, n):
    """The error at the input: ``dst[d, s, iy, ix, c] = sum eq[d, s, y, x, o] t[d, kh, kw,
    c, o]`` over the outputs whose window holds (iy, ix) (int32)."""
    d = cuda.blockIdx.y
    hi, wi, ci = dst.shape[2], dst.shape[3], dst.shape[4]
    ho, wo, co = eq.shape[2], eq.shape[3], eq.shape[4]
    k = t.shape[1]
    for e in range(cuda.grid(1), n[d] * hi * wi * ci, cuda.gridsize(1)):
        c = e % ci
        r = e // ci
        ix = r % wi
        r = r // wi
        iy = r % hi
        s = r // hi
        acc = np.int32(0)
        for kh in range(k):
            ty = iy + pad - kh
            if ty >= 0 and ty % stride == 0 and ty // stride < ho:
                oy = ty // stride
                for kw in range(k):
                    tx = ix + pad - kw
                    if tx >= 0 and tx % stride == 0 and tx // stride < wo:
                        ox = tx // stride
                        for o in range(co):
                            acc = np.int32(acc + np.int32(eq[d, s, oy, ox, o])
                                           * np.int32(t[d, kh, kw, c, o]))
        dst[d, s, iy, ix, c] = acc


@cuda.jit(cache=True)
def conv_weight_grad(eq, a, stride, pad, g, n, parts, wide):
    """``g[d, kh, kw, c, o] = sum_{s, y, x} eq[d, s, y, x, o] a[d, s, y*stride - pad + kh,
    ...]``; with ``parts > 1`` each thread sums the samples ``s = part (mod parts)`` and
    adds them with an atomic (g zeroed first). Sums in int64 where ``wide`` (g int64), else
    int32."""
    d = cuda.blockIdx.y
    k, ci, co = g.shape[1], g.shape[3], g.shape[4]
    ho, wo = eq.shape[2], eq.shape[3]
    hi, wi = a.shape[2], a.shape[3]
    size = k * k * ci * co
    for e in range(cuda.grid(1), size * parts, cuda.gridsize(1)):
        part = e // size
        w = e - part * size
        o = w % co
        r = w // co
        c = r % ci
        r = r // ci
        kw = r % k
        kh = r // k
        acc = np.int64(0)
        acc32 = np.int32(0)
        for s in range(part, n[d], parts):
            for oy in range(ho):
                iy = oy * stride - pad + kh
                if iy >= 0 and iy < hi:
                    for ox in range(wo):
                        ix = ox * stride - pad + kw
                        if ix >= 0 and ix < wi:
                            if wide:
                                acc += np.int64(eq[d, s, oy, ox, o]) * np.int64(a[d, s, iy, ix, c])
                            else:
                                acc32 = np.int32(acc32 + np.int32(eq[d, s, oy, ox, o])
                                                 * np.int32(a[d, s, iy, ix, c]))
        if not wide:
            acc = np.int64(acc32)
        if parts == 1:
            g[d, kh, kw, c, o] = acc
        elif acc != 0:
            cuda.atomic.add(g, (d, kh, kw, c, o), acc)


#: the kernels of a training step (integer-only)
KERNELS = (conv_forward, conv_backward_data, conv_weight_grad)


@implements(Conv2d, backend="cuda")
class CudaConv2d(CudaWeightLayer, IntConv2d):
    """The conv on the CUDA engine (``IntConv2d``'s weights layout and counter order)."""

    def grad_parts(self, stack: Stack) -> int:
        """How many parts the gradient's sample sum is split into (atomics join them)."""
        if dev.simulator():
            return min(2, stack.capacity)
        size = int(np.prod(self.weight_shape)) * stack.devices
        return max(1, min(stack.capacity, GRAD_THREADS // max(1, size)))

    def cuda_forward(self, model: IntModel, stack: Stack, weights: Weights,
                     prev: DeviceArray, out: DeviceArray, n: DeviceArray) -> None:
        lay = self.layer
        per = int(np.prod(self.out_shape))
        dev.launch(conv_forward, stack.capacity * per, stack.devices, prev,
                   weights.t[self.param], lay.stride, lay.padding, self.shift, model.amax,
                   self.relu, out, n)

    def cuda_input_error(self, model: IntModel, stack: Stack, weights: Weights,
                         eq: DeviceArray, dst: DeviceArray, n: DeviceArray) -> None:
        lay = self.layer
        per = int(np.prod(self.in_shape))
        dev.launch(conv_backward_data, stack.capacity * per, stack.devices, eq,
                   weights.t[self.param], lay.stride, lay.padding, dst, n)

    def cuda_grad(self, model: IntModel, stack: Stack, eq: DeviceArray, a_in: DeviceArray,
                  g: DeviceArray, n: DeviceArray) -> None:
        lay = self.layer
        parts = self.grad_parts(stack)
        size = int(np.prod(self.weight_shape))
        if parts > 1:
            g2 = g.reshape(stack.devices, size)
            dev.launch(fill, size, stack.devices, g2, 0)
        dev.launch(conv_weight_grad, size * parts, stack.devices, eq, a_in, lay.stride,
                   lay.padding, g, n, parts, g.dtype == np.int64)
