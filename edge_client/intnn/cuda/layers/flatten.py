"""The CUDA engine's flatten: a view of its input (NHWC, so its outputs are in (h, w, c)
order, as the CPU engine's; the linear layer after it permutes its columns to match)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from edge_client.intnn.cuda.layers.base import CudaLayer
from edge_client.intnn.layers.base import IntLayer, implements
from firmware_models import Flatten

if TYPE_CHECKING:  # pragma: no cover
    from edge_client.intnn.cuda.device import DeviceArray
    from edge_client.intnn.cuda.stack import Stack, Weights
    from edge_client.intnn.model import IntModel


@implements(Flatten, backend="cuda")
class CudaFlatten(CudaLayer, IntLayer):
    """No kernel: the output is the input's view (``view``)."""

    view = True

    def link(self, prev: IntLayer | None) -> None:
        if len(self.in_shape) == 3:
            h, w, c = self.in_shape
            self.order = np.arange(c * h * w).reshape(c, h, w).transpose(1, 2, 0).ravel()

    def relu_out(self, relu_in: bool) -> bool:
        return relu_in

    def cuda_forward(self, model: IntModel, stack: Stack, weights: Weights,
                     prev: DeviceArray, out: DeviceArray, n: DeviceArray) -> None:
        """Nothing to run: ``out`` is ``prev``'s view."""

    def cuda_backward(self, model: IntModel, stack: Stack, cur: DeviceArray,
                      n: DeviceArray) -> DeviceArray:
        return cur.reshape(stack.devices, stack.capacity, *self.in_shape)
