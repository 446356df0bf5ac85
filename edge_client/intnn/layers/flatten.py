"""The integer engine's flatten: a view of its input, NHWC, so its outputs are in
(h, w, c) order; the linear layer after it permutes its weight columns to match."""

from __future__ import annotations

import numpy as np

from edge_client.intnn.layers.base import IntLayer, Numerics, ParamPass, implements
from edge_client.intnn.workspace import Workspace
from firmware_models import Flatten


def _no_kernel() -> None:
    """A flatten's forward: its output is a view of its input."""


@implements(Flatten)
class CpuFlatten(IntLayer):
    """No kernel: the output is the input's view (``view``)."""

    view = True

    def link(self, prev: IntLayer | None) -> None:
        if len(self.in_shape) == 3:
            h, w, c = self.in_shape
            self.order = np.arange(c * h * w).reshape(c, h, w).transpose(1, 2, 0).ravel()

    def relu_out(self, relu_in: bool) -> bool:
        return relu_in

    def has_input_error(self) -> bool:
        return False

    def forward_task(self, model: Numerics, ws: Workspace, prev: np.ndarray, out: np.ndarray,
                     n: int):
        return _no_kernel, lambda t, lo, hi: ()

    def backward(self, model: Numerics, ws: Workspace, cur: np.ndarray, kq: int, n: int,
                 front: ParamPass | None) -> tuple[np.ndarray, int]:
        return cur.reshape(n, *self.in_shape), kq
