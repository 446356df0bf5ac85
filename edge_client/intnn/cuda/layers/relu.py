"""The CUDA engine's stand-alone ReLU (one right after a conv or linear layer is fused into
that layer's forward): ``kernels.relu_forward`` / ``relu_mask`` on flat views."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from edge_client.intnn.cuda import device as dev
from edge_client.intnn.cuda.kernels import relu_forward, relu_mask
from edge_client.intnn.cuda.layers.base import CudaLayer
from edge_client.intnn.layers.base import IntLayer, implements
from firmware_models import ReLU

if TYPE_CHECKING:  # pragma: no cover
    from edge_client.intnn.cuda.device import DeviceArray
    from edge_client.intnn.cuda.stack import Stack, Weights
    from edge_client.intnn.model import IntModel


@implements(ReLU, backend="cuda")
class CudaReLU(CudaLayer, IntLayer):
    """``max(0, a)``; its backward zeroes the error where the output is 0, in place."""

    def link(self, prev: IntLayer | None) -> None:
        self.order = prev.order if prev is not None else None

    def relu_out(self, relu_in: bool) -> bool:
        return True

    def has_input_error(self) -> bool:
        return False

    def _flat(self, a: DeviceArray, stack: Stack) -> DeviceArray:
        return a.reshape(stack.devices, stack.capacity * int(np.prod(self.out_shape)))

    def cuda_forward(self, model: IntModel, stack: Stack, weights: Weights,
                     prev: DeviceArray, out: DeviceArray, n: DeviceArray) -> None:
        per = int(np.prod(self.out_shape))
        dev.launch(relu_forward, stack.capacity * per, stack.devices, self._flat(prev, stack),
                   self._flat(out, stack), n, per)

    def cuda_backward(self, model: IntModel, stack: Stack, cur: DeviceArray,
                      n: DeviceArray) -> DeviceArray:
        per = int(np.prod(self.out_shape))
        dev.launch(relu_mask, stack.capacity * per, stack.devices, self._flat(cur, stack),
                   self._flat(stack.acts[self.index], stack), n, per)
        return cur
