"""The CUDA engine's fully connected layer: weights ``[D, F, O]`` (``IntLinear``'s layout,
its columns after a flatten in the engine's (h, w, c) order, its counter over ``[O,
F]``), activations ``[D, N, F]``: forward, backward-data and weight gradient, one thread
per output element, int32 sums (int64 for a gradient that may exceed it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from edge_client.intnn.cuda import device as dev
from edge_client.intnn.cuda.arith import finish
from edge_client.intnn.cuda.device import cuda
from edge_client.intnn.cuda.layers.base import CudaWeightLayer
from edge_client.intnn.layers.base import implements
from edge_client.intnn.layers.linear import IntLinear
from firmware_models import Linear

if TYPE_CHECKING:  # pragma: no cover
    from edge_client.intnn.cuda.device import DeviceArray
    from edge_client.intnn.cuda.stack import Stack, Weights
    from edge_client.intnn.model import IntModel


@cuda.jit(cache=True)
def linear_forward(a, t, shift, amax, relu, out, n):
    """``out[d, s, o] = finish(sum_f a[d, s, f] t[d, f, o])``."""
    d = cuda.blockIdx.y
    f_in, f_out = t.shape[1], t.shape[2]
    for e in range(cuda.grid(1), n[d] * f_out, cuda.gridsize(1)):
        s = e // f_out
        o = e - s * f_out
        acc = np.int32(0)
        for f in range(f_in):
            acc = np.int32(acc + np.int32(a[d, s, f]) * np.int32(t[d, f, o]))
        out[d, s, o] = finish(acc, shift, amax, relu)


@cuda.jit(cache=True)
def linear_backward_data(eq, t, dst, n):
    """``dst[d, s, f] = sum_o eq[d, s, o] t[d, f, o]`` (int32)."""
    d = cuda.blockIdx.y
    f_in, f_out = t.shape[1], t.shape[2]
    for e in range(cuda.grid(1), n[d] * f_in, cuda.gridsize(1)):
        s = e // f_in
        f = e - s * f_in
        acc = np.int32(0)
        for o in range(f_out):
            acc = np.int32(acc + np.int32(eq[d, s, o]) * np.int32(t[d, f, o]))
        dst[d, s, f] = acc


@cuda.jit(cache=True)
def linear_weight_grad(eq, a, g, n, wide):
    """``g[d, f, o] = sum_s eq[d, s, o] a[d, s, f]`` (int64 sums where ``wide``)."""
    d = cuda.blockIdx.y
    f_in, f_out = g.shape[1], g.shape[2]
    for e in range(cuda.grid(1), f_in * f_out, cuda.gridsize(1)):
        f = e // f_out
        o = e - f * f_out
        acc = np.int64(0)
        acc32 = np.int32(0)
        for s in range(n[d]):
            if wide:
                acc += np.int64(eq[d, s, o]) * np.int64(a[d, s, f])
            else:
                acc32 = np.int32(acc32 + np.int32(eq[d, s, o]) * np.int32(a[d, s, f]))
        if not wide:
            acc = np.int64(acc32)
        g[d, f, o] = acc


#: the kernels of a training step (integer-only)
KERNELS = (linear_forward, linear_backward_data, linear_weight_grad)


@implements(Linear, backend="cuda")
class CudaLinear(CudaWeightLayer, IntLinear):
    """The linear layer on the CUDA engine (``IntLinear``'s layout and counter order)."""

    def cuda_forward(self, model: IntModel, stack: Stack, weights: Weights,
                     prev: DeviceArray, out: DeviceArray, n: DeviceArray) -> None:
        a = prev.reshape(stack.devices, stack.capacity, self.in_shape[0])
        dev.launch(linear_forward, stack.capacity * self.out_shape[0], stack.devices, a,
                   weights.t[self.param], self.shift, model.amax, self.relu, out, n)

    def cuda_input_error(self, model: IntModel, stack: Stack, weights: Weights,
                         eq: DeviceArray, dst: DeviceArray, n: DeviceArray) -> None:
        d2 = dst.reshape(stack.devices, stack.capacity, self.in_shape[0])
        dev.launch(linear_backward_data, stack.capacity * self.in_shape[0], stack.devices,
                   eq, weights.t[self.param], d2, n)

    def cuda_grad(self, model: IntModel, stack: Stack, eq: DeviceArray, a_in: DeviceArray,
                  g: DeviceArray, n: DeviceArray) -> None:
        a = a_in.reshape(stack.devices, stack.capacity, self.in_shape[0])
        dev.launch(linear_weight_grad, int(np.prod(self.weight_shape)), stack.devices, eq, a,
                   g, n, g.dtype == np.int64)
